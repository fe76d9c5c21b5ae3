"""`tinyllm bench serve` as a user runs it: first against a scripted server whose chunks, token
counts, failures and stalls the test knows, then against the real server on the default model."""

import argparse
import asyncio
import copy
import dataclasses
import json
import math
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.http_server import serving
from tinyllm.engine.engine import LLMEngine
from tinyllm.entrypoints.bench.args import add_bench_args
from tinyllm.entrypoints.bench.serve import arrival_times
from tinyllm.entrypoints.bench.serve_chat import TURN_SEPARATOR, message, next_prompt
from tinyllm.entrypoints.server.app import create_app
from tinyllm.entrypoints.workloads import make_requests

VOCAB = 49152
# The scripted server streams CHUNK_TOKENS tokens per chunk (as a detokenizer holding back
# text does), a chunk every GAP seconds. It refuses prompts over TOO_LONG and under LONG tokens.
# A prompt of LONG tokens stalls every stream for STALL seconds before its own first chunk, as
# an unchunked prefill does.
CHUNK_TOKENS = 2
GAP = 0.005
TOO_LONG = 480
LONG = 1000
STALL = 0.4


def scripted_app(state: SimpleNamespace) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        prompt, max_tokens = body["prompt"], body["max_tokens"]
        state.prompts.append(prompt)
        assert body["stream"] and body["ignore_eos"] and body["model"] == "scripted"
        if TOO_LONG < len(prompt) < LONG:
            message = f"prompt of {len(prompt)} tokens is over {TOO_LONG}"
            return JSONResponse({"error": {"message": message}}, status_code=400)
        state.in_flight += 1
        state.peak = max(state.peak, state.in_flight)

        async def events():
            try:
                if len(prompt) == LONG:
                    state.stalled_until = time.monotonic() + STALL
                    await asyncio.sleep(STALL)
                for _ in range(math.ceil(max_tokens / CHUNK_TOKENS)):
                    await asyncio.sleep(GAP)
                    while time.monotonic() < state.stalled_until:
                        await asyncio.sleep(0.005)
                    choice = {"index": 0, "text": "ab", "finish_reason": None}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def scripted():
    state = SimpleNamespace(in_flight=0, peak=0, stalled_until=0.0, prompts=[])
    with serving(scripted_app(state)) as url:
        yield SimpleNamespace(url=url, state=state)


def bench_serve(tmp_path, url: str, *flags: str) -> dict:
    """`tinyllm bench serve` in-process (its parser, then its command); returns its JSON."""
    # Not through tinyllm.entrypoints.cli: importing that module here would bind its `stream`'s
    # `out=sys.stdout` default to this test run's capture, breaking test_cli's chat test.
    parser = argparse.ArgumentParser(prog="tinyllm bench")
    add_bench_args(parser)
    path = tmp_path / "serve.json"
    args = parser.parse_args(["serve", "--base-url", url, "--json", str(path), *flags])
    args.func(args)
    return json.loads(path.read_text())


def assert_ordered(m: dict) -> None:
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert m[f"median_{name}_ms"] <= m[f"p99_{name}_ms"], name
    for r in m["requests"]:
        if r["error"] is None:
            assert 0 < r["ttft_ms"] <= r["e2el_ms"]


def test_arrivals_are_poisson_at_the_rate():
    times = arrival_times(4000, 4.0, random.Random(0))
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps > 0).all()
    assert np.mean(gaps) == pytest.approx(1 / 4.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert np.std(gaps) == pytest.approx(1 / 4.0, rel=0.1)
    assert arrival_times(5, math.inf, random.Random(0)) == [0.0] * 5


def test_counts_chunks_tokens_and_failures(scripted, tmp_path, capsys):
    n = 8
    m = bench_serve(tmp_path, scripted.url, "--num-requests", str(n))
    requests = make_requests("serve", VOCAB, 0, n)
    ok = [r for r in requests if len(r.prompt_token_ids) <= TOO_LONG]
    refused = [r for r in requests if len(r.prompt_token_ids) > TOO_LONG]
    assert ok and refused  # the seed gives both kinds
    assert (m["completed"], m["failed"]) == (len(ok), len(refused))
    assert f"prompt of {len(refused[0].prompt_token_ids)} tokens" in m["first_error"]
    assert m["first_error"].startswith("HTTP 400")
    assert m["total_output_tokens"] == sum(r.max_tokens for r in ok)
    assert m["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in ok)

    done = [r for r in m["requests"] if r["error"] is None]
    # One gap between successive chunks, and chunks carry two tokens each.
    chunks = [math.ceil(r.max_tokens / CHUNK_TOKENS) for r in ok]
    assert [len(r["itls_ms"]) for r in done] == [c - 1 for c in chunks]
    itls = [g for r in done for g in r["itls_ms"]]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls))
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99))
    # TPOT divides by output tokens after the first, not by chunks.
    tpots = [(r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1) for r in done]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    assert_ordered(m)
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration"])

    out = capsys.readouterr().out
    assert f"Successful requests:{' ' * 21}{len(ok)}" in out
    assert f"Failed requests:{' ' * 25}{len(refused)}" in out


