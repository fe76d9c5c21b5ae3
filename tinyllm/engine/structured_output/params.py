"""Structured output: what a request's text must match (vLLM's StructuredOutputsParams).

Only the settings, checked; grammar.py beside this compiles them (and imports llguidance and
torch, which SamplingParams, and so the command line's --help, need not)."""

from dataclasses import dataclass, fields

from tinyllm.engine.validation import kind_of, show

_UNSET = (None, False)  # a field left at its default


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the fields is set: the output is constrained to match it."""

    json: dict | str | None = None  # a JSON schema (dict or JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # Lark, llguidance's dialect

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in _UNSET]
        if len(given) != 1:
            names = ", ".join(f.name for f in fields(self))
            found = f"{len(given)} ({', '.join(given)})" if given else "none"
            raise ValueError(
                f"StructuredOutputsParams: set exactly one of {names}; {found} were given"
            )
        kinds = {
            "json": (dict, str),
            "json_object": (bool,),
            "regex": (str,),
            "choice": (list, tuple),
            "grammar": (str,),
        }
        name = given[0]
        value = getattr(self, name)
        if not isinstance(value, kinds[name]):
            allowed = " or ".join(t.__name__ for t in kinds[name])
            raise ValueError(
                f"StructuredOutputsParams.{name}={show(value)} must be {allowed}, "
                f"not {kind_of(value)}"
            )
        if name == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(
                    f"StructuredOutputsParams.choice={show(value)} must be a non-empty list of "
                    "non-empty strings"
                )
            object.__setattr__(self, "choice", list(value))
        if name in ("regex", "grammar") and not value:
            raise ValueError(f"StructuredOutputsParams.{name} is empty")
