"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped responses out."""

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.entrypoints.server.chat_run import ChatRun, ChatServing
from tinyllm.entrypoints.server.engine_requests import (
    Choice,
    Prompt,
    completion_prompts,
    plan_choices,
    request_constraint,
)
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.generation import Generation, sse, sse_event
from tinyllm.entrypoints.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    FunctionCallOut,
    FunctionDelta,
    SamplingRequest,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)

log = logging.getLogger("tinyllm.server")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context


class OpenAIServing:
    """OpenAI's dialect: /v1/completions here, /v1/chat/completions through the shared chat
    path (chat_run)."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat_serving = chat
        self.tokenizer, self.model_name = chat.tokenizer, chat.model_name
        self.loop, self.validator = chat.loop, chat.validator
        self.defaults, self.default_max_tokens = chat.defaults, chat.default_max_tokens

    def _common_checks(self, req: SamplingRequest) -> bool:
        """Common checks; returns whether the stream ends with a usage chunk."""
        self.chat_serving.check_fields(req)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        return bool(req.stream and req.stream_options and req.stream_options.include_usage)

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        include_usage = self._common_checks(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        constraint = request_constraint(req)
        # echo with max_tokens 0 scores the prompt alone (OpenAI's API does; evaluation harnesses
        # send it). The engine always samples after the prompt: one token, which is dropped.
        score_only = bool(req.echo) and req.max_tokens == 0
        prompts = await run_in_threadpool(completion_prompts, self.tokenizer, req.prompt)
        choices = plan_choices(
            self.validator,
            request_id,
            req,
            prompts,
            1 if score_only else req.max_tokens,
            self.default_max_tokens or COMPLETION_MAX_TOKENS,
            req.logprobs,
            self.defaults,
            constraint=constraint,
            # echo with logprobs: the prompt's tokens get theirs too (the first has none).
            prompt_logprobs=req.logprobs if req.echo else None,
        )
        created = int(time.time())
        echo = {c.index: self._prompt_text(c.prompt) for c in choices} if req.echo else {}
        # The choices whose next chunk (their first) still owes the prompt's logprobs.
        owed = set(echo) if req.logprobs is not None else set()

        def response(choices: list[CompletionChoice], usage=None) -> CompletionResponse:
            return CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        def choice(c: Choice, text: str, lps: list[TokenLogprob] | None, reason, start: int):
            first = None
            if c.index in owed:  # the prompt's first token has no logprob: its id alone
                owed.discard(c.index)
                first, start = c.prompt.token_ids[0], 0
                lps = gen.results[c.index].prompt_logprobs[1:] + lps
            logprobs = self._completion_logprobs(lps, start, first) if lps is not None else None
            return CompletionChoice(
                index=c.index, text=text, logprobs=logprobs, finish_reason=reason
            )

        gen = Generation(self.loop, request_id, prompts, choices, score_only)
        if req.stream:
            return StreamingResponse(
                sse(
                    gen,
                    lambda *a: response([choice(*a)]),
                    prefixes=echo,
                    usage_chunk=(lambda u: response([], u)) if include_usage else None,
                ),
                media_type="text/event-stream",
            )
        try:
            if not await gen.finish(raw.is_disconnected):
                return Response(status_code=499)  # nobody is listening
        finally:
            gen.close()
        done = []
        for c in choices:
            out, prefix = gen.results[c.index], echo.get(c.index, "")
            done.append(choice(c, prefix + out.text, out.logprobs, out.finish_reason, len(prefix)))
        return response(done, gen.usage())

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        include_usage = self._common_checks(req)
        run = await self.chat_serving.start(req)
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=run.request_id,
                created=created,
                model=self.model_name,
                choices=choices,
                usage=usage,
            )

        legacy = req.legacy_functions  # the answer's one call as `function_call`
        if req.stream:
            return StreamingResponse(
                self._chat_stream(run, chunk, include_usage, legacy),
                media_type="text/event-stream",
            )
        try:
            if not await run.finish(raw.is_disconnected):
                return Response(status_code=499)  # nobody is listening
        finally:
            run.close()
        done = []
        for index, a in run.answers.items():
            calls = [
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in a.calls
            ]
            message = AssistantMessage(
                content=a.content if a.content or not a.calls else None,
                reasoning_content=a.reasoning or None,
                reasoning=a.reasoning or None,
                tool_calls=None if legacy else calls or None,
                function_call=calls[0].function if legacy and calls else None,
            )
            logprobs = self._chat_logprobs(a.logprobs) if a.logprobs is not None else None
            reason = _legacy_reason(a.finish_reason) if legacy else a.finish_reason
            done.append(
                ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason)
            )
        return ChatCompletionResponse(
            id=run.request_id,
            created=created,
            model=self.model_name,
            choices=done,
            usage=run.usage(),
        )

    async def _chat_stream(
        self,
        run: ChatRun,
        chunk: Callable[..., ChatCompletionChunk],
        include_usage: bool,
        legacy: bool,
    ) -> AsyncIterator[str]:
        """OpenAI's chunks: each choice's role first (with empty content, as OpenAI's first
        chunk), then its deltas, the usage chunk if asked, and [DONE]; an error after the
        stream started becomes an error event. `legacy`: the call goes as `function_call`."""
        try:
            role = Delta(role="assistant", content="")
            for c in run.choices:
                yield sse_event(chunk([ChatChunkChoice(index=c.index, delta=role)]))
            async for d in run.deltas():
                calls = [
                    ToolCallDelta(
                        index=c.index,
                        id=c.id,
                        type="function" if c.id is not None else None,
                        function=FunctionDelta(name=c.name, arguments=c.arguments),
                    )
                    for c in d.calls
                ]
                delta = Delta(
                    content=d.content or None,
                    reasoning_content=d.reasoning or None,
                    reasoning=d.reasoning or None,
                    tool_calls=None if legacy else calls or None,
                    function_call=calls[0].function if legacy and calls else None,
                )
                logprobs = self._chat_logprobs(d.logprobs) if d.logprobs is not None else None
                reason = _legacy_reason(d.finish_reason) if legacy else d.finish_reason
                choice = ChatChunkChoice(
                    index=d.index, delta=delta, logprobs=logprobs, finish_reason=reason
                )
                yield sse_event(chunk([choice]))
            if include_usage:
                yield sse_event(chunk([], run.usage()))
        except APIError as e:
            yield sse_event(e.body())
        finally:
            run.close()
        yield "data: [DONE]\n\n"

    # -- shapes ---------------------------------------------------------------------------------

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(
        self, lps: list[TokenLogprob], start: int, first: int | None = None
    ) -> CompletionLogprobs:
        """OpenAI's shape. `first`: an echoed prompt's first token, which has no logprob (null,
        as OpenAI's API gives it), before the others."""
        tokens = [self._token(lp.token_id) for lp in lps]
        lp_values: list[float | None] = [lp.logprob for lp in lps]
        tops: list[dict[str, float] | None] = [{self._token(t): v for t, v in lp.top} for lp in lps]
        if first is not None:
            tokens = [self._token(first), *tokens]
            lp_values, tops = [None, *lp_values], [None, *tops]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=lp_values,
            top_logprobs=tops,
            text_offset=list(itertools.accumulate(map(len, tokens), initial=start))[:-1],
        )

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> TopLogprob:
            text = self._token(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        return ChatLogprobs(
            content=[
                ChatLogprob(
                    **top(lp.token_id, lp.logprob).model_dump(),
                    top_logprobs=[top(t, v) for t, v in lp.top],
                )
                for lp in lps
            ]
        )


def _legacy_reason(reason: str | None) -> str | None:
    """The legacy functions API's name for an answer that ended with its call."""
    return "function_call" if reason == "tool_calls" else reason
