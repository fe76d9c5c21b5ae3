"""Structured output: what a request's text must match (vLLM's StructuredOutputsParams).

Only the settings, checked; engine/grammar.py compiles them (and imports llguidance and torch,
which SamplingParams, and so the command line's --help, need not)."""

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


# Keys whose value maps names to schemas (not a schema itself), and keys whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples", "required")
_OPENED_BY = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: object, in_all_of: bool = False) -> object:
    """The schema with every object that declares `properties` closed to others
    (`additionalProperties: false`) unless it says otherwise: OpenAI's strict mode and vLLM's
    default (xgrammar's strict mode). JSON Schema's own default lets any other key in, and a
    small model fills that room with keys it invents until max_tokens. The parts of an `allOf`
    stay open: each declares only some of the object's properties."""
    if isinstance(schema, list):
        return [closed_objects(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(s) for name, s in value.items()}
        else:
            out[key] = closed_objects(value, in_all_of=key == "allOf")
    if "properties" in out and not in_all_of and not any(k in out for k in _OPENED_BY):
        out["additionalProperties"] = False
    return out
