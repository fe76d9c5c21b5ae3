"""The continuous-batching engine: add requests any time, call step() until they finish.

Each step: admit what fits (prefilled together, packed without padding), make room for the
next decode token (preempting the newest sequences if blocks run out), decode one token for
every running sequence, and hand back every request that advanced.
"""

import itertools
import logging
import random
from dataclasses import dataclass

import torch

from tinyllm.engine.kv_cache import PackedKVCache, SlotKVCache
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.paged_kv_cache import PagedKVCache
from tinyllm.engine.sampler import sample
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.scheduler import Scheduler
from tinyllm.engine.sequence import Sequence
from tinyllm.model.llama import Transformer
from tinyllm.text.tokenizer import Tokenizer

log = logging.getLogger("tinyllm")


@dataclass
class EngineConfig:
    kv_cache: str = "paged"  # "paged" or "slot"
    block_size: int = 16
    num_blocks: int | None = None  # None: as many as kv_cache_memory holds
    kv_cache_memory: int = 2 << 30  # bytes of K and V, all layers
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's context length
    max_num_batched_tokens: int = 4096  # prompt tokens packed into one prefill step
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kv_cache not in ("paged", "slot"):
            raise ValueError(f"kv_cache={self.kv_cache!r}: choose 'paged' or 'slot'")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float  # fraction of the cache's token capacity allocated
    num_preemptions: int
    recomputed_tokens: int  # prefill work redone for preempted sequences
    prompt_tokens: int
    generation_tokens: int


def _build_cache(model: Transformer, cfg: EngineConfig, max_len: int):
    c = model.config
    w = model.lm_head.weight
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * w.element_size()
    shape = dict(
        n_layers=c.num_layers,
        n_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=w.dtype,
        device=w.device,
    )
    unit = per_token * (max_len if cfg.kv_cache == "slot" else cfg.block_size)
    if cfg.kv_cache_memory < unit and not (cfg.kv_cache == "paged" and cfg.num_blocks):
        what = f"one slot of {max_len} tokens" if cfg.kv_cache == "slot" else "one block"
        raise ValueError(
            f"kv_cache_memory={cfg.kv_cache_memory} bytes cannot hold {what} ({unit} bytes); "
            "raise kv_cache_memory or lower max_model_len"
        )
    if cfg.kv_cache == "slot":
        n_slots = min(cfg.max_num_seqs, cfg.kv_cache_memory // unit)
        log.info("slot KV cache: %d slots x %d tokens", n_slots, max_len)
        return SlotKVCache(n_slots=n_slots, max_len=max_len, **shape)
    n_blocks = cfg.num_blocks or cfg.kv_cache_memory // unit
    log.info(
        "paged KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB)",
        n_blocks,
        cfg.block_size,
        n_blocks * cfg.block_size,
        n_blocks * cfg.block_size * per_token / 2**20,
    )
    return PagedKVCache(
        n_slots=cfg.max_num_seqs,
        n_blocks=n_blocks,
        block_size=cfg.block_size,
        max_len=max_len,
        **shape,
    )


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = min(
            config.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
        )
        self.cache = _build_cache(model, config, self.max_model_len)
        self.scheduler = Scheduler(self.cache, config.max_num_batched_tokens)
        self.device = model.lm_head.weight.device
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
        request_id = request_id if request_id is not None else str(next(self._ids))
        seq = Sequence(
            request_id,
            text,
            ids,
            params,
            self.tokenizer,
            self.max_model_len,
            seed=self._rng.getrandbits(63),
        )
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        seq.finish("abort")
        return seq.output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        c = self.cache
        if isinstance(c, PagedKVCache):
            used, total = c.alloc.num_used, c.alloc.n_blocks
        else:
            used, total = sum(c.active), c.n_slots
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=used,
            kv_blocks_total=total,
            kv_usage=c.allocated_tokens() / c.reserved_tokens(),
            num_preemptions=self.scheduler.num_preemptions,
            recomputed_tokens=self.recomputed_tokens,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )

    # -- one step -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        advanced: dict[str, Sequence] = {}
        admitted, rejected = self.scheduler.schedule_prefill()
        for seq in rejected:
            seq.finish(
                "error",
                error=(
                    f"request needs {seq.num_tokens + 1} tokens of KV cache but the whole cache "
                    f"holds {self.cache.reserved_tokens()} (max_model_len {self.max_model_len})"
                ),
            )
            advanced[seq.request_id] = seq
        if admitted:
            self._prefill(admitted)
            advanced.update((s.request_id, s) for s in admitted)
        self.scheduler.preempt_for_decode()
        batch = self.scheduler.decode_batch()
        if batch:
            self._decode(batch)
            advanced.update((s.request_id, s) for s in batch)
        return [s.output() for s in advanced.values()]

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill the batch packed, sample each one's next token, move it into the cache."""
        c = self.model.config
        w = self.model.lm_head.weight
        prefill = PackedKVCache(
            c.num_layers,
            [s.num_tokens for s in seqs],
            c.num_kv_heads,
            c.head_dim,
            w.dtype,
            self.device,
        )
        ids = torch.tensor([[t for s in seqs for t in s.all_token_ids]], device=self.device)
        hidden = self.model(ids, prefill)[0]
        slots = self.cache.free_slots()[: len(seqs)]
        self.cache.admit(slots, prefill)
        self.scheduler.start(seqs, slots)
        self.prompt_tokens += sum(len(s.prompt_token_ids) for s in seqs if not s.num_preemptions)
        self.recomputed_tokens += sum(s.num_tokens for s in seqs if s.num_preemptions)
        last = torch.tensor(prefill.last_token_index(), device=self.device)
        self._append(seqs, self.model.logits(hidden[last]))

    def _decode(self, seqs: list[Sequence]) -> None:
        ids = torch.tensor([[s.output_token_ids[-1]] for s in seqs], device=self.device)
        hidden = self.model(ids, self.cache)
        self._append(seqs, self.model.logits(hidden[:, 0]))

    def _append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        tokens, logprobs = sample(logits, seqs)
        self.generation_tokens += len(tokens)
        for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            seq.append(tok, lp)
            if seq.finished:
                self.scheduler.release(seq)
