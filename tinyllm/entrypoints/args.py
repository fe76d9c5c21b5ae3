"""The engine's commands' flags, made from the option fields of LoadConfig, LLMOptions and
EngineConfig (entrypoints/llm_options.py) as vLLM's EngineArgs.add_cli_args makes its own: each
flag's name, default, choices and help come from its field. A new flag is one field."""

import argparse
import typing
from collections.abc import Callable
from dataclasses import Field

from tinyllm.entrypoints.llm_options import OPTION_CLASSES, llm_configs
from tinyllm.host.options import option_fields
from tinyllm.host.threads import rank_threads


def positive_int(text: str) -> int:
    """An argparse type: a bad value is a usage error that names the option, before loading."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type: the text as typed, once `check` accepts it (its ValueError is the
    usage error)."""

    def text(value: str) -> str:
        try:
            check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return text


class _Model(argparse.Action):
    """--model and the positional MODEL both set `model`; naming two different models is a
    usage error."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        if value is None:  # MODEL left out
            return
        given = getattr(namespace, self.dest)
        if given is not None and given != value:
            parser.error(f"two models given, {given} and {value}: give MODEL or --model")
        setattr(namespace, self.dest, value)


def _add_flag(p: argparse.ArgumentParser, f: Field) -> None:
    """The option `f` as the flag --NAME. A bool is --NAME / --no-NAME; an int counts something
    (>= 1); anything else is the text typed, one of its choices where it has them."""
    meta = f.metadata
    types = set(typing.get_args(f.type)) or {f.type}
    flags = ["--" + f.name.replace("_", "-"), *meta["aliases"]]
    if bool in types:
        p.add_argument(
            *flags, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"]
        )
        return
    if int in types:
        kind = positive_int
    elif meta["check"] is not None:
        kind = _checked(meta["check"])
    else:
        kind = None
    p.add_argument(
        *flags,
        type=kind,
        default=f.default,
        choices=meta["choices"],
        metavar=meta["metavar"],
        help=meta["help"],
        action=_Model if f.name == "model" else "store",  # MODEL may name it too
    )


def add_option_args(p: argparse.ArgumentParser, cls: type) -> None:
    """The option fields of the dataclass `cls`, each as a flag on `p`."""
    for f in option_fields(cls):
        _add_flag(p, f)


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Every option as a flag on `p`; with `positional_model`, the model may also be given as
    the command's positional argument, as in `vllm serve MODEL`."""
    for cls in OPTION_CLASSES:
        add_option_args(p, cls)
    if positional_model:
        p.add_argument(
            "model",
            nargs="?",
            action=_Model,
            default=None,
            metavar="MODEL",
            help="the model, as --model gives it",
        )


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The options in `args`, by name: what build_llm gives LLM, and the record of how a
    benchmark's engine was set."""
    return {f.name: getattr(args, f.name) for cls in OPTION_CLASSES for f in option_fields(cls)}


def _threads(args: argparse.Namespace) -> int:
    """Each rank's threads: --threads (the host's) shared by the tensor-parallel ranks here."""
    return rank_threads(args.tensor_parallel_size, args.threads)


def build_llm(args: argparse.Namespace):
    # Imported here so that `--help` and argument errors come without loading torch.
    from tinyllm.entrypoints.llm import LLM

    return LLM(**engine_options(args) | {"threads": _threads(args)})


def run_torchrun_worker(args: argparse.Namespace) -> None:
    """A rank other than 0 under torchrun: the same command line as rank 0's, but this process
    only loads its part of the model and runs rank 0's steps until rank 0 stops."""
    from tinyllm.engine.worker.tp_worker import make_worker
    from tinyllm.engine.worker.transport import run_worker
    from tinyllm.entrypoints.llm import resolve_device

    own, load_config, _ = llm_configs(engine_options(args))
    run_worker(resolve_device(own.device), make_worker, (load_config,), _threads(args))
