"""A Responses request into the internal chat request (OpenAI's chat body): input items into chat
messages, flat function tools into nested ones, `text.format` into `response_format`. Anything
wrong is a 400 naming the Responses field (`input.2.type`, `tools.0.type`, `text.format`)."""

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)

_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_ROLES = {"developer": "system"}
ItemLookup = Callable[[str], dict[str, Any] | None]  # chat templates know system, not developer


def _check(model: type[BaseModel], data: Any, where: str) -> Any:
    """`data` as `model`, or a 400 naming the field under `where` (e.g. input.2.call_id)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join([where, *(str(p) for p in err["loc"])])
        raise APIError(400, f"{loc}: {err['msg']}", param=loc) from None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A message's or tool output's text: its text parts joined (other kinds are a 400)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(
                400,
                f"{where}.{j}.type: content part type {kind!r} is not supported; this server "
                "takes text parts (input_text, output_text)",
                param=f"{where}.{j}.type",
            )
        texts.append(_check(TextPart, part, f"{where}.{j}").text)
    return "".join(texts)


def _referenced(raw: dict[str, Any], where: str, lookup: ItemLookup) -> dict[str, Any]:
    """The stored output item an `item_reference` names."""
    item_id = raw.get("id")
    item = lookup(item_id) if isinstance(item_id, str) else None
    if item is None:
        raise APIError(
            404,
            f"{where}.id: no stored output item with id {item_id!r}",
            param=f"{where}.id",
            code="item_not_found",
        )
    return item


def input_messages(
    items: str | list[dict[str, Any]] | None, lookup: ItemLookup
) -> list[dict[str, Any]]:
    """The request's `input` as chat messages; an assistant's text and the function calls
    after it become one message with `tool_calls`, as chat completions has it. `lookup` finds
    the stored output item an `item_reference` names."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        if raw.get("type") == "item_reference":
            raw = _referenced(raw, f"input.{i}", lookup)
        # An item without a type is a message ("easy input message") when it has a role.
        kind = raw.get("type", "message" if "role" in raw else None)
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(
                400,
                f"input.{i}.type: unsupported item type {kind!r}; this server takes "
                f"{', '.join(_ITEMS)}, item_reference",
                param=f"input.{i}.type",
            )
        item = _check(model, raw, f"input.{i}")
        if isinstance(item, MessageItem):
            text = _text(item.content, f"input.{i}.content")
            messages.append({"role": _ROLES.get(item.role, item.role), "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat function tools into chat completions' nested ones; other tool types are a 400."""
    if tools is None:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"tools.{i}.type: tool type {kind!r} is not supported; this server runs no "
                "built-in tools, only function tools (type: function) that the client runs",
                param=f"tools.{i}.type",
            )
        tool = _check(FunctionTool, raw, f"tools.{i}")
        function = tool.model_dump(exclude_none=True, exclude={"type"})
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        f"tool_choice: {choice!r} is not supported; give auto, none, required or "
        '{"type": "function", "name": ...}',
        param="tool_choice",
    )


def response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat completions' `response_format` (None: free text)."""
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(
        400,
        f"text.format.type: {kind!r} is not supported; give text, json_object or json_schema",
        param="text.format.type",
    )


# Where the chat request's names differ from the Responses request's.
_PARAMS = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def _renamed(text: str) -> str:
    text = re.sub(r"\btools\.(\d+)\.function\.", r"tools.\1.", text)
    text = re.sub(r"\bresponse_format\.json_schema\b", "text.format", text)
    for chat_name, name in _PARAMS.items():
        text = re.sub(rf"\b{chat_name}\b", name, text)
    return text


def responses_error(e: APIError) -> APIError:
    """An error about the internal chat request, reworded in the Responses request's names."""
    param = None if e.param is None else _renamed(e.param)
    return APIError(e.status, _renamed(e.message), param=param, code=e.code)


def _leading_system_merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The instructions and the system or developer messages right after them as one system
    message: many chat templates take a single one, at the start."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": text}, *messages[n:]]


def chat_body(
    req: ResponsesRequest, history: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat request's body: the instructions, the stored conversation `history` and this
    turn's `messages`, and the sampling settings."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _leading_system_merged(system + history + messages),
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text.format if req.text else None),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "enable_thinking": _thinking(req.reasoning),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    return {k: v for k, v in body.items() if v is not None}


def _thinking(reasoning: dict[str, Any] | None) -> bool | None:
    """`reasoning.effort` onto a thinking model's switch: none or minimal turn it off, any other
    effort on; no effort leaves the model's default."""
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    return effort not in ("none", "minimal")
