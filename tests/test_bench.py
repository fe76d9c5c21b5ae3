"""The benchmark workloads and `tinyllm bench` as a user runs it."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from matplotlib.image import imread

from tinyllm.entrypoints import llm as llm_module
from tinyllm.entrypoints.args import build_llm
from tinyllm.entrypoints.bench.args import add_bench_args
from tinyllm.entrypoints.bench.machine import Machine
from tinyllm.entrypoints.bench.offline import weight_bytes_per_token, workload_flops
from tinyllm.entrypoints.bench.report import (
    PLOT_DPI,
    PLOT_SIZE,
    OfflineResult,
    Run,
    plot,
    summary,
    to_json,
)
from tinyllm.entrypoints.workloads import WORKLOADS, Request, Workload, make_requests
from tinyllm.host.threads import default_threads
from tinyllm.model.config import ModelConfig
from tinyllm.model.families import build_model
from tinyllm.model.precision import resolve_dtype

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOT_PIXELS = (round(PLOT_SIZE[1] * PLOT_DPI), round(PLOT_SIZE[0] * PLOT_DPI))  # rows, columns

# The activations' dtype `auto` picks on this machine: bf16 with AMX, else fp32.
AUTO_DTYPE = str(resolve_dtype("auto", torch.device("cpu"))[0]).removeprefix("torch.")


@pytest.mark.parametrize("name", sorted(n for n, w in WORKLOADS.items() if isinstance(w, Workload)))
def test_workloads_are_reproducible_and_in_range(name):
    w = WORKLOADS[name]
    a, b = make_requests(name, 49152, seed=3), make_requests(name, 49152, seed=3)
    assert a == b and a != make_requests(name, 49152, seed=4)
    assert len(a) == w.num_requests * w.turns  # a chat replay: every turn's new tokens
    for r in a:
        own = len(r.prompt_token_ids) - w.shared_prefix
        assert w.prompt_len[0] <= own <= w.prompt_len[1]
        assert w.output_len[0] <= r.max_tokens <= w.output_len[1]
        assert all(100 <= t < 49152 - 100 for t in r.prompt_token_ids)
    if w.shared_prefix:
        assert len({tuple(r.prompt_token_ids[: w.shared_prefix]) for r in a}) == 1


def test_threads_default_to_omp_num_threads_else_the_allowed_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == len(os.sched_getaffinity(0))


def test_engine_flags_reach_the_llm(monkeypatch):
    made = {}
    monkeypatch.setattr(llm_module, "LLM", lambda **kwargs: made.update(kwargs))
    # The bench parser alone: see test_bench_serve.bench_serve on importing the CLI module.
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["offline", "--threads", "1", "--max-num-batched-tokens", "64"])
    build_llm(args)  # LLM sets torch's threads: tests/test_threads.py
    assert made["threads"] == 1 and made["max_num_batched_tokens"] == 64
    build_llm(parser.parse_args(["offline"]))
    assert made["threads"] == default_threads()


def _result() -> OfflineResult:
    machine = Machine("cpu", 2, "AVX2", gemm_flops=100e9, read_bandwidth=20e9)
    runs = [Run("tinyllm", 4, 600, 200, 10.0), Run("transformers", 4, 600, 200, 25.0)]
    weights = "int4 weights, bfloat16 activations"
    return OfflineResult(
        "offline-small", 7, runs, 500e9, 2**29, weights, machine, {"threads": None}
    )


def test_summary_says_how_the_weights_ran_and_their_bandwidth_bound():
    res = _result()
    assert res.bandwidth_bound == pytest.approx(20e9 / 2**29)  # 37.3 steps/s
    text = summary(res)
    assert "int4 weights, bfloat16 activations, 512 MiB of weights read per decode step" in text
    assert "at most 37 steps/s" in text
    one = dataclasses.replace(res, runs=[Run("tinyllm", 1, 128, 256, 10.0)])
    # 25.6 tok/s of a 37.25 steps/s bound
    assert (
        summary(one).splitlines()[-1]
        == "single stream: tinyllm 25.6 tok/s, 69% of the bandwidth bound"
    )


def test_weight_bytes_per_token_counts_weights_as_stored(tiny):
    model, _ = tiny
    dense = sum(p.numel() * 4 for p in model.parameters())
    table = model.model.embed_tokens.weight.numel() * 4
    assert model.config.tie_word_embeddings is False
    assert weight_bytes_per_token(model) == dense - table  # the table is read a row a token


def _qwen3_moe(**sizes) -> ModelConfig:
    dims = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)
    return ModelConfig("qwen3_moe", **dims, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=64, **sizes)  # fmt: skip


def test_a_mixture_of_experts_step_reads_and_computes_only_its_tokens_experts():
    """Of 8 experts a token runs 2: a decode step reads a quarter of the experts' bytes, and
    each token costs the FLOPs of 2 experts and the router, not of 8."""
    moe = _qwen3_moe(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    with torch.device("meta"):
        model = build_model(moe)
    expert_bytes = 2 * 8 * 3 * 32 * 16 * 4  # layers x experts x (gate, up, down) x fp32
    others = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    table = 64 * 32 * 4
    assert weight_bytes_per_token(model) == others - table + expert_bytes // 4
    requests = [Request([1] * 10, 5)]
    # The same model with one dense MLP of the two experts' width in place of the experts.
    dense = dataclasses.replace(moe, num_experts=0, num_experts_per_tok=0, intermediate_size=32)
    router = 2 * 2 * 32 * 8 * (10 + 5 - 1)  # 2 FLOPs x layers x router weights x tokens
    assert workload_flops(moe, requests) == workload_flops(dense, requests) + router


def test_json_has_the_rates_and_their_ratio():
    res = to_json(_result())
    assert (res["workload"], res["seed"], res["requests"]) == ("offline-small", 7, 4)
    assert (res["prompt_tokens"], res["output_tokens"]) == (600, 200)
    assert res["machine"]["threads"] == 2 and res["machine"]["gemm_gflops"] == 100
    t, b = res["tinyllm"], res["baseline"]
    assert (t["output_tokens_per_s"], t["total_tokens_per_s"], t["requests_per_s"]) == (20, 80, 0.4)
    assert b["output_tokens_per_s"] == 8 and b["engine"] == "transformers"
    assert res["ratio"] == {"output_tokens_per_s": 2.5, "total_tokens_per_s": 2.5}
    assert t["fraction_of_gemm_peak"] == pytest.approx(500e9 / 10.0 / 100e9)
    assert "2.50x" in summary(_result()).splitlines()[-1]


def test_plot_is_a_png_of_the_set_size(tmp_path):
    path = tmp_path / "bench.png"
    plot(_result(), path)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(path).shape[:2] == PLOT_PIXELS


@pytest.mark.slow
def test_bench_reports_both_engines_in_table_json_and_plot(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinyllm.entrypoints.cli",
            "bench",
            "offline-small",
            "--num-requests",
            "1",
            "--threads",
            "1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    requests = make_requests("offline-small", 49152, 0, 1)
    res = json.loads(out_json.read_text())
    prompt = sum(len(q.prompt_token_ids) for q in requests)
    output = sum(q.max_tokens for q in requests)
    assert (res["requests"], res["prompt_tokens"], res["output_tokens"]) == (1, prompt, output)
    assert res["machine"]["threads"] == 1
    assert res["weights"] == f"int4 weights, {AUTO_DTYPE} activations"  # the default model's
    t, b = res["tinyllm"], res["baseline"]
    assert t["output_tokens_per_s"] * t["seconds"] == pytest.approx(output)
    assert b["total_tokens_per_s"] * b["seconds"] == pytest.approx(prompt + output)
    ratio = t["output_tokens_per_s"] / b["output_tokens_per_s"]
    assert res["ratio"]["output_tokens_per_s"] == pytest.approx(ratio)

    # The table says the same as the JSON.
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.strip()}
    assert rows["tinyllm"][1:3] == rows["transformers"][1:3] == ["1", str(output)]
    assert rows["tinyllm/transformers"][1] == f"{ratio:.2f}x"
    # Each phase is announced on stderr before it runs, in order.
    phases = [line for line in r.stderr.splitlines() if line.startswith("bench: ")]
    expected = [
        "loading tinyllm",
        "loading the transformers baseline",
        "measuring the machine",
        "running tinyllm",
        "running the baseline",
    ]
    assert len(phases) == len(expected)
    for phase, start in zip(phases, expected, strict=True):
        assert phase.startswith(f"bench: {start}"), phases
    assert imread(out_png).shape[:2] == PLOT_PIXELS


def _tiny_llm(tiny, **config):
    from types import SimpleNamespace

    from tinyllm.engine.config import EngineConfig
    from tinyllm.engine.engine import LLMEngine

    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=64, block_size=4, **config))
    return SimpleNamespace(engine=engine, tokenizer=tok)


def test_chat_replay_resends_each_history_and_times_every_turn(tiny):
    from tinyllm.entrypoints.bench.offline import run_chat_replay, without_prefix_caching
    from tinyllm.entrypoints.workloads import Request

    conversations = [
        [Request([10 + c, 11, 12, 13, 14], 4), Request([20, 21, 22], 4), Request([30, 31], 3)]
        for c in range(2)
    ]
    llm = _tiny_llm(tiny)
    run, sent = run_chat_replay(llm, conversations)
    assert len(sent) == 6 and run.requests == 6 and run.output_tokens == 2 * (4 + 4 + 3)
    for c in range(2):  # each turn: the previous prompt, its 4-token answer, the new tokens
        turns = [r.prompt_token_ids for r in sent if r.prompt_token_ids[0] == 10 + c]
        assert len(turns) == 3 and turns[0] == conversations[c][0].prompt_token_ids
        assert len(turns[1]) == 5 + 4 + 3 and turns[1][:5] == turns[0]
        assert turns[1][-3:] == [20, 21, 22] and turns[2][:12] == turns[1]
    assert len(run.ttft_by_turn) == 3 and all(t > 0 for t in run.ttft_by_turn)
    # A turn finds what the previous one computed, in whole blocks of 4: its prompt and its
    # answer but the last token (sampled, never run): turn 2, 5 + 3 tokens -> 8 cached; turn 3,
    # 12 + 3 -> 12.
    hits = 2 * (8 + 12)
    queried = 2 * (5 + 12 + 18)
    assert run.hit_rate == pytest.approx(hits / queried)
    off, _ = run_chat_replay(without_prefix_caching(llm), conversations, "no-prefix-caching")
    assert off.hit_rate is None and off.ttft is not None and off.engine == "no-prefix-caching"


def test_summary_and_json_show_ttft_hit_rate_and_ttft_by_turn():
    res = _result()
    on = dataclasses.replace(res.runs[0], ttft=0.05, hit_rate=0.8, ttft_by_turn=(0.1, 0.02))
    off = Run("no-prefix-caching", 4, 600, 200, 20.0, ttft=0.5, hit_rate=None)
    res = dataclasses.replace(res, runs=[on, off])
    rows = {line.split()[0]: line.split() for line in summary(res).splitlines()}
    assert rows["tinyllm"][-2:] == ["50", "80.0"] and rows["no-prefix-caching"][-2:] == ["500", "-"]
    assert rows["tinyllm/no-prefix-caching"][1:] == ["2.00x", "2.00x", "1/10.00"]
    assert "tinyllm: TTFT by turn, ms: 100 20" in summary(res)
    t, b = to_json(res)["tinyllm"], to_json(res)["baseline"]
    assert (t["ttft_s"], t["prefix_cache_hit_rate"]) == (0.05, 0.8)
    assert t["ttft_by_turn_s"] == [0.1, 0.02]
    assert (b["ttft_s"], b["prefix_cache_hit_rate"], b["ttft_by_turn_s"]) == (0.5, None, None)


@pytest.mark.parametrize(
    ("workload", "given", "chosen"),
    [
        ("shared-prefix", "auto", "no-prefix-caching"),
        ("multi-turn", "auto", "no-prefix-caching"),
        ("offline", "auto", "transformers"),
        ("shared-prefix", "transformers", "transformers"),
        ("offline", "none", "none"),
    ],
)
def test_auto_baseline_is_caching_off_for_the_caching_workloads(workload, given, chosen):
    from tinyllm.entrypoints.bench.offline import baseline_for

    assert baseline_for(workload, given) == chosen


def test_a_chat_replay_has_no_transformers_baseline():
    from tinyllm.entrypoints.bench.offline import baseline_for

    with pytest.raises(ValueError, match="--baseline transformers cannot replay multi-turn"):
        baseline_for("multi-turn", "transformers")


@pytest.mark.parametrize(
    ("workload", "given", "chosen"),
    [
        ("offline", "auto", "unconstrained"),
        ("offline", "none", "none"),
        ("single", "unconstrained", "unconstrained"),
    ],
)
def test_a_constrained_run_is_measured_against_itself_unconstrained(workload, given, chosen):
    from tinyllm.entrypoints.bench.offline import baseline_for

    assert baseline_for(workload, given, "json") == chosen


@pytest.mark.parametrize(
    ("workload", "given", "structured", "message"),
    [
        (
            "offline",
            "transformers",
            "json",
            "--structured compares with the same run unconstrained",
        ),
        ("multi-turn", "auto", "json", "--structured runs single-turn workloads"),
        ("offline", "unconstrained", None, "--baseline unconstrained needs --structured"),
    ],
)
def test_structured_baselines_that_cannot_compare(workload, given, structured, message):
    from tinyllm.entrypoints.bench.offline import baseline_for

    with pytest.raises(ValueError, match=message):
        baseline_for(workload, given, structured)


def test_a_speculative_run_is_measured_against_itself_without_speculation():
    from tinyllm.entrypoints.bench.offline import baseline_for

    assert baseline_for("grounded", "auto", speculative=True) == "no-speculation"
    assert baseline_for("grounded", "transformers", speculative=True) == "transformers"
    with pytest.raises(ValueError, match="no-speculation needs --speculative-config"):
        baseline_for("grounded", "no-speculation")


def test_summary_and_json_show_the_drafts():
    from tinyllm.engine.spec_decode.speculator import SpecStats

    res = _result()
    spec = SpecStats(num_drafts=50, num_draft_tokens=200, num_accepted_tokens=120)
    res = dataclasses.replace(res, runs=[dataclasses.replace(res.runs[0], spec=spec)])
    assert (
        "tinyllm: speculative decoding: 50 rows verified with drafts, 120 of 200 draft tokens "
        "accepted (60%), mean acceptance length 3.40" in summary(res)
    )
    assert to_json(res)["tinyllm"]["spec_decode"] == {
        "num_drafts": 50,
        "num_draft_tokens": 200,
        "num_accepted_tokens": 120,
        "mean_acceptance_length": 3.4,
    }


def test_a_sampled_run_says_its_temperature():
    res = dataclasses.replace(_result(), temperature=0.8)
    assert (
        summary(res)
        .splitlines()[0]
        .startswith("workload offline-small: 4 requests, sampled at temperature 0.8, seed 7")
    )
    assert to_json(res)["temperature"] == 0.8 and to_json(_result())["temperature"] == 0.0


def test_summary_and_json_show_what_the_token_masks_cost():
    from tinyllm.engine.structured_output.grammar import GrammarStats

    res = _result()
    cost = GrammarStats(steps=100, rows=1600, forced=400, seconds=0.5)
    runs = [dataclasses.replace(res.runs[0], engine="tinyllm json", grammar=cost), res.runs[1]]
    res = dataclasses.replace(res, runs=runs)
    assert (
        "tinyllm json: token masks 5.00 ms per step (312 us per row, 5.0% of the run); 25% of "
        "the 1600 constrained tokens were forced" in summary(res)
    )
    masks = to_json(res)["tinyllm"]["token_masks"]
    assert masks == {
        "steps": 100,
        "rows": 1600,
        "forced_rows": 400,
        "seconds": 0.5,
        "ms_per_step": 5.0,
    }
    assert to_json(res)["baseline"]["token_masks"] is None


@pytest.mark.slow
def test_a_constrained_run_and_its_baseline_make_the_same_tokens(default_config_llm):
    """`--structured json`: each request ends where its JSON does (at most at its length); the
    baseline then makes as many tokens per request, unconstrained; the masks' cost counts each
    constrained token once, the warm-up's not."""
    from tinyllm.engine.structured_output.params import StructuredOutputsParams
    from tinyllm.entrypoints.bench.offline import run_tinyllm
    from tinyllm.entrypoints.workloads import STRUCTURED_SCHEMAS, Request

    asked = [Request(r.prompt_token_ids[:40], 24) for r in make_requests("offline", 49152, 0, 3)]
    constraint = StructuredOutputsParams(json=STRUCTURED_SCHEMAS["json"])
    run, made = run_tinyllm(default_config_llm, asked, "tinyllm json", constraint)
    assert [m.prompt_token_ids for m in made] == [a.prompt_token_ids for a in asked]
    assert all(1 <= m.max_tokens <= 24 for m in made)
    cost = run.grammar
    assert cost.rows == run.output_tokens == sum(m.max_tokens for m in made)
    assert max(m.max_tokens for m in made) <= cost.steps <= cost.rows
    assert 0 < cost.forced < cost.rows and cost.seconds > 0
    base, same = run_tinyllm(default_config_llm, made, "unconstrained")
    assert same == made and base.output_tokens == run.output_tokens and base.grammar is None


def test_one_request_at_a_time_is_reported_as_a_single_stream():
    res = dataclasses.replace(_result(), max_concurrency=1)  # 4 requests, one at a time
    lines = summary(res).splitlines()
    assert lines[0].startswith("workload offline-small: 4 requests (at most 1 at once), seed 7")
    assert lines[-1] == "single stream: tinyllm 20.0 tok/s, 54% of the bandwidth bound"
    assert to_json(res)["max_concurrency"] == 1
    batched = dataclasses.replace(_result(), max_concurrency=2)
    assert "single stream" not in summary(batched) and "(at most 2 at once)" in summary(batched)
    assert (
        "single stream" not in summary(_result()) and to_json(_result())["max_concurrency"] is None
    )
