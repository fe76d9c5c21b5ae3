"""A thinking model's `<think>...</think>` part of an answer, apart from the answer itself.

Which models think is decided from the chat template, as llama.cpp decides it: a template that
writes `<think>` belongs to a thinking model (Qwen3, DeepSeek-R1 distills, SmolLM3). Each
request's rendered prompt then says where the answer starts (`thinking_state`):

- "open": the generation prompt already opened `<think>` (DeepSeek-R1's templates): the answer
  starts inside the thinking, and the model's own `<think>`, if it writes one, is dropped;
- "closed": the prompt holds a whole think block (Qwen3 with `enable_thinking: false` writes an
  empty one): the model answers at once, nothing is thinking;
- "maybe": the model may open `<think>` first (Qwen3's default).

`ThinkSplit` splits the answer as it streams; split points inside a tag are held back until
the next delta says what they are, so a streamed answer reassembles to exactly the whole one.

A template that writes gpt-oss's harmony format thinks in its analysis channel instead
(`openai_gptoss`, tinyllm.text.harmony): its answers always may start with reasoning.
"""

from dataclasses import dataclass
from typing import Any, Literal

from tinyllm.text import harmony

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "openai_gptoss")
# The template variable Qwen3's and SmolLM3's templates read to turn thinking off.
THINKING_SWITCH = "enable_thinking"
# The one gpt-oss's template reads for how hard to think (low, medium, high).
EFFORT = "reasoning_effort"
# OpenAI's efforts past those three, as the nearest of them.
_EFFORTS = {"none": "low", "minimal": "low", "xhigh": "high"}

ThinkingState = Literal["open", "closed", "maybe"]


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model writes its thinking. `starts_inside`: the answer begins inside the thinking
    unless the prompt closed it (DeepSeek-R1, whose answers often lack the opening tag).
    `harmony`: the thinking is gpt-oss's analysis channel."""

    starts_inside: bool = False
    start: str = THINK_START
    end: str = THINK_END
    harmony: bool = False


HARMONY = ReasoningFormat(
    start=f"{harmony.CHANNEL}analysis{harmony.MESSAGE}", end=harmony.END, harmony=True
)


def reasoning_format(parser: str, template: str | None) -> ReasoningFormat | None:
    """The format of `--reasoning-parser` `parser` for a model with chat `template` (None: the
    model does not think)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser: {parser!r} is not one of {', '.join(REASONING_PARSERS)}"
        )
    if parser == "openai_gptoss" or (parser == "auto" and harmony.is_harmony(template)):
        return HARMONY
    if parser == "none" or (parser == "auto" and THINK_START not in (template or "")):
        return None
    return ReasoningFormat(starts_inside=parser == "deepseek_r1")


def has_thinking_switch(template: str | None) -> bool:
    """Whether the template turns thinking on and off by `enable_thinking`."""
    return THINKING_SWITCH in (template or "")


def thinking_state(fmt: ReasoningFormat, prompt: str) -> ThinkingState:
    """Where an answer to `prompt` (the rendered chat prompt) starts."""
    tail = prompt.rstrip()
    if tail.endswith(fmt.end):
        return "closed"
    if tail.endswith(fmt.start) or fmt.starts_inside:
        return "open"
    return "maybe"


def template_kwargs(
    template: str | None,
    enable_thinking: bool | None,
    kwargs: dict[str, Any] | None,
    effort: str | None = None,
) -> dict[str, Any]:
    """The chat template's extra variables: `kwargs` (chat_template_kwargs), and the thinking
    switch and reasoning `effort` where the template reads them and `kwargs` leaves them
    unset."""
    out = dict(kwargs or {})
    if enable_thinking is not None and has_thinking_switch(template):
        out.setdefault(THINKING_SWITCH, enable_thinking)
    if effort is not None and EFFORT in (template or ""):
        out.setdefault(EFFORT, _EFFORTS.get(effort, effort))
    return out


def thinking_off(fmt: ReasoningFormat, state: ThinkingState) -> str:
    """What to append to a prompt in `state` so that the model answers without thinking, for a
    template without a switch: an empty think block, as Qwen3's template writes it."""
    if state == "closed":
        return ""
    return ("" if state == "open" else f"{fmt.start}\n\n") + f"{fmt.end}\n\n"


def plan_thinking(
    fmt: ReasoningFormat | None, prompt: str, enable_thinking: bool | None
) -> tuple[str, ThinkingState]:
    """For a prompt rendered with `template_kwargs`: the text to append to it (thinking turned
    off where the template could not) and where the answer starts ("closed": no thinking)."""
    if fmt is None:
        return "", "closed"
    if fmt.harmony:  # no switch: an empty analysis message turns it off
        return (harmony.thinking_off(), "closed") if enable_thinking is False else ("", "maybe")
    state = thinking_state(fmt, prompt)
    if enable_thinking is False and state != "closed":
        return thinking_off(fmt, state), "closed"
    return "", state


_START, _LEAD, _THINKING, _AFTER, _ANSWER = range(5)


class ThinkSplit:
    """One answer's text into (reasoning, content), fed delta by delta (a ReasoningSplit).
    The whitespace around the thinking (the newlines after `<think>`, before and after
    `</think>`) belongs to neither part."""

    def __init__(self, fmt: ReasoningFormat, state: ThinkingState) -> None:
        self.fmt = fmt
        self.state = {"open": _LEAD, "closed": _ANSWER, "maybe": _START}[state]
        self.thought = self.state == _LEAD  # whether the answer has a thinking part
        self._buf = ""

    @property
    def thinking(self) -> bool:
        """Whether the text so far ends inside the thinking."""
        return self.state in (_LEAD, _THINKING)

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = "", ""
        start, end = self.fmt.start, self.fmt.end
        while True:
            buf = self._buf
            if self.state in (_START, _LEAD):
                rest = buf.lstrip()
                if rest.startswith(start):  # the opening tag (once more, for an open prompt)
                    self._buf, self.state, self.thought = rest[len(start) :], _LEAD, True
                    continue
                if not final and start.startswith(rest):  # may still become the tag
                    break
                self.state = _ANSWER if self.state == _START else _THINKING
                if self.state == _THINKING:
                    self._buf = rest
                continue
            if self.state == _THINKING:
                i = buf.find(end)
                if i >= 0:
                    reasoning += buf[:i].rstrip()
                    self._buf, self.state = buf[i + len(end) :], _AFTER
                    continue
                keep = 0 if final else _held(buf, end)
                reasoning += buf[: len(buf) - keep]
                self._buf = buf[len(buf) - keep :]
                break
            if self.state == _AFTER:
                rest = buf.lstrip()
                self._buf = rest
                if rest or final:
                    self.state = _ANSWER
                    continue
                break
            content += buf
            self._buf = ""
            break
        return reasoning, content

    def reasoning_tokens(self, token_ids: list[int], end_id: int | None) -> int:
        """How many of an answer's tokens (`token_ids`, all of them) are its thinking, the tags
        included; `end_id`: the end tag's token."""
        if not self.thought:
            return 0
        if self.thinking or end_id is None or end_id not in token_ids:
            return len(token_ids)  # cut inside the thinking, or the tag spelled out in text
        return token_ids.index(end_id) + 1


def _held(text: str, tag: str) -> int:
    """How much of the end of `text` to hold back: a tail that may be the start of `tag`, and
    the whitespace before it (dropped if the tag follows)."""
    k = next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
    body = text[: len(text) - k]
    return k + len(body) - len(body.rstrip())
