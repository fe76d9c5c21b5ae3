"""A request in flight: its tokens, its place in the cache, and when and why it stops."""

import enum
import time

import torch

from tinyllm.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.text.detokenizer import IncrementalDetokenizer
from tinyllm.text.tokenizer import Tokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        max_model_len: int,
        seed: int,
    ):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.status = Status.WAITING
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.max_model_len = max_model_len
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(tokenizer.eos_token_ids)
        self._detok = IncrementalDetokenizer(
            tokenizer, self.prompt_token_ids, params.skip_special_tokens
        )
        self._text = ""  # all detokenized text (before holding back a possible stop string)
        # Each request draws from its own generator, so a seed gives the same tokens whatever
        # else shares the batch.
        self.generator = torch.Generator().manual_seed(
            params.seed if params.seed is not None else seed
        )
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, logprob: TokenLogprob | None) -> None:
        """Record one generated token and decide whether the request is done."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if token in self._stop_ids:
            return self.finish("stop", stop_reason=token)
        old = len(self._text)
        self._text += self._detok.add(token)
        if self._find_stop_string(old):
            return
        if (
            len(self.output_token_ids) >= self.params.max_tokens
            or self.num_tokens >= self.max_model_len
        ):
            self.finish("length")

    def _find_stop_string(self, old_len: int) -> bool:
        """Finish at the earliest stop string that ends in the newly added text."""
        for s in self.params.stop:
            i = self._text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0:
                self._text = self._text[:i]
                self.finish("stop", stop_reason=s, flush=False)
                return True
        return False

    def finish(self, reason: str, stop_reason=None, error: str | None = None, flush=True) -> None:
        if flush:
            self._text += self._detok.flush()
        self.status, self.finish_reason = Status.FINISHED, reason
        self.stop_reason, self.error = stop_reason, error
        self.finish_time = time.monotonic()

    def visible_text(self) -> str:
        """The text so far minus any tail that could still grow into a stop string."""
        if self.finished:
            return self._text
        hold = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self._text)), hold, -1):
                if self._text.endswith(s[:k]):
                    hold = k
                    break
        return self._text[: len(self._text) - hold]

    def output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.visible_text(),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            error=self.error,
        )
