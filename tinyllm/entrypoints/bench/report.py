"""What an offline bench measured, and how it is shown: the table, the JSON, the plot."""

import json
from dataclasses import dataclass
from pathlib import Path

from tinyllm.engine.spec_decode.speculator import SpecStats
from tinyllm.engine.structured_output.grammar import GrammarStats
from tinyllm.entrypoints.bench.machine import Machine
from tinyllm.entrypoints.workloads import Request

PLOT_SIZE = (9.0, 4.5)  # inches
PLOT_DPI = 100


@dataclass(frozen=True)
class Run:
    engine: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    # Measured where the engine reports them (tinyllm's runs, not the transformers baseline):
    ttft: float | None = None  # mean seconds from a request's submission to its first token
    hit_rate: float | None = None  # prefix cache: hit / queried prompt tokens
    ttft_by_turn: tuple[float, ...] | None = None  # a chat replay's mean TTFT at each turn
    grammar: GrammarStats | None = None  # a constrained run's token masks: their cost
    spec: SpecStats | None = None  # speculative decoding's drafts, with it on

    @property
    def output_rate(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_rate(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def request_rate(self) -> float:
        return self.requests / self.seconds


def threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def measured(engine: str, requests: list[Request], seconds: float, **engine_stats) -> Run:
    """A run that made every request's max_tokens (both engines ignore EOS); `engine_stats`:
    the Run's fields that only tinyllm's runs measure (TTFT, hit rate, drafts)."""
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.max_tokens for r in requests)
    return Run(engine, len(requests), prompt, output, seconds, **engine_stats)


@dataclass(frozen=True)
class OfflineResult:
    workload: str
    seed: int
    runs: list[Run]  # tinyllm first, then the baseline if one ran
    flops: float  # what the workload needs, whatever the engine
    weight_bytes: int  # tinyllm's weights read per decode step, as stored
    weights: str  # how tinyllm's weights ran: "int4 weights, bfloat16 activations"
    machine: Machine
    engine_args: dict[str, object]
    max_concurrency: int | None = None  # requests in flight at once (None: all)
    temperature: float = 0.0  # tinyllm's runs' (0: greedy)

    @property
    def single_stream(self) -> bool:
        """One request at a time: each output token is a decode step of one row."""
        return self.runs[0].requests == 1 or self.max_concurrency == 1

    @property
    def bandwidth_bound(self) -> float:
        """Decode steps per second if each did nothing but read tinyllm's weights at the
        measured read bandwidth."""
        return self.machine.read_bandwidth / self.weight_bytes

    @property
    def ratios(self) -> tuple[float, float] | None:
        """tinyllm / baseline, output and total tokens/s; None without a baseline."""
        if len(self.runs) < 2:
            return None
        a, b = self.runs
        return a.output_rate / b.output_rate, a.total_rate / b.total_rate


# -- the table -----------------------------------------------------------------------------------

_COLUMNS = ["engine", "requests", "out tok", "wall s", "out tok/s", "total tok/s", "GFLOP/s"]


def _row(cells: list[str]) -> str:
    return f"{cells[0]:<26}" + "".join(f"{c:>12}" for c in cells[1:])


def _maybe(value: float | None, scale: float, fmt: str) -> str:
    return "-" if value is None else format(scale * value, fmt)


def summary(res: OfflineResult) -> str:
    m, first = res.machine, res.runs[0]
    at_once = "" if res.max_concurrency is None else f" (at most {res.max_concurrency} at once)"
    if res.temperature:
        at_once += f", sampled at temperature {res.temperature:g}"
    lines = [
        f"workload {res.workload}: {first.requests} requests{at_once}, seed {res.seed}, "
        f"{first.prompt_tokens} prompt + {first.output_tokens} output tokens, "
        f"{res.flops / 1e12:.2f} TFLOP",
        f"machine: {m.device} ({m.cpu_capability}), {threads(m.threads)}, "
        f"fp32 GEMM {m.gemm_flops / 1e9:.1f} GFLOP/s, read {m.read_bandwidth / 1e9:.1f} GB/s",
        f"tinyllm: {res.weights}, {res.weight_bytes / 2**20:.0f} MiB of weights read per "
        f"decode step: at the read bandwidth, at most {res.bandwidth_bound:.0f} steps/s",
        _row(_COLUMNS + ["% peak", "TTFT ms", "hit %"]),
    ]
    for r in res.runs:
        rate = res.flops / r.seconds
        cells = [r.engine, str(r.requests), str(r.output_tokens), f"{r.seconds:.1f}"]
        cells += [f"{r.output_rate:.1f}", f"{r.total_rate:.1f}", f"{rate / 1e9:.1f}"]
        cells += [f"{100 * rate / m.gemm_flops:.1f}%", _maybe(r.ttft, 1e3, ".0f")]
        lines.append(_row(cells + [_maybe(r.hit_rate, 100, ".1f")]))
    if res.ratios is not None:
        a, b = res.runs
        cells = [f"{a.engine}/{b.engine}", "", "", ""] + [f"{x:.2f}x" for x in res.ratios]
        if a.ttft and b.ttft:  # how many times lower
            cells += ["", "", f"1/{b.ttft / a.ttft:.2f}"]
        lines.append(_row(cells))
    for r in res.runs:
        if r.ttft_by_turn:
            turns = " ".join(f"{1e3 * t:.0f}" for t in r.ttft_by_turn)
            lines.append(f"{r.engine}: TTFT by turn, ms: {turns}")
    for r in res.runs:
        if r.grammar is not None:
            lines.append(_grammar_line(r))
        if r.spec is not None:
            lines.append(_spec_line(r.engine, r.spec))
    if res.single_stream:
        lines.append(
            f"single stream: tinyllm {first.output_rate:.1f} tok/s, "
            f"{first.output_rate / res.bandwidth_bound:.0%} of the bandwidth bound"
        )
    return "\n".join(lines)


def _grammar_line(r: Run) -> str:
    g = r.grammar
    per_step = g.seconds / g.steps if g.steps else 0.0
    per_row = g.seconds / g.rows if g.rows else 0.0
    forced = g.forced / g.rows if g.rows else 0.0
    return (
        f"{r.engine}: token masks {1e3 * per_step:.2f} ms per step ({1e6 * per_row:.0f} us per "
        f"row, {g.seconds / r.seconds:.1%} of the run); {forced:.0%} of the {g.rows} constrained "
        "tokens were forced (the mask allowed one token), and sampled like any other"
    )


def _spec_line(engine: str, s: SpecStats) -> str:
    accepted = s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0
    return (
        f"{engine}: speculative decoding: {s.num_drafts} rows verified with drafts, "
        f"{s.num_accepted_tokens} of {s.num_draft_tokens} draft tokens accepted ({accepted:.0%}), "
        f"mean acceptance length {s.mean_acceptance_length:.2f}"
    )


def _spec_json(s: SpecStats) -> dict:
    return {
        "num_drafts": s.num_drafts,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "mean_acceptance_length": s.mean_acceptance_length,
    }


# -- JSON ----------------------------------------------------------------------------------------


def _run_json(r: Run, res: OfflineResult) -> dict:
    achieved = res.flops / r.seconds
    return {
        "engine": r.engine,
        "seconds": r.seconds,
        "output_tokens_per_s": r.output_rate,
        "total_tokens_per_s": r.total_rate,
        "requests_per_s": r.request_rate,
        "gflops": achieved / 1e9,
        "fraction_of_gemm_peak": achieved / res.machine.gemm_flops,
        "ttft_s": r.ttft,
        "prefix_cache_hit_rate": r.hit_rate,
        "ttft_by_turn_s": list(r.ttft_by_turn) if r.ttft_by_turn else None,
        "token_masks": None if r.grammar is None else _grammar_json(r.grammar),
        "spec_decode": None if r.spec is None else _spec_json(r.spec),
    }


def _grammar_json(g: GrammarStats) -> dict:
    return {
        "steps": g.steps,
        "rows": g.rows,
        "forced_rows": g.forced,
        "seconds": g.seconds,
        "ms_per_step": 1e3 * g.seconds / g.steps if g.steps else None,
    }


def to_json(res: OfflineResult) -> dict:
    m, first = res.machine, res.runs[0]
    ratios = res.ratios
    return {
        "workload": res.workload,
        "seed": res.seed,
        "temperature": res.temperature,
        "requests": first.requests,
        "max_concurrency": res.max_concurrency,
        "prompt_tokens": first.prompt_tokens,
        "output_tokens": first.output_tokens,
        "workload_tflop": res.flops / 1e12,
        "weight_mib": res.weight_bytes / 2**20,
        "weights": res.weights,
        "bandwidth_bound_steps_per_s": res.bandwidth_bound,
        "machine": {
            "device": m.device,
            "threads": m.threads,
            "cpu_capability": m.cpu_capability,
            "gemm_gflops": m.gemm_flops / 1e9,
            "read_gb_per_s": m.read_bandwidth / 1e9,
        },
        "engine_args": res.engine_args,
        "tinyllm": _run_json(first, res),
        "baseline": _run_json(res.runs[1], res) if ratios else None,
        "ratio": (
            {"output_tokens_per_s": ratios[0], "total_tokens_per_s": ratios[1]} if ratios else None
        ),
    }


def write_json(res: OfflineResult, path: Path) -> None:
    path.write_text(json.dumps(to_json(res), indent=2) + "\n")


# -- the plot ------------------------------------------------------------------------------------


def plot(res: OfflineResult, path: Path) -> None:
    """A PNG: output and total tokens/s of each engine side by side, the ratio in the title."""
    # The Agg canvas directly, not pyplot: no global figure state and no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    engines = [r.engine for r in res.runs]
    colors = ["tab:blue", "tab:gray"][: len(engines)]
    panels = [
        ("output tokens/s", [r.output_rate for r in res.runs]),
        ("total tokens/s (prompt + output)", [r.total_rate for r in res.runs]),
    ]
    for ax, (label, rates) in zip(fig.subplots(1, 2), panels, strict=True):
        bars = ax.bar(engines, rates, color=colors)
        ax.bar_label(bars, fmt="%.1f")
        ax.set_xlabel("engine")
        ax.set_ylabel(label)
        ax.margins(y=0.15)  # room for the value labels above the bars
    m, first = res.machine, res.runs[0]
    title = f"tinyllm bench {res.workload}"
    if res.ratios is not None:
        title += f": {res.ratios[0]:.2f}x {res.runs[1].engine} in output tokens/s"
    fig.suptitle(
        f"{title}\n{first.requests} requests, {first.prompt_tokens} prompt + "
        f"{first.output_tokens} output tokens; {m.device} ({m.cpu_capability}), "
        f"{threads(m.threads)}"
    )
    fig.savefig(path, format="png")
