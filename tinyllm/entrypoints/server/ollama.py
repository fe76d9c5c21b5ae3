"""Ollama's native API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version),
translated into the shared chat path (chat_run): NDJSON streams, Ollama's error shape
({"error": "..."}) and its timing fields. docs/API_OLLAMA.md says what is supported."""

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from tinyllm.entrypoints.llm import LLM
from tinyllm.entrypoints.server.chat_run import ChatRun, ChatServing
from tinyllm.entrypoints.server.engine_requests import (
    completion_prompts,
    plan_choices,
    request_constraint,
)
from tinyllm.entrypoints.server.errors import APIError, add_error_shape
from tinyllm.entrypoints.server.generation import Generation
from tinyllm.entrypoints.server.ollama_model import OllamaModel, rfc3339
from tinyllm.entrypoints.server.ollama_protocol import (
    ChatRequest,
    Format,
    GenerateRequest,
    Message,
    Options,
    ShowRequest,
)
from tinyllm.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from tinyllm.entrypoints.server.tools import ToolPlan
from tinyllm.text.tool_calls import ToolCall

log = logging.getLogger("tinyllm.server")

OLLAMA_VERSION = "0.12.0"  # the Ollama API version whose fields this module follows
NDJSON = "application/x-ndjson"
# Ollama's options -> the internal request's sampling fields (num_predict and num_ctx apart).
_SAMPLING = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}

_UNSUPPORTED_GENERATE = {
    "suffix": "fill-in-the-middle is not supported",
    "template": "a template override is not supported; send raw: true with the prompt as it is",
    "context": "the deprecated context is not supported; send the conversation to /api/chat",
    "images": "images are not supported (text only)",
}


