"""Turns the scheduler's output into one flat batch, runs the model once, samples.

The runner owns the K/V tensors: per layer a pool of `num_blocks + 1` blocks, token-major
(block, offset, kv head, dim), the last block scratch (padded block-table entries point there),
of the model's dtype or, with kv_cache_dtype="int8", int8 rows of codes and their scales
(model/attention/int8_cache.py).
The pool is allocated, not zeroed: on the CPU a large allocation is a fresh anonymous mapping
whose pages take no memory until a block is written, so resident memory follows the blocks in
use, not the pool's size. An unwritten slot holds any bits (NaN included), as does a slot
written by an earlier request; the attention backends never let a slot at or past a row's
`seq_len` reach the output.
It takes nothing but the step's message (engine/step_message.py): it keeps its own state of
each request from the messages (token ids, blocks, sampling settings, random generator) and
returns the sampled tokens as data. Each step it builds, once, what every layer's attention
reads: token ids, positions, the slot each new K/V goes to, block tables, query start offsets
and context lengths. Decode rows go first, so a backend can treat them as one batch of
single-token queries.
"""

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.step_message import ModelRunnerOutput, SchedulerOutput
from tinyllm.engine.worker.logprobs import token_logprobs
from tinyllm.engine.worker.pooler import Pooler, PoolState
from tinyllm.engine.worker.sampler import Sampler
from tinyllm.model.attention import AttentionBackend, AttentionMetadata, ForwardContext, get_backend
from tinyllm.model.attention.int8_cache import cache_dtype, row_width
from tinyllm.model.layer_executor import choose_layer_executor
from tinyllm.model.llama import Transformer

_PROMPT_LOGITS_ROWS = 128  # prompt positions per LM-head call (see _prompt_logprobs)


@dataclass
class CachedRequestState:
    """The runner's record of a request, kept from the step messages until it finishes (a
    preempted request keeps it: its generator goes on where it was)."""

    req_id: str
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator  # CPU, seeded per request
    token_ids: list[int]  # prompt and output
    block_ids: list[int]
    # Prompt positions whose logprob has been computed; the first token has none.
    num_prompt_logprobs: int = 1
    pool: PoolState | None = None  # a pooling request's (engine/worker/pooler.py)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepBatch:
    rows: list[tuple[str, int]]  # (request id, tokens) in batch order (decodes first)
    input_ids: Tensor  # (N,)
    positions: Tensor  # (N,)
    ctx: ForwardContext
    sampling: list[CachedRequestState]  # the rows whose tokens are all computed after this step
    drafts: list[list[int]]  # their draft tokens run this step (speculative decoding)
    # Their last token's index in the batch, and each draft token's after it.
    logits_indices: Tensor
    # Prompt logprobs to compute: (request, batch index of a position, the prompt token after it)
    prompt_targets: list[tuple[CachedRequestState, int, int]]
    # Pooling requests' chunks: (request, first batch index, tokens, first position, whether
    # the prompt is done after it)
    pool_chunks: list[tuple[CachedRequestState, int, int, int, bool]]


@dataclass(frozen=True)
class RunnerSpec:
    """What builds a runner, the same on every tensor-parallel rank: rank 0's engine sizes the
    pool and sends this to the others."""

    num_blocks: int
    block_size: int
    attention_backend: str
    layer_executor: str
    kv_cache_dtype: str
    classifier_token_ids: tuple[int, ...] = ()  # a reranker scored by these tokens' logits

    def build(self, model: Transformer, samples: bool = True) -> "ModelRunner":
        backend = get_backend(self.attention_backend, model.device, model.config.sliding_window)
        return ModelRunner(
            model,
            self.num_blocks,
            self.block_size,
            backend,
            self.layer_executor,
            samples,
            self.kv_cache_dtype,
            self.classifier_token_ids,
        )


