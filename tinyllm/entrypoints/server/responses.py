"""OpenAI's Responses API: `POST /v1/responses` through the shared chat path (chat_run), and
`GET`/`DELETE /v1/responses/{id}` for the responses kept in the bounded in-memory store. What is
supported, field by field: docs/API_RESPONSES.md."""

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from tinyllm.entrypoints.server.chat_run import ChatDelta, ChatRun, ChatServing
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.protocol import ChatCompletionRequest
from tinyllm.entrypoints.server.responses_input import (
    chat_body,
    input_messages,
    responses_error,
)
from tinyllm.entrypoints.server.responses_output import OutputBuilder, assistant_message, sse
from tinyllm.entrypoints.server.responses_protocol import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
)
from tinyllm.entrypoints.server.responses_store import ResponseStore, StoredResponse
from tinyllm.text.tool_calls import CallDelta

log = logging.getLogger("tinyllm.server")


class ResponsesServing:
    """Responses requests into chat runs, and their answers into response objects or events."""

    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        self.chat, self.store = chat, store

    def _chat_request(
        self, req: ResponsesRequest, history: list[dict[str, Any]], messages: list[dict[str, Any]]
    ) -> ChatCompletionRequest:
        try:
            return ChatCompletionRequest.model_validate(chat_body(req, history, messages))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise responses_error(APIError(400, f"{loc}: {err['msg']}", param=loc)) from None

    def _response(self, req: ResponsesRequest, response_id: str) -> ResponseObject:
        """The response object before any output, echoing the request's settings."""
        return ResponseObject(
            id=response_id,
            created_at=int(time.time()),
            model=self.chat.model_name,
            instructions=req.instructions,
            tools=req.tools or [],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=bool(req.parallel_tool_calls),
            text={"format": (req.text.format if req.text else None) or {"type": "text"}},
            temperature=req.temperature,
            top_p=req.top_p,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning,
            metadata=req.metadata or {},
            truncation=req.truncation or "disabled",
            store=req.store is not False,
            user=req.user,
        )

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        self.chat.check_model(req.model)
        if req.model_extra:
            log.warning("responses: ignoring unsupported fields: %s", ", ".join(req.model_extra))
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id, param="previous_response_id")
            history = stored.messages
        messages = input_messages(req.input, self.store.item)
        if not history and not messages:
            raise APIError(400, "input: give at least one input item", param="input")
        chat_req = self._chat_request(req, history, messages)
        response = self._response(req, f"resp_{uuid.uuid4().hex}")
        try:
            run = await self.chat.start(chat_req, request_id=response.id)
        except APIError as e:
            raise responses_error(e) from None
        builder = OutputBuilder(response)
        conversation = history + messages
        if req.stream:
            return StreamingResponse(
                self._stream(run, builder, conversation), media_type="text/event-stream"
            )
        try:
            if not await run.finish(raw.is_disconnected):
                return Response(status_code=499)  # nobody is listening
            answer = run.answers[0]
            calls = [CallDelta(i, c.arguments, c.id, c.name) for i, c in enumerate(answer.calls)]
            reason = answer.finish_reason
            builder.feed(ChatDelta(0, answer.content, answer.reasoning, calls, None, reason))
            builder.finish(reason, run.usage())
        finally:
            run.close()
        self._keep(response, conversation)
        return Response(response.model_dump_json(), media_type="application/json")

    async def _stream(
        self, run: ChatRun, builder: OutputBuilder, conversation: list[dict[str, Any]]
    ) -> AsyncIterator[str]:
        try:
            for event in builder.start():
                yield sse(event)
            async for d in run.deltas():
                for event in builder.feed(d):
                    yield sse(event)
                if d.finish_reason is not None:
                    for event in builder.finish(d.finish_reason, run.usage()):
                        yield sse(event)
        except APIError as e:
            for event in builder.fail(e.code or e.type, e.message):
                yield sse(event)
            return
        finally:
            run.close()
        self._keep(builder.response, conversation)

    def _keep(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if not response.store:
            return
        answer = assistant_message(response.output)
        messages = conversation + ([answer] if answer is not None else [])
        self.store.put(StoredResponse(response, messages))


def install_responses_routes(app: FastAPI, chat: ChatServing) -> None:
    serving = ResponsesServing(chat, ResponseStore())

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request) -> Response:
        return await serving.create(req, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> ResponseObject:
        return serving.store.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        serving.store.delete(response_id)
        return DeletedResponse(id=response_id)