def test_max_concurrency_caps_requests_in_flight(scripted, tmp_path):
    scripted.state.peak = 0
    m = bench_serve(
        tmp_path, scripted.url, "--num-requests", "6", "--seed", "1", "--max-concurrency", "2"
    )
    assert m["completed"] == 6 and m["max_concurrency"] == 2
    assert scripted.state.peak == 2


def test_long_prompt_window_catches_the_stall(scripted, tmp_path):
    n = 4
    flags = ["--num-requests", str(n), "--seed", "1", "--output-len", "40"]
    m = bench_serve(tmp_path, scripted.url, *flags, "--long-prompt", str(LONG))
    requests = make_requests("serve", VOCAB, 1, n)
    # The long request is kept out of the other figures.
    assert m["completed"] == n and m["num_prompts"] == n
    assert m["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in requests)
    long = m["long_prompt"]
    assert long["error"] is None and long["prompt_tokens"] == LONG
    # Sent once every other request was streaming.
    first_chunks = [r["sent_s"] + r["ttft_ms"] / 1000 for r in m["requests"]]
    assert long["sent_s"] >= max(first_chunks)
    assert long["ttft_ms"] >= STALL * 1000
    # The stall shows in the window, and not in the streams' typical gap.
    assert long["window_itls"] >= 1
    assert long["max_itl_ms"] >= STALL * 1000 > m["median_itl_ms"]


def chat_turns(seed: int, conversations: int, turns: int) -> list[list]:
    """The multi-turn workload's first turns of its first conversations, as the bench sends."""
    requests = make_requests("multi-turn", VOCAB, seed, conversations)
    per = len(requests) // conversations
    return [requests[c * per : c * per + turns] for c in range(conversations)]


def test_multi_turn_resends_history_and_stops_a_failed_chat(scripted, tmp_path, capsys):
    scripted.state.prompts.clear()
    flags = ["--workload", "multi-turn", "--num-requests", "3", "--turns", "3"]
    m = bench_serve(tmp_path, scripted.url, *flags, "--output-len", "4")
    # The scripted server answers "ab" per chunk of 2 tokens, refuses a prompt over TOO_LONG
    # (characters here), and reports no cached tokens.
    expected, sent = [], []
    for turns in chat_turns(0, 3, 3):
        prompt, failed = "", False
        for turn in turns:
            prompt = next_prompt(prompt, "abab", turn)
            expected.append("not sent" if failed else None)
            if not failed:
                sent.append(prompt)
                failed = len(prompt) > TOO_LONG
                expected[-1] = "HTTP 400" if failed else None
    assert sorted(scripted.state.prompts) == sorted(sent)
    errors = [r["error"] and r["error"][:8] for r in m["requests"]]
    assert errors == expected
    assert "not sent" in expected and None in expected[1::3]  # the seed gives both kinds
    assert m["workload"] == "multi-turn" and m["total_cached_tokens"] is None
    turns = m["multi_turn"]
    assert (turns["turns"], turns["conversations"]) == (3, 3)
    ok = [r for r in m["requests"] if r["error"] is None]
    assert turns["median_ttft_by_turn_ms"][0] == pytest.approx(
        np.median([r["ttft_ms"] for r in m["requests"][::3] if r["error"] is None])
    )
    assert m["completed"] == len(ok) and m["failed"] == 9 - len(ok)
    out = capsys.readouterr().out
    assert f"Prompt tokens cached (server):{' ' * 11}n/a" in out
    assert "Median TTFT turn 3 (ms)" in out


def test_multi_turn_flags_are_checked(scripted, tmp_path):
    with pytest.raises(ValueError, match="--turns=11 is over the workload's 10 turns"):
        bench_serve(tmp_path, scripted.url, "--workload", "multi-turn", "--turns", "11")
    with pytest.raises(ValueError, match="--turns is for a chat replay"):
        bench_serve(tmp_path, scripted.url, "--turns", "2")
    with pytest.raises(ValueError, match="--long-prompt is for the serve workload"):
        bench_serve(tmp_path, scripted.url, "--workload", "multi-turn", "--long-prompt", "9")


def test_unreachable_server_is_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "tinyllm.entrypoints.cli", "bench", "serve"]
        + ["--base-url", "http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("tinyllm: error: cannot reach http://127.0.0.1:1")
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_bench_serve_against_the_real_server(default_llm, tmp_path):
    n = 4
    with serving(create_app(default_llm)) as url:
        m = bench_serve(
            tmp_path, url, "--num-requests", str(n), "--seed", "1", "--long-prompt", "300"
        )
    requests = make_requests("serve", VOCAB, 1, n)
    assert m["completed"] == n and m["failed"] == 0, m["first_error"]
    assert m["model"] == default_llm.model_name
    # ignore_eos: every request made exactly its max_tokens.
    assert [r["output_tokens"] for r in m["requests"]] == [r.max_tokens for r in requests]
    assert m["total_output_tokens"] == sum(r.max_tokens for r in requests)
    # A chunk carries at least one token.
    assert all(len(r["itls_ms"]) <= r["output_tokens"] - 1 for r in m["requests"])
    assert_ordered(m)
    long = m["long_prompt"]
    assert long["error"] is None and long["window_itls"] >= 1
    assert long["sent_s"] >= max(r["sent_s"] + r["ttft_ms"] / 1000 for r in m["requests"])


@pytest.mark.slow
def test_multi_turn_against_the_real_server(default_llm, tmp_path, monkeypatch):
    """2 conversations x 3 turns: each turn's prompt is the previous one, the answer the engine
    made for it, and the new message; the server finds the history in its prefix cache, and
    finds nothing with prefix caching off."""
    flags = ["--workload", "multi-turn", "--num-requests", "2", "--turns", "3"]
    flags += ["--output-len", "4", "--seed", "2"]
    engine = default_llm.engine
    received, answers = [], {}
    step = engine.step

    def spy():
        outputs = step()
        for out in outputs:  # the server's engine streams each step's new text
            answers[out.request_id] = answers.get(out.request_id, "") + out.text
        return outputs

    app = create_app(default_llm)

    @app.middleware("http")
    async def record(request, call_next):
        if request.url.path == "/v1/completions":
            received.append(json.loads(await request.body())["prompt"])
        return await call_next(request)

    monkeypatch.setattr(engine, "step", spy)
    with serving(app) as url:
        m = bench_serve(tmp_path, url, *flags)
    assert m["completed"] == 6 and m["failed"] == 0, m["first_error"]
    reqs = m["requests"]
    assert all(r["output_tokens"] == 4 and r["itls_ms"] is not None for r in reqs)
    for c, turns in enumerate(chat_turns(2, 2, 3)):
        prompts = [p for p in received if p.startswith(message(turns[0]))]
        assert len(prompts) == 3 and prompts[0] == message(turns[0])
        for k in (1, 2):
            # prompt k = prompt k-1 + the engine's answer to it + the new message
            earlier, now = prompts[k - 1], prompts[k]
            tail = TURN_SEPARATOR + message(turns[k])
            assert now.startswith(earlier) and now.endswith(tail)
            assert now[len(earlier) : -len(tail)] in answers.values()
            assert reqs[3 * c + k]["prompt_tokens"] > reqs[3 * c + k - 1]["prompt_tokens"]
            assert reqs[3 * c + k]["cached_tokens"] > 0
    assert m["total_cached_tokens"] == sum(r["cached_tokens"] for r in reqs) > 0
    assert len(m["multi_turn"]["median_ttft_by_turn_ms"]) == 3

    uncached = copy.copy(default_llm)
    config = dataclasses.replace(engine.config, enable_prefix_caching=False, num_blocks=64)
    uncached.engine = LLMEngine(engine.model, default_llm.tokenizer, config)
    with serving(create_app(uncached)) as url:
        m = bench_serve(tmp_path, url, *flags)
    assert m["completed"] == 6 and m["total_cached_tokens"] == 0
    assert m["prefix_cache_hit_rate"] == 0