def kv_bytes_per_token(model: Transformer, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token, all layers: an int8 cache's codes and scales included; none for
    an encoder, whose prompts run whole and keep no K/V."""
    c, dtype = model.config, cache_dtype(kv_cache_dtype, model.dtype)
    if not c.is_causal:
        return 0
    return 2 * c.num_layers * c.num_kv_heads * row_width(c.head_dim, dtype) * dtype.itemsize


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend,
        layer_executor: str = "auto",
        samples: bool = True,
        kv_cache_dtype: str = "auto",
        classifier_token_ids: tuple[int, ...] = (),
    ):
        """`layer_executor`: how the model's layers run (tinyllm.model.layer_executor), chosen
        here and set on the model.
        `samples`: False on a tensor-parallel rank other than 0, which runs the layers with the
        others but leaves the LM head and sampling to rank 0.
        `kv_cache_dtype`: "auto" (the model's dtype) or "int8".
        `classifier_token_ids`: a reranker's tokens, scored at a prompt's last token (pooler)."""
        dtype = cache_dtype(kv_cache_dtype, model.dtype)
        if dtype == torch.int8 and not backend.supports_int8_cache:
            raise ValueError(
                f"kv_cache_dtype='int8': the {backend.name} attention backend reads caches of the "
                "model's dtype only; use attention_backend='reference' or kv_cache_dtype='auto'"
            )
        self.model, self.backend, self.block_size = model, backend, block_size
        self.samples = samples
        model.set_layer_executor(choose_layer_executor(layer_executor, model, backend))
        c = model.config
        self.device = model.device
        self.scratch = num_blocks
        shape = (num_blocks + 1, block_size, c.num_kv_heads, row_width(c.head_dim, dtype))
        # An encoder keeps no K/V: its blocks are the scheduler's bookkeeping only.
        self.kv_caches = [
            (
                torch.empty(shape, dtype=dtype, device=self.device),
                torch.empty(shape, dtype=dtype, device=self.device),
            )
            for _ in range(c.num_layers if c.is_causal else 0)
        ]
        self.sampler = Sampler()
        self.pooler = Pooler(model, classifier_token_ids)  # for requests with PoolingParams
        self.requests: dict[str, CachedRequestState] = {}

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run each scheduled request's next tokens (its draft tokens last). The output holds,
        for the requests whose tokens are now all computed (a finished prompt or a decode), the
        drafts the model accepted, then one token of its own; and the prompt logprobs computed.
        Advancing `num_computed_tokens` (past the accepted drafts only) is the scheduler's
        `update_from_output`."""
        return self.execute_batch(self.prepare_inputs(out), out)

    def execute_batch(self, batch: StepBatch, out: SchedulerOutput) -> ModelRunnerOutput:
        """`execute_model` after `prepare_inputs`: the forward pass and the sampling."""
        hidden = self.model(batch.input_ids, batch.positions, batch.ctx)
        result = ModelRunnerOutput()
        if not self.samples:
            return result
        if batch.pool_chunks:
            result.pooled = self._pool(hidden, batch.pool_chunks)
        if batch.prompt_targets:
            result.prompt_logprobs = self._prompt_logprobs(hidden, batch.prompt_targets)
        if batch.sampling:  # else only prompt chunks ran: no row to sample, no LM head to run
            logits = self.model.logits(hidden[batch.logits_indices])
            row = {state.req_id: i for i, state in enumerate(batch.sampling)}
            constrained = [row[req_id] for req_id in out.grammar_req_ids]
            tokens, logprobs = self.sampler.verify(
                logits, batch.sampling, batch.drafts, constrained, out.grammar_bitmask
            )
            result.req_ids = list(row)
            result.sampled_token_ids, result.logprobs = tokens, logprobs
        # Counted only now: a step that failed computes them again when its requests rerun.
        for req_id, lps in result.prompt_logprobs.items():
            self.requests[req_id].num_prompt_logprobs += len(lps)
        return result

    def _prompt_logprobs(
        self, hidden: Tensor, targets: list[tuple[CachedRequestState, int, int]]
    ) -> dict[str, list[TokenLogprob | None]]:
        """Each target's logprob, by request in position order. The LM head runs on a slice of
        rows at a time: a whole chunk's logits at once would be chunk x vocabulary floats
        (100 MB for 512 x 49152)."""
        found: dict[str, list[TokenLogprob | None]] = {}
        for s in range(0, len(targets), _PROMPT_LOGITS_ROWS):
            part = targets[s : s + _PROMPT_LOGITS_ROWS]
            logits = self.model.logits(hidden[self._tensor([i for _, i, _ in part])])
            tokens = self._tensor([t for _, _, t in part])
            top_n = [state.params.prompt_logprobs for state, _, _ in part]
            for (state, _, _), lp in zip(part, token_logprobs(logits, tokens, top_n), strict=True):
                found.setdefault(state.req_id, []).append(lp)
        return found

    def _pool(
        self, hidden: Tensor, chunks: list[tuple[CachedRequestState, int, int, int, bool]]
    ) -> dict[str, Tensor]:
        """Add each pooling request's chunk to its pool; the finished prompts' vectors."""
        for req, row, n, start, _ in chunks:
            self.pooler.add_chunk(req.pool, hidden[row : row + n], start)
        done = [req for req, *_, finished in chunks if finished]
        if not done:
            return {}
        vectors = self.pooler.finish([req.pool for req in done])
        return {req.req_id: v for req, v in zip(done, vectors, strict=True)}

    def update_states(self, out: SchedulerOutput) -> None:
        """Forget the finished requests, record the new ones, and write what the scheduled ones
        lacked where it goes."""
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.new_requests:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                len(new.prompt_token_ids),
                new.params,
                torch.Generator().manual_seed(new.seed),
                list(new.prompt_token_ids),
                list(new.block_ids),
                pool=None
                if new.pooling is None
                else PoolState(new.pooling, len(new.prompt_token_ids)),
            )
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            state.token_ids[cached.token_offset :] = cached.new_token_ids
            state.block_ids[cached.block_offset :] = cached.new_block_ids

    def prepare_inputs(self, out: SchedulerOutput) -> StepBatch:
        """The flat batch and the metadata every layer reads, built once per step (after
        taking the message's news into the requests' states)."""
        self.update_states(out)
        scheduled = out.num_scheduled_tokens.items()
        rows = sorted(scheduled, key=lambda rn: rn[1] != 1)  # decodes first, order kept
        bs = self.block_size
        ids, positions, slots, tables, seq_lens, query_lens = [], [], [], [], [], []
        sampling, drafts, last, prompt_targets, pool_chunks = [], [], [], [], []
        for req_id, n in rows:
            req = self.requests[req_id]
            start = out.num_computed_tokens[req_id]
            end = start + n
            draft = out.spec_token_ids.get(req_id, [])
            if req.params.prompt_logprobs is not None:
                # Position p's logits give prompt token p + 1's logprob; those a recompute
                # after preemption already has are not computed again.
                first = max(start, req.num_prompt_logprobs - 1)
                for p in range(first, min(end, req.num_prompt_tokens - 1)):
                    prompt_targets.append((req, len(ids) + p - start, req.token_ids[p + 1]))
            if req.pool is not None:  # pooled at the end of its prompt, never sampled
                pool_chunks.append((req, len(ids), n, start, end >= len(req.token_ids)))
            ids += req.token_ids[start:end] + draft
            positions += range(start, end)
            blocks = req.block_ids
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(blocks)
            seq_lens.append(end)
            query_lens.append(n)
            if end >= len(req.token_ids) and req.pool is None:
                sampling.append(req)
                drafts.append(draft)
                last += range(len(ids) - 1 - len(draft), len(ids))
        width = max(len(t) for t in tables)
        padded = [t + [self.scratch] * (width - len(t)) for t in tables]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(padded),
            seq_lens=self._tensor(seq_lens),
            query_start_loc=self._tensor(list(itertools.accumulate(query_lens, initial=0))),
            num_decodes=sum(1 for n in query_lens if n == 1),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        return StepBatch(
            rows=rows,
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            ctx=ForwardContext(meta, self.backend, self.kv_caches),
            sampling=sampling,
            drafts=drafts,
            logits_indices=self._tensor(last),
            prompt_targets=prompt_targets,
            pool_chunks=pool_chunks,
        )

    def _tensor(self, values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
