"""Render a model's Jinja chat template the way Hugging Face transformers does.

A template comes from the model file, so it is untrusted: it runs in Jinja's immutable sandbox,
which refuses attribute tricks like `''.__class__.__mro__` and any mutation of passed-in data.
"""

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is broken, unsafe, or refused the conversation (its `raise_exception`)."""


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    **extra: Any,
) -> str:
    """The prompt text for `messages`; `extra` (tools, documents...) is passed to the template."""
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    # TypeError: the template did something like str + list with messages it did not expect.
    except (jinja2.TemplateError, TypeError) as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e


_PROBE = "tinyllm-system-probe"


@lru_cache(maxsize=32)
def takes_system_message(template: str) -> bool:
    """Whether the template renders a leading system message. Gemma 2's raises on one, and one
    that drops it would lose its text; probed once per template (cached), not per request."""
    user = {"role": "user", "content": "Hi"}
    try:
        system = {"role": "system", "content": _PROBE}
        return _PROBE in render_chat_template(template, [system, user], True, "", "")
    except ChatTemplateError:
        pass
    try:
        render_chat_template(template, [user], True, "", "")
    except ChatTemplateError:
        return True  # it refuses a plain conversation too: nothing learnt, render as sent
    return False


def fold_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A leading system message's text put at the head of the first user message, a blank line
    apart (a user message of its own if none follows), as Gemma 3's template does itself and
    llama.cpp does for templates without a system role."""
    if not messages or messages[0].get("role") != "system":
        return messages
    system, rest = _text(messages[0].get("content")), messages[1:]
    if rest and rest[0].get("role") == "user":
        text = "\n\n".join(t for t in (system, _text(rest[0].get("content"))) if t)
        return [{**rest[0], "content": text}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return content or ""


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to find the assistant's
    tokens for training masks; for inference it just renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)
