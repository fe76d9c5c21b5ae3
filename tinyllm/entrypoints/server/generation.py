"""One HTTP request's engine requests, from submission to the last output, and its SSE stream."""

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from tinyllm.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tinyllm.entrypoints.server.engine_loop import EngineLoop
from tinyllm.entrypoints.server.engine_requests import Choice, Prompt
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.protocol import PromptTokensDetails, Usage

log = logging.getLogger("tinyllm.server")

# How often a non-streaming handler checks whether its client is still there.
DISCONNECT_POLL_S = 0.5

# (choice, new text, its tokens' logprobs, finish reason, where its generated part starts in
# everything streamed for the choice) -> one chunk, or None when there is nothing to send yet
ChunkFn = Callable[[Choice, str, list[TokenLogprob] | None, str | None, int], BaseModel | None]


@dataclass
class ChoiceResult:
    """A choice's output so far, summed from the engine's deltas."""

    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_cached_tokens: int = 0  # of its prompt, from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # asked by echo with logprobs

    def add(self, out: CompletionOutput, request: RequestOutput) -> None:
        self.num_cached_tokens = request.num_cached_tokens
        if request.prompt_logprobs is not None:
            self.prompt_logprobs = request.prompt_logprobs
        self.text += out.text
        self.num_tokens += len(out.token_ids)
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


class Generation:
    """Submits every choice at once; whatever way the request ends, close() aborts what is left
    in the engine (so a client that went away frees its KV blocks at once) and logs the line."""

    def __init__(
        self,
        loop: EngineLoop,
        request_id: str,
        prompts: list[Prompt],
        choices: list[Choice],
        score_only: bool = False,
    ) -> None:
        """`score_only`: the prompt is all the client asked for (echo with max_tokens 0); the
        token the engine samples after it is dropped from every output."""
        self.request_id, self.prompts, self.choices = request_id, prompts, choices
        self._score_only = score_only
        self._loop = loop
        self._by_key = {(c.request_id, c.completion): c for c in choices}
        self.results = {c.index: ChoiceResult() for c in choices}
        # One engine request per prompt, for its n choices.
        requests = {c.request_id: (c.request_id, c.prompt.token_ids, c.params) for c in choices}
        self._unfinished = set(requests)
        self._start = time.perf_counter()
        self._stream = loop.submit(list(requests.values()))
        self._closed = False
        self._error: APIError | None = None  # what ended it early, for the log
        # Logged before it runs: if the process dies in native code, the log says what it ran.
        log.info(
            "%s: started, %s prompt token(s), %d choice(s), max_tokens %d",
            request_id,
            "+".join(str(len(p.token_ids)) for p in prompts),
            len(choices),
            choices[0].params.max_tokens,
        )

    async def _next(self) -> list[tuple[Choice, CompletionOutput]]:
        """The deltas that arrived, in order, each added to its choice's result."""
        batch = []
        try:
            outputs = await self._stream.get()
        except APIError as e:
            self._error = e
            raise
        for out in outputs:
            if out.finished:
                self._unfinished.discard(out.request_id)
            for completion in out.outputs:
                if completion.finish_reason == "error":
                    self._error = APIError(500, out.error or "the engine failed on this request")
                    raise self._error
                if self._score_only:
                    completion = _without_tokens(completion)
                choice = self._by_key[(out.request_id, completion.index)]
                self.results[choice.index].add(completion, out)
                batch.append((choice, completion))
        return batch

    async def updates(self) -> AsyncIterator[list[tuple[Choice, CompletionOutput]]]:
        while self._unfinished:
            yield await self._next()

    async def finish(
        self,
        disconnected: Callable[[], Awaitable[bool]],
        on_output: Callable[[], None] | None = None,
    ) -> bool:
        """Wait for every choice to finish; False if the client went away first. `on_output`
        runs as each batch of outputs arrives (a dialect that reports its own timings)."""

        async def drain() -> None:
            while self._unfinished:
                await self._next()
                if on_output is not None:
                    on_output()

        async def watch() -> None:
            while not await disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        work, watcher = asyncio.ensure_future(drain()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            watcher.cancel()
        if work.done() and not work.cancelled():
            work.result()  # raises the request's error, if it failed
            return True
        return False

    def usage(self) -> Usage:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(r.num_tokens for r in self.results.values())
        # A prompt counts once, as in prompt_tokens: its first choice's cached tokens.
        firsts = {id(c.prompt): self.results[c.index] for c in reversed(self.choices)}
        cached = sum(r.num_cached_tokens for r in firsts.values())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._loop.abort(list(self._unfinished))
        reasons = sorted({r.finish_reason for r in self.results.values() if r.finish_reason})
        if self._error is not None:
            reasons.append(f"error {self._error.status} ({self._error.message})")
        usage = self.usage()
        log.info(
            "%s: %d choice(s), %d prompt + %d completion tokens, %s in %.2fs%s",
            self.request_id,
            len(self.choices),
            usage.prompt_tokens,
            usage.completion_tokens,
            "/".join(reasons) or "ended early",
            time.perf_counter() - self._start,
            f", aborted {len(self._unfinished)} unfinished" if self._unfinished else "",
        )


def _without_tokens(out: CompletionOutput) -> CompletionOutput:
    """`out` with no generated tokens: the answer ends at the prompt ("length", as OpenAI says)."""
    reason = "length" if out.finish_reason in ("stop", "length") else out.finish_reason
    return dataclasses.replace(
        out,
        text="",
        token_ids=[],
        logprobs=None if out.logprobs is None else [],
        finish_reason=reason,
        stop_reason=None,
    )


def sse_event(data: BaseModel | dict) -> str:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {body}\n\n"


async def sse(
    gen: Generation,
    chunk: ChunkFn,
    first: Sequence[BaseModel] = (),
    prefixes: dict[int, str] | None = None,
    usage_chunk: Callable[[Usage], BaseModel] | None = None,
) -> AsyncIterator[str]:
    """Server-sent events: `first`, then each choice's new text as it comes (a `prefixes` entry,
    the echoed prompt, goes before a choice's first text), the usage chunk, and `[DONE]`.
    An error after the stream started becomes an error event."""
    prefixes = dict(prefixes or {})
    streamed = {c.index: 0 for c in gen.choices}  # chars streamed per choice
    held: dict[int, list[TokenLogprob]] = {}  # logprobs of tokens whose text is held back
    try:
        for c in first:
            yield sse_event(c)
        async for batch in gen.updates():
            for choice, out in batch:
                prefix = prefixes.pop(choice.index, "")
                text = prefix + out.text
                new = out.logprobs
                if new is not None:
                    new = held.pop(choice.index, []) + new
                finished = out.finish_reason is not None
                if not text and not finished:
                    if new:  # no text yet (a stop string may be starting): send them later
                        held[choice.index] = new
                    continue
                start = streamed[choice.index]
                streamed[choice.index] += len(text)
                event = chunk(choice, text, new, out.finish_reason, start + len(prefix))
                if event is not None:
                    yield sse_event(event)
        if usage_chunk is not None:
            yield sse_event(usage_chunk(gen.usage()))
    except APIError as e:
        yield sse_event(e.body())
    finally:
        gen.close()
    yield "data: [DONE]\n\n"
