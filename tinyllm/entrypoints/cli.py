"""`tinyllm generate | chat | serve | bench`: the command line."""

import argparse
import dataclasses
import logging
import sys
import time

from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.entrypoints.args import add_engine_args, build_llm
from tinyllm.entrypoints.bench.args import add_bench_args


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def stream(llm, prompt_ids: list[int], params: SamplingParams, out=None):
    """Print the completion as it is generated; returns the final RequestOutput."""
    out = out or sys.stdout  # looked up per call: tests and callers swap sys.stdout
    engine = llm.engine
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    rid = engine.add_request(None, params, prompt_token_ids=prompt_ids)
    text, token_ids, final = [], [], None
    while final is None:
        for o in engine.step():
            if o.request_id != rid:
                continue
            out.write(o.text)
            out.flush()
            text.append(o.text)
            token_ids += o.token_ids
            if o.finished:
                final = o
    if final.error:
        raise ValueError(final.error)
    completion = dataclasses.replace(final.outputs[0], text="".join(text), token_ids=token_ids)
    return dataclasses.replace(final, outputs=[completion])


def _encode(llm, text: str, raw: bool) -> list[int]:
    tok = llm.tokenizer
    if raw or not tok.is_chat_model:
        return tok.encode(text)
    return tok.encode_chat([{"role": "user", "content": text}])[1]


def cmd_generate(args: argparse.Namespace) -> None:
    llm = build_llm(args)
    ids = _encode(llm, args.prompt, args.raw)
    t0 = time.perf_counter()
    out = stream(llm, ids, _params(args))
    dt = time.perf_counter() - t0
    n = len(out.token_ids)
    print(
        f"\n[{len(ids)} prompt tokens, {n} generated in {dt:.2f}s, {n / dt:.1f} tok/s, "
        f"finish: {out.finish_reason}]",
        file=sys.stderr,
    )


def cmd_chat(args: argparse.Namespace) -> None:
    llm = build_llm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("tinyllm chat: empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        if user == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": user})
        ids = llm.tokenizer.encode_chat(messages)[1]
        reply = stream(llm, ids, _params(args))
        print()
        messages.append({"role": "assistant", "content": reply.text})


def cmd_serve(args: argparse.Namespace) -> None:
    from tinyllm.entrypoints.server.app import serve

    serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyllm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser(
        "bench",
        help="throughput/latency benchmarks",
        description="Offline workloads run in-process against a baseline measured in the same "
        "run; `serve` measures a running OpenAI-compatible server.",
    )
    add_bench_args(b)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        # Bad input gets one line naming the problem, never a traceback.
        print(f"tinyllm: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
