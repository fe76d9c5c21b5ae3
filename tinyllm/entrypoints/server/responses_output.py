"""The chat path's deltas into a Responses answer: output items (reasoning, message, function
calls) built as the deltas come, and the typed stream events that say so, in the order the
official SDK's stream helpers consume them, each with its `sequence_number`."""

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel

from tinyllm.entrypoints.server.chat_run import ChatDelta
from tinyllm.entrypoints.server.protocol import Usage
from tinyllm.entrypoints.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)

Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: Usage) -> ResponseUsage:
    details, thought = usage.prompt_tokens_details, usage.completion_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=details.cached_tokens if details else 0
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=thought.reasoning_tokens if thought else 0
        ),
        total_tokens=usage.total_tokens,
    )


class OutputBuilder:
    """Builds `response.output` from one choice's deltas; each step returns its events (a
    non-streamed answer builds the same items and drops them)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self.current: OutputItem | None = None
        self.calls: dict[int, OutputFunctionCall] = {}

    def event(self, kind: str, **fields: Any) -> Event:
        fields = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[Event]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def _where(self, item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": len(self.response.output) - 1}

    def _open(self, item: OutputItem) -> list[Event]:
        events = self._close("completed")
        self.response.output.append(item)
        self.current = item
        events.append(self.event("response.output_item.added", item=item, **self._where(item)))
        part: BaseModel | None = None
        if isinstance(item, OutputMessage):
            part = OutputText()
            item.content.append(part)
        elif isinstance(item, OutputReasoning):
            part = ReasoningText()
            item.content.append(part)
        if part is not None:
            events.append(
                self.event(
                    "response.content_part.added", content_index=0, part=part, **self._where(item)
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        item, self.current = self.current, None
        if item is None:
            return []
        item.status = status
        where = self._where(item) | {"output_index": self.response.output.index(item)}
        events = []
        if isinstance(item, OutputFunctionCall):
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    arguments=item.arguments,
                    name=item.name,
                    **where,
                )
            )
        else:
            part = item.content[0]
            if isinstance(item, OutputMessage):
                events.append(
                    self.event(
                        "response.output_text.done",
                        content_index=0,
                        text=part.text,
                        logprobs=[],
                        **where,
                    )
                )
            else:
                events.append(
                    self.event(
                        "response.reasoning_text.done", content_index=0, text=part.text, **where
                    )
                )
            events.append(
                self.event("response.content_part.done", content_index=0, part=part, **where)
            )
        events.append(self.event("response.output_item.done", item=item, **where))
        return events

    def feed(self, d: ChatDelta) -> list[Event]:
        """One delta's events; its finish reason closes the open item (the response itself
        ends with `finish`)."""
        events = []
        if d.reasoning:
            if not isinstance(self.current, OutputReasoning):
                events += self._open(OutputReasoning(id=_item_id("rs")))
            self.current.content[0].text += d.reasoning
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    content_index=0,
                    delta=d.reasoning,
                    **self._where(self.current),
                )
            )
        if d.content:
            if not isinstance(self.current, OutputMessage):
                events += self._open(OutputMessage(id=_item_id("msg")))
            self.current.content[0].text += d.content
            events.append(
                self.event(
                    "response.output_text.delta",
                    content_index=0,
                    delta=d.content,
                    logprobs=[],
                    **self._where(self.current),
                )
            )
        for c in d.calls:
            if c.index not in self.calls:
                call = OutputFunctionCall(id=_item_id("fc"), call_id=c.id or "", name=c.name or "")
                self.calls[c.index] = call
                events += self._open(call)
            call = self.calls[c.index]
            if c.arguments:
                call.arguments += c.arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        delta=c.arguments,
                        **self._where(call),
                    )
                )
        if d.finish_reason is not None:
            events += self._close("incomplete" if d.finish_reason == "length" else "completed")
        return events

    def finish(self, reason: str | None, usage: Usage) -> list[Event]:
        """The response's end: `response.completed`, or `response.incomplete` when the answer
        was cut (max_output_tokens, or the request aborted)."""
        events = self._close("incomplete" if reason == "length" else "completed")
        response = self.response
        response.usage = response_usage(usage)
        response.completed_at = int(time.time())
        if reason in ("stop", "tool_calls"):
            response.status = "completed"
            return events + [self.event("response.completed", response=response)]
        response.status = "incomplete"
        if reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return events + [self.event("response.incomplete", response=response)]

    def fail(self, code: str, message: str) -> list[Event]:
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        return [self.event("response.failed", response=self.response)]


def sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def assistant_message(output: list[OutputItem]) -> dict[str, Any] | None:
    """The answer as the chat message a later turn sends back (reasoning is not carried)."""
    text = "".join(i.content[0].text for i in output if isinstance(i, OutputMessage))
    calls = [
        {
            "id": i.call_id,
            "type": "function",
            "function": {"name": i.name, "arguments": i.arguments},
        }
        for i in output
        if isinstance(i, OutputFunctionCall)
    ]
    if not text and not calls:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message
