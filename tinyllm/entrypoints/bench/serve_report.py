"""What `tinyllm bench serve` measured, and how it is shown: the metrics of `vllm bench serve`,
its table layout and its JSON key names, so numbers taken with either tool line up."""

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Times are seconds since the benchmark started, on the client's clock.


@dataclass
class Outcome:
    """One request as the client saw it."""

    prompt_tokens: int  # the server's count once its usage chunk is in (a text prompt's)
    max_tokens: int
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    done: float = 0.0  # the end of the stream
    output_tokens: int = 0  # the server's count, from the stream's usage chunk
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache
    text: str = ""  # the answer, as streamed
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunks)]

    @property
    def tpot(self) -> float | None:
        """Per output token after the first; None for a single token (nothing to divide)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class ServeResult:
    base_url: str
    model: str
    seed: int
    request_rate: float
    max_concurrency: int | None
    duration: float
    outcomes: list[Outcome]
    long: Outcome | None = None  # the --long-prompt request, kept out of every other figure
    workload: str = "serve"
    turns: int = 1  # a chat replay's: outcomes are conversation after conversation, turn by turn

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is None]

    @property
    def first_error(self) -> str | None:
        return next((o.error for o in self.outcomes if o.error is not None), None)

    def window_itls(self) -> list[float] | None:
        """The other streams' inter-chunk gaps that overlap the long prompt's prefill, from its
        sending to its first chunk: a gap that spans a stall counts even if it began before.
        None without a long prompt that got its first chunk."""
        if self.long is None or self.long.error is not None:
            return None
        start, end = self.long.sent, self.long.chunks[0]
        pairs = itertools.chain.from_iterable(itertools.pairwise(o.chunks) for o in self.ok)
        return [b - a for a, b in pairs if b > start and a < end]


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    ms = np.asarray(seconds) * 1000
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"p99_{name}_ms"]
    if not len(ms):
        return dict.fromkeys(keys)
    values = [ms.mean(), np.median(ms), np.percentile(ms, 99)]
    return {k: float(v) for k, v in zip(keys, values, strict=True)}


def _cached(ok: list[Outcome]) -> int | None:
    """The prompt tokens the server took from its prefix cache; None where it did not say."""
    reported = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    return sum(reported) if reported else None


def metrics(res: ServeResult) -> dict[str, object]:
    """vLLM's aggregate metrics over the successful requests, and the server's cache hits."""
    ok = res.ok
    prompt = sum(o.prompt_tokens for o in ok)
    output = sum(o.output_tokens for o in ok)
    cached = _cached(ok)
    return {
        "completed": len(ok),
        "failed": len(res.outcomes) - len(ok),
        "first_error": res.first_error,
        "duration": res.duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "requested_output_tokens": sum(o.max_tokens for o in ok),
        "request_throughput": len(ok) / res.duration,
        "output_throughput": output / res.duration,
        "total_token_throughput": (prompt + output) / res.duration,
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": cached / prompt if cached is not None and prompt else None,
        **_stats("ttft", [o.ttft for o in ok]),
        **_stats("tpot", [t for o in ok if (t := o.tpot) is not None]),
        **_stats("itl", [g for o in ok for g in o.itls]),
        **_stats("e2el", [o.e2e for o in ok]),
    }


def turn_metrics(res: ServeResult) -> dict[str, object] | None:
    """A chat replay's median TTFT at each turn, over the conversations whose turn succeeded,
    and the last turn's over the first's: without a prefix cache it grows with the history."""
    if res.turns == 1:
        return None
    by_turn: list[list[float]] = [[] for _ in range(res.turns)]
    for i, o in enumerate(res.outcomes):
        if o.error is None:
            by_turn[i % res.turns].append(o.ttft * 1000)
    medians = [float(np.median(t)) if t else None for t in by_turn]
    first, last = medians[0], medians[-1]
    return {
        "turns": res.turns,
        "conversations": len(res.outcomes) // res.turns,
        "median_ttft_by_turn_ms": medians,
        "last_to_first_ttft": last / first if first and last is not None else None,
    }


def long_prompt_metrics(res: ServeResult) -> dict[str, object] | None:
    if res.long is None:
        return None
    long, gaps = res.long, res.window_itls()
    out: dict[str, object] = {"prompt_tokens": long.prompt_tokens, "error": long.error}
    if gaps is not None:
        out |= {
            "sent_s": long.sent,
            "ttft_ms": long.ttft * 1000,
            "window_itls": len(gaps),
            **_stats("itl", gaps),
            "max_itl_ms": max(gaps) * 1000 if gaps else None,
        }
    return out


# -- the table -----------------------------------------------------------------------------------

_WIDTH = 50


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label + ':':<40} {'n/a' if value is None else value}"


def _section(title: str, fill: str = "-") -> str:
    return f" {title} ".center(_WIDTH, fill)


def _latencies(m: dict[str, object], key: str, label: str) -> list[str]:
    return [
        _line(f"{stat.capitalize()} {label} (ms)", m[f"{stat}_{key}_ms"])
        for stat in ("mean", "median", "p99")
    ]


def table(res: ServeResult) -> str:
    m = metrics(res)
    rate = "inf" if math.isinf(res.request_rate) else f"{res.request_rate:g}"
    lines = [
        _section("Serving Benchmark Result", "="),
        _line("Successful requests", m["completed"]),
        _line("Failed requests", m["failed"]),
        _line("Request rate configured (RPS)", rate),
        _line("Maximum request concurrency", res.max_concurrency),
        _line("Benchmark duration (s)", m["duration"]),
        _line("Total input tokens", m["total_input_tokens"]),
        _line("Total generated tokens", m["total_output_tokens"]),
        _line("Requested generated tokens", m["requested_output_tokens"]),
        _line("Request throughput (req/s)", m["request_throughput"]),
        _line("Output token throughput (tok/s)", m["output_throughput"]),
        _line("Total token throughput (tok/s)", m["total_token_throughput"]),
        _line("Prompt tokens cached (server)", m["total_cached_tokens"]),
        _line(
            "Prefix cache hit rate (server, %)",
            None if m["prefix_cache_hit_rate"] is None else 100 * m["prefix_cache_hit_rate"],
        ),
        _section("Time to First Token"),
        *_latencies(m, "ttft", "TTFT"),
        _section("Time per Output Token (excl. 1st token)"),
        *_latencies(m, "tpot", "TPOT"),
        _section("Inter-token Latency"),
        *_latencies(m, "itl", "ITL"),
        _section("E2E Latency"),
        *_latencies(m, "e2el", "E2EL"),
    ]
    turns = turn_metrics(res)
    if turns is not None:
        lines += [
            _section(f"TTFT by turn, {turns['conversations']} conversations"),
            *(
                _line(f"Median TTFT turn {k} (ms)", t)
                for k, t in enumerate(turns["median_ttft_by_turn_ms"], 1)
            ),
            _line(f"TTFT turn {res.turns} / turn 1", turns["last_to_first_ttft"]),
        ]
    long = long_prompt_metrics(res)
    if long is not None:
        lines += [
            _section("Other streams while a long prompt prefills"),
            _line("Long prompt tokens", long["prompt_tokens"]),
        ]
        if long["error"] is not None:
            lines.append(_line("Long prompt failed", long["error"]))
        else:
            lines += [
                _line("Long prompt TTFT (ms)", long["ttft_ms"]),
                _line("Gaps in the prefill window", long["window_itls"]),
                *_latencies(long, "itl", "ITL"),
                _line("Max ITL (ms)", long["max_itl_ms"]),
            ]
    lines.append("=" * _WIDTH)
    if m["first_error"] is not None:
        lines.append(f"first error: {m['first_error']}")
    return "\n".join(lines)


# -- JSON ----------------------------------------------------------------------------------------


def to_json(res: ServeResult) -> dict[str, object]:
    def request(o: Outcome) -> dict[str, object]:
        ok = o.error is None
        return {
            "prompt_tokens": o.prompt_tokens,
            "max_tokens": o.max_tokens,
            "output_tokens": o.output_tokens,
            "cached_tokens": o.cached_tokens,
            "sent_s": o.sent,
            "ttft_ms": o.ttft * 1000 if ok else None,
            "e2el_ms": o.e2e * 1000 if ok else None,
            "itls_ms": [g * 1000 for g in o.itls] if ok else None,
            "error": o.error,
        }

    return {
        "base_url": res.base_url,
        "model": res.model,
        "workload": res.workload,
        "seed": res.seed,
        "num_prompts": len(res.outcomes),
        # JSON has no infinity; vLLM writes "inf" too.
        "request_rate": "inf" if math.isinf(res.request_rate) else res.request_rate,
        "max_concurrency": res.max_concurrency,
        **metrics(res),
        "multi_turn": turn_metrics(res),
        "long_prompt": long_prompt_metrics(res),
        "requests": [request(o) for o in res.outcomes],
    }


def write_json(res: ServeResult, path: Path) -> None:
    path.write_text(json.dumps(to_json(res), indent=2) + "\n")
