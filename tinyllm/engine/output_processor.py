"""From sampled token ids to what users see: text, stop strings, finish reasons, outputs.

Apart from request state on purpose: the engine core deals in token ids only. Per step only
what changed is worked on: each new token is detokenized incrementally, a stop string is
searched for only around the new text, and an output holds, as its request's
`output_kind` asks, only the new part (DELTA, for streaming), everything so far (CUMULATIVE),
or everything once at the end (FINAL_ONLY, for `LLM.generate`). An output's token ids and
logprobs are those of its text: held back with a possible stop string's start, and dropped
with a stop string.
"""

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyllm.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.text.detokenizer import IncrementalDetokenizer
from tinyllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


@dataclass
class TokenUpdate:
    """What the engine core reports for one request after a step."""

    request_id: str
    # The step's new tokens: one, several (draft tokens accepted by speculative decoding), or
    # none (finished without one: aborted or refused)
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held (once admitted)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first sampled token
    pooled: "torch.Tensor | None" = None  # a pooling request's embedding or scores, at its end


class _RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
    ):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = prompt_token_ids
        self.kind = params.output_kind
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.starts: list[int] = []  # where each token's text starts in self.text
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""  # everything detokenized (a possible stop string's start included)
        self.shown = 0  # tokens that outputs have reported
        self.sent_chars = 0  # the text DELTA outputs have handed out
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.pooled: torch.Tensor | None = None

    def add(self, token: int, logprob: TokenLogprob | None) -> bool:
        """Take a token; True if a stop string ended the request."""
        self.token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        old = len(self.text)
        self.starts.append(old)
        self.text += self.detok.add(token)
        for s in self.params.stop:  # only where the new text could complete one
            i = self.text.find(s, max(0, old - len(s) + 1))
            if i >= 0:
                self.text = self.text[:i]
                # The stop string's tokens go with its text: an output's tokens and logprobs
                # are those of its text (one that starts before the cut, or was shown, stays).
                keep = max(self.shown, self._starting_before(i))
                del self.token_ids[keep:], self.starts[keep:]
                if self.logprobs is not None:
                    del self.logprobs[keep:]
                self.finish("stop", s, flush=False)
                return True
        return False

    def _starting_before(self, chars: int) -> int:
        """How many tokens have text that starts in the first `chars` characters."""
        return bisect.bisect_left(self.starts, chars)

    def finish(self, reason: str, stop_reason=None, error: str | None = None, flush=True):
        if flush:
            self.text += self.detok.flush()
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        """The text minus any tail that could still grow into a stop string."""
        if self.finished:
            return self.text
        hold = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold]

    def output(self) -> RequestOutput | None:
        if self.kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        text = self.visible_text()
        sent = self.shown
        # A token goes out with its text: while a stop string may still take that, it waits.
        held = len(text) < len(self.text)
        self.shown = max(sent, self._starting_before(len(text)) if held else len(self.token_ids))
        first = sent if self.kind is RequestOutputKind.DELTA else 0
        token_ids = self.token_ids[first : self.shown]
        logprobs = None if self.logprobs is None else self.logprobs[first : self.shown]
        if self.kind is RequestOutputKind.DELTA:
            text, self.sent_chars = text[self.sent_chars :], len(text)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            error=self.error,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            pooled=self.pooled,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._states[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, self.tokenizer
        )

    def process(self, updates: list[TokenUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """The outputs for this step's updates, and the requests a stop string ended (which
        the engine core must now free)."""
        outputs, stopped = [], []
        for u in updates:
            state = self._states[u.request_id]
            if u.num_cached_tokens is not None:
                state.num_cached_tokens = u.num_cached_tokens
            if u.prompt_logprobs is not None:
                state.prompt_logprobs = u.prompt_logprobs
            if u.pooled is not None:
                state.pooled = u.pooled
            if any(state.add(t, lp) for t, lp in zip(u.token_ids, u.logprobs, strict=True)):
                stopped.append(u.request_id)  # any() stops at the token that ended it
            elif u.finish_reason is not None:
                state.finish(u.finish_reason, u.stop_reason, u.error)
            if state.finished:
                del self._states[u.request_id]
            out = state.output()
            if out is not None:
                outputs.append(out)
        return outputs, stopped
