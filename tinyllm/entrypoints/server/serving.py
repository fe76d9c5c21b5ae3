"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped responses out."""

import itertools
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.entrypoints.llm import LLM
from tinyllm.entrypoints.server.engine_loop import EngineLoop
from tinyllm.entrypoints.server.engine_requests import (
    Choice,
    Constraint,
    Prompt,
    chat_prompt,
    completion_prompts,
    plan_choices,
    request_constraint,
)
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.generation import Generation, sse
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
    SamplingRequest,
    TopLogprob,
)
from tinyllm.entrypoints.server.tools import ToolDeltas, plan_tools, tool_message

log = logging.getLogger("tinyllm.server")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat fills the context


class OpenAIServing:
    def __init__(self, llm: LLM, engine_loop: EngineLoop) -> None:
        self.tokenizer, self.model_name = llm.tokenizer, llm.model_name
        self.loop = engine_loop  # the engine itself only its thread touches
        self.validator = llm.engine.request_validator()
        # A field a request leaves out: the model's recommended value (--generation-config
        # auto), else OpenAI's defaults, which SamplingParams' neutral values are.
        self.defaults = llm.get_default_sampling_params()
        self.default_max_tokens = llm.default_sampling.get("max_tokens")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def _common_checks(self, req: SamplingRequest) -> bool:
        """Common checks; returns whether the stream ends with a usage chunk."""
        self.check_model(req.model)
        if req.model_extra:
            log.warning("ignoring unsupported request fields: %s", ", ".join(req.model_extra))
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
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, param = req.max_tokens, "max_tokens"
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        constraint = request_constraint(req)
        tools = plan_tools(req, constraint is not None)
        if tools.constraint is not None:
            constraint = Constraint(tools.constraint, "tools")
        prompt = await run_in_threadpool(
            chat_prompt, self.tokenizer, req.messages, tools=tools.tools
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        choices = plan_choices(
            self.validator,
            request_id,
            req,
            [prompt],
            max_tokens,
            self.default_max_tokens,
            logprobs,
            self.defaults,
            param,
            constraint,
        )
        created = int(time.time())
        streams = {c.index: ToolDeltas() for c in choices} if tools.parse else {}

        def chunk(choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        def delta(c: Choice, text: str, lps: list[TokenLogprob] | None, reason, _start: int):
            logprobs = self._chat_logprobs(lps) if lps is not None else None
            new = Delta(content=text or None)
            if tools.parse:  # calls become tool_calls deltas; no markup reaches content
                new, reason = streams[c.index].delta(text, reason)
                if new is None and reason is None and logprobs is None:
                    return None
            return chunk(
                [
                    ChatChunkChoice(
                        index=c.index,
                        delta=new or Delta(),
                        logprobs=logprobs,
                        finish_reason=reason,
                    )
                ]
            )

        gen = Generation(self.loop, request_id, [prompt], choices)
        if req.stream:
            # OpenAI's first chunk of each choice names the role, with empty content.
            roles = [
                chunk([ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content=""))])
                for c in choices
            ]
            usage_chunk = (lambda u: chunk([], u)) if include_usage else None
            return StreamingResponse(
                sse(gen, delta, first=roles, usage_chunk=usage_chunk),
                media_type="text/event-stream",
            )
        try:
            if not await gen.finish(raw.is_disconnected):
                return Response(status_code=499)
        finally:
            gen.close()
        done = []
        for c in choices:
            out = gen.results[c.index]
            lps = out.logprobs
            message, reason = AssistantMessage(content=out.text), out.finish_reason
            if tools.parse:
                message, reason = tool_message(out.text, reason)
            done.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._chat_logprobs(lps) if lps is not None else None,
                    finish_reason=reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=done,
            usage=gen.usage(),
        )

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
