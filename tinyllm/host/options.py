"""Settings declared once: an option is a dataclass field whose metadata holds its help text
(and its choices, metavar and aliases). The command line makes its flags from these fields
(entrypoints/args.py), as vLLM's EngineArgs.add_cli_args makes its flags from its configs."""

from collections.abc import Callable
from dataclasses import Field, field, fields
from typing import Any


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    aliases: tuple[str, ...] = (),
    check: Callable[[str], object] | None = None,
) -> Any:
    """A dataclass field that is also the flag --NAME (the field's name, dashes for
    underscores). `help` says what it does, and what None means where None is the default;
    `choices`: the values it takes; `aliases`: more flags for it (-tp); `check`: a function of
    the flag's text that raises ValueError for a bad value (the flag keeps the text). An integer
    option counts something: the flag takes integers >= 1."""
    metadata = {"help": help, "choices": choices, "metavar": metavar, "aliases": aliases}
    return field(default=default, metadata=metadata | {"check": check})


def option_fields(cls: type) -> list[Field]:
    """The fields of the dataclass `cls` that are options, in order."""
    return [f for f in fields(cls) if "help" in f.metadata]
