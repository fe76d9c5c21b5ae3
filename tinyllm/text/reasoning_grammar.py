"""Grammars (llguidance's lark dialect) that let a thinking model think, then constrain its answer.

    start: thinking answer | answer     (only `thinking answer` if the prompt opened <think>)
    thinking: <think> thought </think> "\\n\\n"?    (no <think> if the prompt opened it)
    thought[max_tokens=N]: free text without `</think>`

gpt-oss's harmony format (`harmony_grammar`) thinks in an analysis message instead, and answers in
a final message (or the tool grammar's messages):

    start: thinking reply | reply             (only `reply` if thinking was turned off)
    thinking: <|channel|> "analysis" <|message|> thought <|end|> <|start|> "assistant"
    reply: <|channel|> "final" <|message|> answer <|return|>

`answer` is what the request asked for (a JSON schema, any JSON object, a regex, a choice, a lark
grammar such as the tool-call one), or any text when only the budget constrains the answer. With
a budget, llguidance ends the `thought` rule after N tokens, so the next token can only be
`</think>`: the thinking is closed there.
"""

import json
import re
from typing import Any

from tinyllm.text import harmony
from tinyllm.text.json_schema import closed_objects
from tinyllm.text.reasoning import ReasoningFormat, ThinkingState
from tinyllm.text.tokenizer import Tokenizer
from tinyllm.text.tool_grammar import lark_literal

# As the engine compiles a schema on its own (structured_output/grammar.py): no free whitespace.
_JSON_STYLE = {"whitespace_flexible": False}
_ANSWER = "tinyllm_answer"


def tag_lark(tokenizer: Tokenizer, tag: str) -> str:
    """`tag` in lark: an added token (`<think>` in Qwen3's and DeepSeek's vocabularies) is
    matched as that token, as llguidance sees every added token; other tags as text."""
    return lark_literal(tag, tokenizer.added_tokens)


def answer_rules(
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
) -> tuple[str, list[str]]:
    """The `%llguidance` options line and the rules that define `tinyllm_answer` for one
    structured-output setting (StructuredOutputsParams' fields); all None: any text."""
    options = "%llguidance {}"
    if json_schema is not None or json_object:
        schema: Any = {"type": "object"} if json_object else json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON schema: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"not a JSON schema: {schema!r:.80}")
        schema = closed_objects(schema)
        schema = {**schema, "x-guidance": {**_JSON_STYLE, **schema.get("x-guidance", {})}}
        return options, [f"{_ANSWER}: %json {json.dumps(schema)}"]
    if regex is not None:
        return options, [f"{_ANSWER}: /{regex.replace('/', chr(92) + '/')}/"]
    if choice is not None:
        return options, [f"{_ANSWER}: " + " | ".join(json.dumps(c) for c in choice)]
    if grammar is not None:
        rules = []
        for line in grammar.splitlines():
            if line.lstrip().startswith("%llguidance"):
                options = line.strip()
            else:  # its start rule becomes the answer
                rules.append(re.sub(r"^(\s*[?!]?)start\b", rf"\g<1>{_ANSWER}", line))
        return options, rules
    return options, [f"{_ANSWER}: TINYLLM_ANY", "TINYLLM_ANY: /(?s:.*)/"]


def thinking_grammar(
    tokenizer: Tokenizer,
    fmt: ReasoningFormat,
    state: ThinkingState,
    answer: dict[str, Any] | None,
    budget: int | None,
) -> str:
    """The grammar for an answer whose thinking comes first (`state` "open" or "maybe"):
    `answer`, StructuredOutputsParams' fields as a dict (None: any text); `budget`: the most
    tokens the thinking may take (None: no limit)."""
    fields = dict(answer or {})
    if "json" in fields:
        fields["json_schema"] = fields.pop("json")
    options, rules = answer_rules(**fields)
    start, end = tag_lark(tokenizer, fmt.start), tag_lark(tokenizer, fmt.end)
    opened = "" if state == "open" else f"{start} "
    limit = "" if budget is None else f"[max_tokens={budget}]"
    not_end = re.escape(fmt.end).replace("/", "\\/")
    lines = [
        options,
        f"start: tinyllm_thinking {_ANSWER}" + ("" if state == "open" else f" | {_ANSWER}"),
        f'tinyllm_thinking: {opened}tinyllm_thought {end} "\\n\\n"?',
        f"tinyllm_thought{limit}: TINYLLM_THOUGHT",
        f"TINYLLM_THOUGHT: /(?s:.*)/ & ~/(?s:.*){not_end}(?s:.*)/",
        *rules,
    ]
    return "\n".join(lines) + "\n"


def harmony_grammar(
    tokenizer: Tokenizer,
    closed: bool,
    answer: dict[str, Any] | None,
    budget: int | None,
    messages: bool,
) -> str:
    """The harmony format's grammar: an analysis message (unless `closed`: thinking is off) of
    at most `budget` tokens, then the answer; `answer` as for `thinking_grammar`; `messages`:
    it is a grammar of whole messages already (the tool grammar), else it is the final
    message's body."""
    fields = dict(answer or {})
    if "json" in fields:
        fields["json_schema"] = fields.pop("json")
    options, rules = answer_rules(**fields)

    def t(tag: str) -> str:
        return tag_lark(tokenizer, tag)

    reply = _ANSWER if messages else "tinyllm_reply"
    limit = "" if budget is None else f"[max_tokens={budget}]"
    lines = [
        options,
        f"start: {reply}" if closed else f"start: tinyllm_thinking {reply} | {reply}",
        f'tinyllm_thinking: {t(harmony.CHANNEL)} "analysis" {t(harmony.MESSAGE)} '
        f'tinyllm_thought {t(harmony.END)} {t(harmony.START)} "assistant"',
        f"tinyllm_thought{limit}: TINYLLM_THOUGHT",
        "TINYLLM_THOUGHT: /(?s:.*)/",
        *rules,
    ]
    if not messages:
        lines.append(
            f'tinyllm_reply: {t(harmony.CHANNEL)} "final" {t(harmony.MESSAGE)} {_ANSWER} '
            f"{t(harmony.RETURN)}"
        )
    return "\n".join(lines) + "\n"