def _now() -> str:
    return rfc3339(time.time())


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(400, f"{where}: {err['msg'].removeprefix('Value error, ')}") from e


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: call arguments become JSON text, and a tool result
    answers the latest call of its `tool_name` (ids are made up: Ollama's calls have none)."""
    out: list[dict[str, Any]] = []
    ids: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.images:
            raise APIError(400, f"messages.{i}.images: images are not supported (text only)")
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                ids[c.function.name] = f"call_{i}_{j}"
                arguments = json.dumps(c.function.arguments)
                function = {"name": c.function.name, "arguments": arguments}
                calls.append({"id": f"call_{i}_{j}", "type": "function", "function": function})
            msg["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_name is not None:
                msg["name"] = m.tool_name
                msg["tool_call_id"] = ids.get(m.tool_name, f"call_{m.tool_name}")
        out.append(msg)
    return out


def _response_format(fmt: Format | None) -> dict[str, Any] | None:
    if not fmt:
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def sampling_fields(options: Options | None, max_model_len: int) -> dict[str, Any]:
    """Ollama's options as the internal request's fields; unknown ones are logged."""
    if options is None:
        return {}
    if options.model_extra:
        log.warning("ignoring unsupported Ollama options: %s", ", ".join(options.model_extra))
    fields = {
        ours: getattr(options, theirs)
        for theirs, ours in _SAMPLING.items()
        if getattr(options, theirs) is not None
    }
    n = options.num_predict
    if n is not None and n >= 0:
        if n == 0:
            raise APIError(400, "options.num_predict: give at least 1, or -1 for no limit")
        fields["max_tokens"] = n
    elif n is not None and n not in (-1, -2):
        raise APIError(400, f"options.num_predict: {n} is neither a count nor -1 (no limit)")
    if options.num_ctx is not None and options.num_ctx > max_model_len:
        log.info(
            "options.num_ctx %d is over the served context: %d", options.num_ctx, max_model_len
        )
    return fields


class _Timer:
    """Ollama's durations in nanoseconds, measured on the HTTP side: from the request's arrival
    to its first output (prompt_eval_duration) and from there to the end (eval_duration)."""

    def __init__(self) -> None:
        self.start = time.perf_counter_ns()
        self.first: int | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def fields(self, run: ChatRun) -> dict[str, int]:
        end = time.perf_counter_ns()
        first = self.first or end
        usage = run.usage()
        return {
            "total_duration": end - self.start,
            "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": first - self.start,
            "eval_count": usage.completion_tokens,
            "eval_duration": end - first,
        }


class OllamaServing:
    def __init__(self, chat: ChatServing, llm: LLM) -> None:
        self.chat, self.max_model_len = chat, llm.engine.max_model_len
        self.model = OllamaModel(llm, chat.defaults)

    def check_model(self, model: str | None) -> str:
        return self.model.check(model)

    def _thinking(self, think: object) -> dict[str, Any]:
        if think is None:
            return {}
        if think and not self.model.thinks:
            raise APIError(400, f'"{self.model.name}" does not support thinking')
        # The chat path maps this onto the template's switch (Qwen3's enable_thinking); a
        # level (what Ollama takes for gpt-oss) is the reasoning effort too.
        effort = {"reasoning_effort": think} if isinstance(think, str) else {}
        return {"enable_thinking": bool(think), **effort}

    def _request(self, body: ChatRequest | GenerateRequest, extra: dict) -> dict[str, Any]:
        """The fields every internal request shares, from the body's format, options, think."""
        if body.model_extra:
            log.warning("ignoring unsupported Ollama fields: %s", ", ".join(body.model_extra))
        fields = sampling_fields(body.options, self.max_model_len) | extra
        fields |= self._thinking(body.think)
        response_format = _response_format(body.format)
        if response_format is not None:
            fields["response_format"] = response_format
        return fields

    async def _start(self, fields: dict[str, Any], raw_prompt: str | None) -> ChatRun:
        """A chat run, or for a raw prompt a completion run (no template) behind ChatRun's
        deltas. A num_predict over what the context leaves is Ollama's "until it is full"."""
        try:
            return await self._start_once(fields, raw_prompt)
        except APIError as e:
            if e.code != "context_length_exceeded" or e.param != "max_tokens":
                raise
            return await self._start_once(
                {k: v for k, v in fields.items() if k != "max_tokens"}, raw_prompt
            )

    async def _start_once(self, fields: dict[str, Any], raw_prompt: str | None) -> ChatRun:
        if raw_prompt is None:
            return await self.chat.start(_parse(ChatCompletionRequest, fields))
        req = _parse(CompletionRequest, fields | {"prompt": raw_prompt})
        self.chat.check_fields(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        constraint = request_constraint(req)
        prompts = await run_in_threadpool(completion_prompts, self.chat.tokenizer, raw_prompt)
        choices = plan_choices(
            self.chat.validator,
            request_id,
            req,
            prompts,
            req.max_tokens,
            self.chat.default_max_tokens,
            None,
            self.chat.defaults,
            constraint=constraint,
        )
        gen = Generation(self.chat.loop, request_id, prompts, choices)
        return ChatRun(gen, ToolPlan(None, None, False))

    async def chat_route(self, raw: Request) -> Response:
        timer = _Timer()
        body: ChatRequest = _parse(ChatRequest, await _json(raw))
        model = self.check_model(body.model)
        fields = self._request(body, {"messages": chat_messages(body.messages)})
        if body.tools:
            fields["tools"] = body.tools
        if not body.messages:  # Ollama's way to load a model: nothing to run
            return JSONResponse(
                self._head(model, "message") | {"done_reason": "load", "done": True}
            )
        run = await self._start(fields, None)
        return await self._answer(run, raw, body.stream, model, "message", timer)

    async def generate_route(self, raw: Request) -> Response:
        timer = _Timer()
        body: GenerateRequest = _parse(GenerateRequest, await _json(raw))
        model = self.check_model(body.model)
        for name, why in _UNSUPPORTED_GENERATE.items():
            if getattr(body, name):
                raise APIError(400, f"{name}: {why}")
        if not body.prompt:  # Ollama's way to load a model: nothing to run
            return JSONResponse(
                self._head(model, "response") | {"done_reason": "load", "done": True}
            )
        if body.raw:
            run = await self._start(self._request(body, {}), body.prompt)
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            messages = [*system, {"role": "user", "content": body.prompt}]
            run = await self._start(self._request(body, {"messages": messages}), None)
        return await self._answer(run, raw, body.stream, model, "response", timer)

    def _head(self, model: str, kind: str, content: str = "", thinking: str = "") -> dict:
        """An object's fields up to its text: `message` for chat, `response` for generate."""
        head: dict[str, Any] = {"model": model, "created_at": _now()}
        if kind == "message":
            head["message"] = {"role": "assistant", "content": content}
            if thinking:
                head["message"]["thinking"] = thinking
        else:
            head["response"] = content
            if thinking:
                head["thinking"] = thinking
        return head

    def _final(self, run: ChatRun, model: str, kind: str, timer: _Timer, whole: bool) -> dict:
        answer = run.answers[0]
        content, thinking = (answer.content, answer.reasoning) if whole else ("", "")
        final = self._head(model, kind, content, thinking)
        if whole and answer.calls:
            final["message"]["tool_calls"] = ollama_calls(run.answers[0].calls)
        reason = "stop" if answer.finish_reason == "tool_calls" else answer.finish_reason
        return final | {"done": True, "done_reason": reason} | timer.fields(run)

    async def _answer(
        self, run: ChatRun, raw: Request, stream: bool, model: str, kind: str, timer: _Timer
    ) -> Response:
        if stream:
            return StreamingResponse(self._stream(run, model, kind, timer), media_type=NDJSON)
        try:
            if not await run.finish(raw.is_disconnected, timer.tick):
                return Response(status_code=499)  # nobody is listening
            return JSONResponse(self._final(run, model, kind, timer, whole=True))
        finally:
            run.close()

    async def _stream(
        self, run: ChatRun, model: str, kind: str, timer: _Timer
    ) -> AsyncIterator[str]:
        """One JSON object per line: text as it comes, a call once whole (Ollama sends each
        call in one piece, with its arguments as an object), then the final object."""
        try:
            async for d in run.deltas():
                timer.tick()
                if d.content or d.reasoning:
                    yield _line(self._head(model, kind, d.content, d.reasoning) | {"done": False})
            if run.answers[0].calls:
                head = self._head(model, kind)
                head["message"]["tool_calls"] = ollama_calls(run.answers[0].calls)
                yield _line(head | {"done": False})
            yield _line(self._final(run, model, kind, timer, whole=False))
        except APIError as e:
            yield _line({"error": e.message})
        finally:
            run.close()


async def _json(raw: Request) -> Any:
    try:
        return await raw.json()
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from e


def _line(obj: dict) -> str:
    return json.dumps(obj) + "\n"


def ollama_calls(calls: list[ToolCall]) -> list[dict]:
    """OpenAI-shaped calls as Ollama's: arguments an object. A call cut short (by num_predict)
    has no whole object and is left out; done_reason "length" says the answer was cut."""
    out = []
    for c in calls:
        try:
            arguments = json.loads(c.arguments or "{}")
        except ValueError:
            continue
        if c.complete and isinstance(arguments, dict):
            out.append({"function": {"name": c.name, "arguments": arguments}})
    return out


def install_ollama_routes(app: FastAPI, chat: ChatServing, llm: LLM) -> None:
    """Ollama's routes, answering errors in Ollama's shape ({"error": "..."})."""
    ollama = OllamaServing(chat, llm)
    # What the handlers do not answer themselves (a wrong API key, an unknown /api route).
    add_error_shape(app, "/api", lambda e: {"error": e.message})

    def ollama_errors(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapped(raw: Request) -> Any:
            try:
                return await handler(raw)
            except APIError as e:
                log.info("%s %s -> %d: %s", raw.method, raw.url.path, e.status, e.message)
                return _error(e.status, e.message)

        return wrapped

    async def show(raw: Request) -> dict:
        body: ShowRequest = _parse(ShowRequest, await _json(raw))
        return ollama.model.show(body.model or body.name)

    async def version() -> dict:
        return {"version": OLLAMA_VERSION}

    async def running(raw: Request) -> PlainTextResponse:
        return PlainTextResponse("Ollama is running")

    app.add_api_route("/", running, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route("/api/chat", ollama_errors(ollama.chat_route), methods=["POST"])
    app.add_api_route("/api/generate", ollama_errors(ollama.generate_route), methods=["POST"])
    app.add_api_route("/api/show", ollama_errors(show), methods=["POST"])
    app.add_api_route("/api/tags", ollama.model.tags, methods=["GET"])
    app.add_api_route("/api/ps", ollama.model.ps, methods=["GET"])
    app.add_api_route("/api/version", version, methods=["GET"])
