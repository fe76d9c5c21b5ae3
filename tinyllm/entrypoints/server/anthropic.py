"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, translated into the shared
chat path (chat_run) and its answers back into Anthropic's message and stream events."""

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, NoReturn

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tinyllm.entrypoints.server.anthropic_protocol import (
    Block,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    TextOut,
    ThinkingOut,
    ToolParam,
    ToolUseOut,
    error_body,
)
from tinyllm.entrypoints.server.chat_run import ChatAnswer, ChatDelta, ChatRun, ChatServing
from tinyllm.entrypoints.server.errors import APIError, add_error_shape
from tinyllm.entrypoints.server.protocol import ChatCompletionRequest, Usage

log = logging.getLogger("tinyllm.server")

PREFIX = "/v1/messages"
# Thinking blocks must carry a signature; tinyllm does not sign its thinking.
SIGNATURE = "tinyllm-unsigned"
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def install_anthropic_routes(app: FastAPI, chat: ChatServing) -> None:
    add_error_shape(app, PREFIX, lambda e: error_body(e.status, e.message))

    @app.post(PREFIX)
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        chat_req = _chat_request(req)
        try:
            run = await chat.start(chat_req, request_id=f"msg_{uuid.uuid4().hex[:24]}")
        except APIError as e:
            raise _in_our_words(e) from e
        if req.stream:
            return StreamingResponse(
                _stream(run, chat.model_name, req.stop_sequences or []),
                media_type="text/event-stream",
            )
        try:
            if not await run.finish(raw.is_disconnected):
                return Response(status_code=499)  # nobody is listening
        finally:
            run.close()
        answer = run.answers[0]
        return MessageResponse(
            id=run.request_id,
            model=chat.model_name,
            content=content_blocks(answer),
            **_stop(run, answer.finish_reason, req.stop_sequences or []),
            usage=_usage(run.usage()),
        )

    @app.post(f"{PREFIX}/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> dict:
        chat_req = _chat_request(req)
        chat.check_fields(chat_req)
        try:  # rendered as /v1/messages renders it: the same tools, template and thinking
            prompt = (await chat.render(chat_req))[0]
        except APIError as e:
            raise _in_our_words(e) from e
        return {"input_tokens": len(prompt.token_ids)}


# -- request ------------------------------------------------------------------------------------


def _chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The internal chat request for an Anthropic body (with or without max_tokens)."""
    if req.model_extra:
        log.warning("ignoring unsupported request fields: %s", ", ".join(req.model_extra))
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        system = (
            req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
        )
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "user":
            messages += _user_messages(blocks, f"messages.{i}.content")
        else:
            messages.append(_assistant_message(blocks, f"messages.{i}.content"))
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = _tool_choice(choice.type, choice.name)
        if choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:  # structured output: the text answer follows the schema
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.schema_},
        }
    if req.thinking is not None:  # adaptive: the model's own default
        if req.thinking.type != "adaptive":
            body["enable_thinking"] = req.thinking.type == "enabled"
        if req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
            body["thinking_token_budget"] = req.thinking.budget_tokens
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        fields = {"stop": req.stop_sequences, "temperature": req.temperature}
        fields |= {"top_p": req.top_p, "top_k": req.top_k}
        body |= {k: v for k, v in fields.items() if v is not None}
    return ChatCompletionRequest.model_validate(body)


def _user_messages(blocks: list[Block], where: str) -> list[dict[str, Any]]:
    """A user turn: its text as user messages, each tool_result as a role tool message, in order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        if b.type == "text":
            texts.append(_text(b, f"{where}.{j}"))
        elif b.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(b, f"{where}.{j}"))
        else:
            _unserved(b, f"{where}.{j}", "text and tool_result")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(blocks: list[Block], where: str) -> dict[str, Any]:
    """An assistant turn: text as content, tool_use blocks as tool calls, thinking as the
    reasoning the chat template may render (redacted thinking has no text: dropped)."""
    texts, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        if b.type == "text":
            texts.append(_text(b, f"{where}.{j}"))
        elif b.type == "thinking":
            thinking.append(b.thinking or "")
        elif b.type == "tool_use":
            if b.id is None or b.name is None:
                raise _bad(f"{where}.{j}: a tool_use block needs id and name")
            arguments = json.dumps(b.input or {}, ensure_ascii=False)
            calls.append({"id": b.id, "function": {"name": b.name, "arguments": arguments}})
        elif b.type != "redacted_thinking":
            _unserved(b, f"{where}.{j}", "text, tool_use, thinking and redacted_thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _tool_result(b: Block, where: str) -> dict[str, Any]:
    if b.tool_use_id is None:
        raise _bad(f"{where}: a tool_result block needs tool_use_id")
    content = b.content or ""
    if isinstance(content, list):
        for k, part in enumerate(content):
            if part.type != "text":
                _unserved(part, f"{where}.content.{k}", "text")
        content = "\n".join(_text(part, f"{where}.content.{k}") for k, part in enumerate(content))
    if b.is_error:  # the chat template has no place for the flag: the model reads it
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": b.tool_use_id, "content": content}


def _text(b: Block, where: str) -> str:
    if b.text is None:
        raise _bad(f"{where}: a text block needs text")
    return b.text


def _unserved(b: Block, where: str, served: str) -> NoReturn:
    raise _bad(f"{where}: {b.type!r} blocks are not supported here (only {served})")


def _tool(t: ToolParam, i: int) -> dict[str, Any]:
    if t.type not in (None, "custom"):
        raise APIError(
            400, f"tools.{i}.type: server tool {t.type!r} is not supported", param="tools"
        )
    if t.input_schema is None:
        raise APIError(400, f"tools.{i}.input_schema: Field required", param="tools")
    function = {"name": t.name, "parameters": t.input_schema}
    if t.description is not None:
        function["description"] = t.description
    return {"type": "function", "function": function}


def _tool_choice(kind: str, name: str | None) -> str | dict[str, Any]:
    if kind == "tool":
        if name is None:
            raise APIError(400, "tool_choice.name: type tool needs name", param="tool_choice")
        return {"type": "function", "function": {"name": name}}
    return {"any": "required"}.get(kind, kind)


def _bad(message: str) -> APIError:
    return APIError(400, message, param=message.split(".", 1)[0])


def _in_our_words(e: APIError) -> APIError:
    """An error from the chat path names OpenAI's fields: name the ones the client sent."""
    words = {
        ".function.parameters": ".input_schema",
        "response_format.json_schema.schema": "output_config.format.schema",
        "response_format": "output_config.format",
        "stop:": "stop_sequences:",
    }
    message = e.message
    for openai, anthropic in words.items():
        message = message.replace(openai, anthropic)
    param = {"stop": "stop_sequences", "response_format": "output_config"}.get(e.param, e.param)
    return APIError(e.status, message, param=param, code=e.code)


# -- response -----------------------------------------------------------------------------------


def _tool_use_id(call_id: str | None) -> str:
    return f"toolu_{(call_id or uuid.uuid4().hex).removeprefix('call_')}"


def _input(arguments: str) -> dict[str, Any]:
    """A call's JSON-text arguments as the object Anthropic sends; a call max_tokens cut (its
    text does not parse) has none."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(a: ChatAnswer) -> list[ThinkingOut | TextOut | ToolUseOut]:
    """A whole answer's blocks, in the order a stream of it opens them."""
    blocks: list[ThinkingOut | TextOut | ToolUseOut] = []
    if a.reasoning:
        blocks.append(ThinkingOut(thinking=a.reasoning, signature=SIGNATURE))
    if a.content:
        blocks.append(TextOut(text=a.content))
    for c in a.calls:
        blocks.append(ToolUseOut(id=_tool_use_id(c.id), name=c.name, input=_input(c.arguments)))
    return blocks


def _stop(run: ChatRun, reason: str | None, stop_sequences: list[str]) -> dict[str, Any]:
    """stop_reason and stop_sequence: a stop string the client sent ended it, or else why."""
    if reason == "stop":
        hit = run.gen.results[0].stop_reason
        if isinstance(hit, str) and hit in stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": hit}
    return {"stop_reason": _STOP_REASONS.get(reason or "", "end_turn"), "stop_sequence": None}


def _usage(u: Usage) -> MessageUsage:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return MessageUsage(
        input_tokens=u.prompt_tokens - cached,
        output_tokens=u.completion_tokens,
        cache_read_input_tokens=cached,
    )


def _event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class BlockEvents:
    """The content blocks of a streamed message: each delta's reasoning, text and call pieces
    into block start, delta and stop events, one block open at a time."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: str | None = None  # "thinking", "text", or "tool_use"

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.open = kind
        self.count += 1
        block = {"type": kind, **block}
        events.append(
            _event({"type": "content_block_start", "index": self.count - 1, "content_block": block})
        )
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event({"type": "content_block_delta", "index": self.count - 1, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # a thinking block's signature comes last
            events.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        events.append(_event({"type": "content_block_stop", "index": self.count - 1}))
        self.open = None
        return events

    def feed(self, d: ChatDelta) -> list[str]:
        events = []
        if d.reasoning:
            if self.open != "thinking":
                events += self._start("thinking", {"thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                events += self._start("text", {"text": ""})
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        for c in d.calls:
            if c.id is not None:  # a new call
                block = {"id": _tool_use_id(c.id), "name": c.name, "input": {}}
                events += self._start("tool_use", block)
            if c.arguments:
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": c.arguments})
                )
        return events


async def _stream(run: ChatRun, model: str, stop_sequences: list[str]) -> AsyncIterator[str]:
    """message_start, a ping, the content blocks' events, message_delta and message_stop; an
    engine failure after the start is an error event."""
    try:
        usage = _usage(run.usage()).model_dump()
        message = {
            "id": run.request_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        yield _event({"type": "message_start", "message": message})
        yield _event({"type": "ping"})
        blocks = BlockEvents()
        async for d in run.deltas():
            for event in blocks.feed(d):
                yield event
            if d.finish_reason is not None:
                for event in blocks.close():
                    yield event
                usage = _usage(run.usage()).model_dump()
                delta = _stop(run, d.finish_reason, stop_sequences)
                yield _event({"type": "message_delta", "delta": delta, "usage": usage})
        yield _event({"type": "message_stop"})
    except APIError as e:
        yield _event(error_body(e.status, e.message))
    finally:
        run.close()
