"""`tinyllm bench serve`: the online benchmark, as `vllm bench serve` measures it.

--workload multi-turn replays `tinyllm bench multi-turn`'s chats instead (serve_chat.py).

The `serve` workload's requests (random token-id prompts, EOS ignored, greedy) stream from a
running server's /v1/completions, arriving as a Poisson process at --request-rate requests/s
(inf: all at once). Only the OpenAI API is used, plus `ignore_eos`, which vLLM and tinyllm
accept, so the same command measures another server on the same machine for a ratio.

Per request: TTFT, from sending it to its first streamed chunk; ITL, the gaps between successive
chunks; TPOT, (E2E - TTFT) / (output tokens - 1); E2E, from sending to the end of the stream.
A chunk may carry several tokens (text the server's detokenizer held back), so ITL counts chunks
and TPOT counts tokens, as vLLM does; token counts come from the stream's usage chunk, and so do
the prompt tokens the server took from its prefix cache (usage.prompt_tokens_details
.cached_tokens), where the server reports them.

--long-prompt N: once every other request is streaming, one more arrives with an N-token
prompt; the other streams' gaps while it is prefilled (from its sending to its first chunk) are
reported apart. That is the stall chunked prefill exists to bound.
"""

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import httpx
from tqdm import tqdm

from tinyllm.entrypoints.bench.serve_chat import replay_chats
from tinyllm.entrypoints.bench.serve_client import Client, error_message
from tinyllm.entrypoints.bench.serve_report import Outcome, ServeResult, table, write_json
from tinyllm.entrypoints.workloads import WORKLOADS, Request, make_requests

# Only the long prompt's prefill matters: its window ends at its first token.
LONG_PROMPT_MAX_TOKENS = 1


def arrival_times(n: int, rate: float, rng: random.Random) -> list[float]:
    """When each request is due, in seconds: a Poisson process (exponential gaps of mean
    1/rate), the first at 0; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _requests(
    client: Client,
    requests: list[Request],
    due_times: list[float],
    long: Request | None,
    capped: Callable[[Request, asyncio.Event], Awaitable[Outcome]],
) -> tuple[list[Outcome], Outcome | None]:
    """The serve workload: each request sent when due; the long prompt once all stream."""
    tasks, streaming = [], []
    for req, due in zip(requests, due_times, strict=True):
        await asyncio.sleep(max(0.0, due - client.now()))
        streaming.append(asyncio.Event())
        tasks.append(asyncio.create_task(capped(req, streaming[-1])))
    long_task = None
    if long is not None:
        # Past the cap: it is the extra request the scenario is about.
        await asyncio.gather(*(e.wait() for e in streaming))
        send = client.send(long.prompt_token_ids, long.max_tokens, asyncio.Event())
        long_task = asyncio.create_task(send)
    outcomes = await asyncio.gather(*tasks)
    return list(outcomes), await long_task if long_task is not None else None


async def benchmark(
    args: argparse.Namespace,
    model: str,
    requests: list[Request],
    long: Request | None,
    turns: int | None = None,
) -> ServeResult:
    """The requests, or with `turns` the chats they make (each `turns` requests in a row are
    one conversation's new messages)."""
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No connection cap (httpx's default is 100): a request queued inside the pool would be
    # timed from a send that had not happened. --max-concurrency is the cap.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    cap = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req")

    async with httpx.AsyncClient(
        base_url=args.base_url,
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(None, connect=30),  # a stream may wait minutes for its turn
    ) as http:
        client = Client(http, model, time.perf_counter())

        async def capped(req: Request, streaming: asyncio.Event) -> Outcome:
            async with cap or contextlib.nullcontext():
                out = await client.send(req.prompt_token_ids, req.max_tokens, streaming)
            bar.update()
            return out

        if turns is None:
            due_times = arrival_times(len(requests), args.request_rate, rng)
            outcomes, long_outcome = await _requests(client, requests, due_times, long, capped)
        else:
            chats = [requests[i : i + turns] for i in range(0, len(requests), turns)]
            due_times = arrival_times(len(chats), args.request_rate, rng)
            outcomes, long_outcome = await replay_chats(client, chats, due_times, cap, bar), None
        duration = client.now()
    bar.close()
    return ServeResult(
        base_url=args.base_url,
        model=model,
        workload=args.workload,
        seed=args.seed,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        duration=duration,
        outcomes=outcomes,
        long=long_outcome,
        turns=turns or 1,
    )


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach {base_url}: {e}") from e
    if resp.status_code != 200:
        error = error_message(resp.status_code, resp.content)
        raise ValueError(f"{base_url}/v1/models: {error}")
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model")
    return models[0]["id"]


def _check(args: argparse.Namespace) -> None:
    for flag, value in [
        ("--max-concurrency", args.max_concurrency),
        ("--long-prompt", args.long_prompt),
        ("--output-len", args.output_len),
        ("--turns", args.turns),
    ]:
        if value is not None and value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate={args.request_rate} must be > 0 (inf: all at once)")
    limit = WORKLOADS[args.workload].turns
    if limit == 1 and args.turns is not None:
        raise ValueError(f"--turns is for a chat replay, not --workload {args.workload}")
    if args.turns is not None and args.turns > limit:
        raise ValueError(f"--turns={args.turns} is over the workload's {limit} turns")
    if limit > 1 and args.long_prompt is not None:
        raise ValueError("--long-prompt is for the serve workload, not a chat replay")
    if args.vocab_size <= 200:
        raise ValueError(f"--vocab-size={args.vocab_size}: prompts are ids in [100, vocab - 100)")


def run_serve(args: argparse.Namespace) -> None:
    _check(args)
    requests = make_requests(args.workload, args.vocab_size, args.seed, args.num_requests)
    workload_turns = WORKLOADS[args.workload].turns
    turns = args.turns or workload_turns
    if turns < workload_turns:  # the first --turns of each conversation
        requests = [r for i, r in enumerate(requests) if i % workload_turns < turns]
    if args.output_len is not None:
        requests = [replace(r, max_tokens=args.output_len) for r in requests]
    long = None
    if args.long_prompt is not None:
        rng = random.Random(f"long prompt {args.seed}")
        ids = [rng.randrange(100, args.vocab_size - 100) for _ in range(args.long_prompt)]
        long = Request(ids, LONG_PROMPT_MAX_TOKENS)
    model = args.model or served_model(args.base_url, args.api_key)
    chat = workload_turns > 1
    if chat:
        what, unit = f"{len(requests) // turns} conversations x {turns} turns", "conversations"
    else:
        what, unit = f"{len(requests)} requests", "requests"
    print(
        f"bench serve: {args.workload}, {what} to {args.base_url} ({model}) at "
        f"{args.request_rate:g} {unit}/s"
        + (f", a {args.long_prompt}-token prompt once all stream" if long else ""),
        file=sys.stderr,
        flush=True,
    )
    result = asyncio.run(benchmark(args, model, requests, long, turns if chat else None))
    print(table(result))
    if args.json:
        write_json(result, args.json)
