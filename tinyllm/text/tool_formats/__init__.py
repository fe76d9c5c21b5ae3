"""Tool-call formats per model family, chosen from the chat template (llama.cpp's way) or named
by `--tool-call-parser` (vLLM's names): each constrains the calls with a grammar and parses
them whole or streamed. Hermes/Qwen `<tool_call>` blocks are the generic format, for templates
that teach none."""

from tinyllm.text.tool_formats.base import ToolFormat
from tinyllm.text.tool_formats.hermes import HERMES
from tinyllm.text.tool_formats.llama3_json import LLAMA3_JSON
from tinyllm.text.tool_formats.mistral import MISTRAL_V3, MISTRAL_V11
from tinyllm.text.tool_formats.openai import HARMONY
from tinyllm.text.tool_parsers import TOOL_CALL_PARSERS

# Most specific first: a Hermes template on a Llama base holds Llama's tokens too.
_DETECTED = (HARMONY, MISTRAL_V11, MISTRAL_V3, HERMES, LLAMA3_JSON)
GENERIC = HERMES

__all__ = ["GENERIC", "HARMONY", "TOOL_CALL_PARSERS", "ToolFormat", "tool_format"]


def tool_format(parser: str = "auto", template: str | None = None) -> ToolFormat:
    """The format `parser` names (one of TOOL_CALL_PARSERS), "auto": the one `template`
    teaches, else the generic one. `mistral` is v11+'s form where the template writes it."""
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"tool_call_parser: {parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}"
        )
    if parser == "auto":
        found = [f for f in _DETECTED if template and f.detect(template)]
        return found[0] if found else GENERIC
    if parser == "mistral":
        return MISTRAL_V11 if template and MISTRAL_V11.detect(template) else MISTRAL_V3
    return {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "openai": HARMONY}[parser]
