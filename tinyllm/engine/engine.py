"""The engine: add requests any time, call step() until they finish.

One step: the scheduler decides how many tokens each request runs (decodes and prefill chunks
under one token budget, every block allocated and every preemption decided up front); the model
runner runs them as one flat batch and samples for the requests whose tokens are all computed;
the output processor turns the new tokens into text and outputs.
"""

import itertools
import logging
import random
from dataclasses import dataclass

from tinyllm.engine.config import EngineConfig
from tinyllm.engine.kv_cache_manager import KVCacheManager
from tinyllm.engine.model_runner import ModelRunner, kv_bytes_per_token
from tinyllm.engine.output_processor import OutputProcessor, TokenUpdate
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.request import Request, RequestStatus
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.scheduler import Scheduler
from tinyllm.model.attention import get_backend
from tinyllm.model.llama import Transformer
from tinyllm.model.quant import describe_weights
from tinyllm.text.tokenizer import Tokenizer

log = logging.getLogger("tinyllm")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float  # fraction of the pool's blocks allocated
    num_preemptions: int
    recomputed_tokens: int  # prefill work redone for preempted requests
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens found cached (not computed)


def build_kv_cache_manager(model: Transformer, cfg: EngineConfig, max_len: int) -> KVCacheManager:
    """The paged pool, or the slot baseline: the same manager with blocks of max_len tokens."""
    per_token = kv_bytes_per_token(model)
    block_size = max_len if cfg.kv_cache == "slot" else cfg.block_size
    unit = per_token * block_size
    if cfg.num_blocks is None and cfg.kv_cache_memory < unit:
        what = f"one slot of {max_len} tokens" if cfg.kv_cache == "slot" else "one block"
        raise ValueError(
            f"kv_cache_memory={cfg.kv_cache_memory} bytes cannot hold {what} ({unit} bytes); "
            "raise kv_cache_memory or lower max_model_len"
        )
    if cfg.kv_cache == "slot":
        num_blocks = min(cfg.max_num_seqs, cfg.num_blocks or cfg.kv_cache_memory // unit)
    else:
        num_blocks = cfg.num_blocks or cfg.kv_cache_memory // unit
    tokens = num_blocks * block_size
    log.info(
        "%s KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB)",
        cfg.kv_cache,
        num_blocks,
        block_size,
        tokens,
        tokens * per_token / 2**20,
    )
    if tokens < max_len:
        log.warning(
            "the KV cache holds %d tokens, fewer than max_model_len %d: a request that needs "
            "more fails with an error; raise num_blocks/kv_cache_memory or lower max_model_len",
            tokens,
            max_len,
        )
    caching = cfg.enable_prefix_caching and cfg.kv_cache == "paged"
    return KVCacheManager(num_blocks, block_size, caching, extra_key=cache_key(model))


def cache_key(model: Transformer) -> str:
    """What besides its tokens sets a block's K/V: the architecture, weight format and dtype."""
    return f"{model.config!r} {describe_weights(model)}"


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = min(
            config.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
        )
        self.kv = build_kv_cache_manager(model, config, self.max_model_len)
        backend = get_backend(config.attention_backend, model.device)
        self.runner = ModelRunner(model, self.kv.num_blocks, self.kv.block_size, backend)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(tokenizer)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.prompt_tokens = self.generation_tokens = self.recomputed_tokens = 0

    # -- API ------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n, limit = len(prompt_token_ids), self.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= limit:
            raise ValueError(
                f"prompt is {n} tokens, but this model's context is {limit} tokens "
                f"(the prompt must leave room for at least one generated token)"
            )
        vocab = self.model.config.vocab_size
        for what, ids in (
            ("prompt", prompt_token_ids),
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{what} token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def add_request(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        """Queue a request; a text prompt is tokenized unless its token ids are given."""
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        self.validate_prompt(ids, params)
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        elif request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        request = Request(
            request_id,
            ids,
            params,
            max_tokens,
            self.tokenizer.eos_token_ids,
            seed=self._rng.getrandbits(63),
        )
        self.requests[request_id] = request
        self.output_processor.add_request(request_id, text, request.prompt_token_ids, params)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its final output, or None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        outputs = self._finish(request, TokenUpdate(request_id, None, None, "abort"))
        return outputs[0] if outputs else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_blocks,
            kv_usage=pool.num_used / pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            recomputed_tokens=self.recomputed_tokens,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, e.g. after changing the weights; how many."""
        return self.kv.reset_prefix_cache()

    # -- one step -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        outputs = []
        for request in out.rejected:
            error = (
                f"request needs {request.num_tokens + 1} tokens of KV cache but the whole cache "
                f"holds {self.kv.capacity_tokens} (max_model_len {self.max_model_len})"
            )
            update = TokenUpdate(request.request_id, None, None, "error", error=error)
            outputs += self._finish(request, update)
        if not out.scheduled:
            return outputs
        sampled = self.runner.execute(out.scheduled)
        for request, n in out.scheduled:
            self._count(request, n)
            request.num_computed_tokens += n
        updates, done = [], []
        for request, token, logprob in sampled:
            request.append_token(token, self.max_model_len)
            reason = request.finish_reason
            update = TokenUpdate(
                request.request_id,
                token,
                logprob,
                reason,
                request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
            )
            updates.append(update)
            if reason is not None:
                done.append(request)
        self.generation_tokens += len(sampled)
        step_outputs, stopped = self.output_processor.process(updates)
        for request in done:
            self._release(request)
        for request_id in stopped:  # a stop string: the output processor has reported it
            request = self.requests.get(request_id)
            if request is not None:
                request.finish_reason = "stop"
                self._release(request)
        return outputs + step_outputs

    def _count(self, request: Request, n: int) -> None:
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        redone = max(0, min(end, request.num_ever_computed) - start)
        self.recomputed_tokens += redone
        self.prompt_tokens += max(0, min(end, request.num_prompt_tokens) - start - redone)
        request.num_ever_computed = max(request.num_ever_computed, end)

    def _finish(self, request: Request, update: TokenUpdate) -> list[RequestOutput]:
        """End a request that gets no new token (aborted, refused): its final output."""
        request.finish_reason = update.finish_reason
        self._release(request)
        return self.output_processor.process([update])[0]

    def _release(self, request: Request) -> None:
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
