"""The engine: add requests any time, call step() until they finish.

One step: the scheduler decides how many tokens each request runs (decodes and prefill chunks
under one token budget, every block allocated and every preemption decided up front) and says
so in a message of data (engine/step_message.py); the model runner runs it as one flat batch
and samples for the requests whose tokens are all computed; the output processor turns the new
tokens into text and outputs. Under tensor parallelism the same message goes to every rank's
runner (engine/worker/transport.py, engine/worker/tp_worker.py) and rank 0's samples.
"""

import dataclasses
import itertools
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from llguidance import LLMatcher

from tinyllm.engine.config import EngineConfig
from tinyllm.engine.output_processor import OutputProcessor, TokenUpdate
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.parent_request import ParentRequest, child_params
from tinyllm.engine.prompt_limits import PromptLimits
from tinyllm.engine.request_validator import RequestValidator
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request, RequestStatus
from tinyllm.engine.sched.scheduler import Scheduler
from tinyllm.engine.spec_decode.speculator import SpecStats, Speculator
from tinyllm.engine.step_message import ModelRunnerOutput, SchedulerOutput
from tinyllm.engine.structured_output.grammar import (
    GrammarMasks,
    GrammarStats,
    StructuredOutputCompiler,
)
from tinyllm.engine.worker.model_runner import RunnerSpec, kv_bytes_per_token
from tinyllm.host.memory import available_bytes
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer
from tinyllm.model.quant import describe_weights
from tinyllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch.distributed's import is for tensor-parallel runs only
    from tinyllm.engine.worker.transport import WorkerGroup

log = logging.getLogger("tinyllm")

T = TypeVar("T")


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
    spec_decode: SpecStats  # drafts verified and tokens accepted (zero without speculation)


def build_kv_cache_manager(model: Transformer, cfg: EngineConfig, max_len: int) -> KVCacheManager:
    """The paged pool, or the slot baseline: the same manager with blocks of max_len tokens.

    `num_blocks` when given; else the fewest blocks of what `kv_cache_memory` holds, what
    `max_num_seqs` requests of `max_len` tokens could ever use, and half the memory still
    available on the device. The pool's pages are touched only as blocks are written, so a
    large pool costs nothing up front, but one larger than the machine can back would fail
    as it fills; the other half is left for activations and whatever else the machine runs."""
    per_token = kv_bytes_per_token(model)
    block_size = max_len if cfg.kv_cache == "slot" else cfg.block_size
    unit = per_token * block_size
    if cfg.num_blocks is None and cfg.kv_cache_memory < unit:
        what = f"one slot of {max_len} tokens" if cfg.kv_cache == "slot" else "one block"
        raise ValueError(
            f"kv_cache_memory={cfg.kv_cache_memory} bytes cannot hold {what} ({unit} bytes); "
            "raise kv_cache_memory or lower max_model_len"
        )
    limits = {}  # why -> blocks; the first of the smallest wins, so a setting given beats a tie
    if cfg.num_blocks is not None:
        limits["num_blocks"] = cfg.num_blocks
    else:
        limits[f"kv_cache_memory {cfg.kv_cache_memory / 2**20:.0f} MiB"] = (
            cfg.kv_cache_memory // unit
        )
    if cfg.num_blocks is None or cfg.kv_cache == "slot":
        seqs = f"max_num_seqs {cfg.max_num_seqs} x max_model_len {max_len}"
        limits[seqs] = cfg.max_num_seqs * -(-max_len // block_size)
    available = available_bytes(model.device) if cfg.num_blocks is None else None
    if available is not None:
        limits[f"half the {available / 2**20:.0f} MiB available"] = available // 2 // unit
    reason, num_blocks = min(limits.items(), key=lambda item: item[1])
    if num_blocks < 1:
        raise ValueError(
            f"{available} bytes of memory are available: half of it cannot hold one KV block "
            f"({unit} bytes); free memory, or set num_blocks to size the cache yourself"
        )
    tokens = num_blocks * block_size
    log.info(
        "%s KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, limited by %s)",
        cfg.kv_cache,
        num_blocks,
        block_size,
        tokens,
        tokens * per_token / 2**20,
        reason,
    )
    if tokens < max_len:
        log.warning(
            "the KV cache holds %d tokens, fewer than the context (%d): max_model_len is cut to "
            "%d, so a request finishes with 'length' there and a longer prompt is refused; "
            "raise num_blocks/kv_cache_memory to lift it",
            tokens,
            max_len,
            tokens,
        )
    caching = cfg.enable_prefix_caching and cfg.kv_cache == "paged"
    return KVCacheManager(num_blocks, block_size, caching, extra_key=cache_key(model))


def cache_key(model: Transformer) -> str:
    """What besides its tokens sets a block's K/V: the architecture, weight format and dtype."""
    return f"{model.config!r} {describe_weights(model)}"


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        config: EngineConfig,
        workers: "WorkerGroup | None" = None,
    ):
        """`workers`: under tensor parallelism, the other ranks (`model` is rank 0's part);
        the engine closes them (`close`)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = min(
            config.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
        )
        self.kv = build_kv_cache_manager(model, config, self.max_model_len)
        # A request never outgrows the pool: it finishes with "length" where the pool ends,
        # keeping what it generated, and a longer prompt is refused before it runs.
        self._context_is = "max_model_len"
        if self.kv.capacity_tokens < self.max_model_len:
            self.max_model_len = self.kv.capacity_tokens
            self._context_is = "max_model_len, cut to what the KV cache holds"
        runner_spec = RunnerSpec(
            self.kv.num_blocks, self.kv.block_size, config.attention_backend, config.layer_executor
        )
        self.runner = runner_spec.build(model)
        self.workers = workers
        if workers is not None:
            workers.broadcast(runner_spec)
        # Why the engine cannot run another step (a tensor-parallel rank died or the ranks went
        # out of step); None while it can.
        self.dead: str | None = None
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(tokenizer)
        self.grammars = StructuredOutputCompiler(tokenizer, model.config.vocab_size)
        self.grammar_masks = GrammarMasks()
        spec = config.speculative_config
        self.speculator = None if spec is None else Speculator(spec, self.max_model_len)
        if spec is not None:
            log.info(
                "speculative decoding: %s, up to %d draft tokens from n-grams of %d-%d tokens, "
                "while at most %d requests decode",
                spec.method,
                spec.num_speculative_tokens,
                spec.prompt_lookup_min,
                spec.prompt_lookup_max,
                spec.max_batch,
            )
        self.requests: dict[str, Request] = {}
        # n > 1: the parent by its id and by each child's
        self.parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.prompt_tokens = self.generation_tokens = self.recomputed_tokens = 0

    # -- API ------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem if the request cannot run: the prompt's length and
        ids, the ids in `params`, a structured output that does not compile."""
        self._check_prompt(prompt_token_ids, params)
        self._matcher(params)

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.request_validator().limits.check(prompt_token_ids, params)

    def _matcher(self, params: SamplingParams) -> LLMatcher | None:
        so = params.structured_outputs
        return None if so is None else self.grammars.matcher(so)

    def add_request(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        """Queue a request (n > 1: n requests reported as one); a text prompt is tokenized
        unless its token ids are given. Raises, with nothing queued, if anything is invalid."""
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
        if text and not ids:  # the tokenizer drops characters its vocabulary lacks
            raise ValueError(
                f"the prompt {text[:40]!r} is no tokens: this model's vocabulary has none of "
                "its characters; give at least one token"
            )
        self._check_prompt(ids, params)
        matcher = self._matcher(params)  # compiled once; each of n completions gets a copy
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if self._id_free(i, params.n))
        elif not self._id_free(request_id, params.n):
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        if params.n == 1:
            self._register([self._request(request_id, ids, params, matcher)], text)
            return request_id
        parent = ParentRequest(request_id, _child_ids(request_id, params.n), params.output_kind)
        # Each completion goes through the grammar on its own.
        matchers = [matcher] * params.n
        if matcher is not None:
            matchers[1:] = [matcher.deep_copy() for _ in range(params.n - 1)]
        children = [
            self._request(child, ids, one, m)
            for child, one, m in zip(parent.child_ids, child_params(params), matchers, strict=True)
        ]
        self._register(children, text)
        self.parents[request_id] = parent
        self._parent_of.update(dict.fromkeys(parent.child_ids, parent))
        return request_id

    def _id_free(self, request_id: str, n: int) -> bool:
        ids = [request_id, *(_child_ids(request_id, n) if n > 1 else [])]
        return not any(i in self.requests or i in self.parents for i in ids)

    def _request(
        self, request_id: str, ids: list[int], params: SamplingParams, matcher: LLMatcher | None
    ) -> Request:
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        seed = self._rng.getrandbits(63)
        eos = self.tokenizer.eos_token_ids
        return Request(request_id, ids, params, max_tokens, eos, seed, matcher)

    def _register(self, requests: list[Request], text: str | None) -> None:
        for request in requests:
            self.requests[request.request_id] = request
            self.output_processor.add_request(
                request.request_id, text, request.prompt_token_ids, request.params
            )
            self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all its completions) and free its blocks; its final output, or
        None if unknown."""
        parent = self.parents.get(request_id)
        ids = parent.child_ids if parent is not None else [request_id]
        outputs = []
        for child in ids:
            request = self.requests.get(child)
            if request is not None:
                outputs += self._finish(request, TokenUpdate(child, [], [], "abort"))
        outputs = self._gather(outputs)
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
            spec_decode=dataclasses.replace(self.speculator.stats)
            if self.speculator
            else SpecStats(),
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, e.g. after changing the weights; how many."""
        return self.kv.reset_prefix_cache()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at exit)."""
        if self.workers is not None:
            self.workers.close()

    # -- what the entrypoints see ---------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The logits' width: every token id is below it."""
        return self.model.config.vocab_size

    @property
    def model_config(self) -> ModelConfig:
        """The loaded model's architecture: layers, heads, sizes, vocabulary."""
        return self.model.config

    @property
    def max_num_batched_tokens(self) -> int:
        """The most tokens one step runs: a longer prompt takes several steps to prefill."""
        return self.config.max_num_batched_tokens

    @property
    def alive(self) -> bool:
        """False once the engine cannot run another step (a tensor-parallel rank died, or the
        ranks went out of step); step() then raises, saying why."""
        return self.dead is None

    def request_validator(self) -> RequestValidator:
        """The checks add_request makes, as an object any thread may call while the engine
        steps (its limits are copies, its grammar compiler is thread-safe)."""
        limits = PromptLimits(self.max_model_len, self.vocab_size, self._context_is)
        return RequestValidator(limits, self.grammars)

    def outputs(self) -> Iterator[list[RequestOutput]]:
        """Step while any request is unfinished, yielding each step's outputs. Requests added
        or aborted between two steps are part of the run; it ends once none is left."""
        while self.has_unfinished():
            yield self.step()

    def num_computed_tokens(self, request_id: str) -> int | None:
        """How many of a request's tokens (its prompt first) the model has run: a long
        prompt's prefill progress. None once it has finished (or for an unknown id)."""
        request = self.requests.get(request_id)
        return None if request is None else request.num_computed_tokens

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request; their final outputs."""
        outputs = [self.abort(request_id) for request_id in [*self.parents, *self.requests]]
        return [out for out in outputs if out is not None]  # a parent's children went with it

    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding's drafts and accepted tokens so far; None when it is off."""
        return None if self.speculator is None else self.stats().spec_decode

    def grammar_stats(self) -> GrammarStats:
        """What constrained decoding has cost so far (a copy)."""
        return dataclasses.replace(self.grammar_masks.stats)

    def with_config(self, **changes: object) -> "LLMEngine":
        """A fresh engine over this one's model and tensor-parallel workers, its config with
        `changes`: its own KV cache, no requests, counters at zero. The workers build a fresh
        runner for it, so this engine must not step again."""
        config = dataclasses.replace(self.config, **changes)
        return LLMEngine(self.model, self.tokenizer, config, self.workers)

    def apply_model(self, fn: Callable[[Transformer], T]) -> T:
        """`fn(model)`, for measurements of the loaded weights (their bytes, their format,
        the device). Under tensor parallelism, rank 0's part. `fn` must not change the model."""
        return fn(self.model)

    # -- one step -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.dead is not None:
            raise RuntimeError(f"the engine cannot run: {self.dead}")
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        outputs = []
        for request in map(self.requests.get, out.rejected_req_ids):
            error = (
                f"request needs {request.num_tokens + 1} tokens of KV cache but the whole cache "
                f"holds {self.kv.capacity_tokens} (max_model_len {self.max_model_len})"
            )
            update = TokenUpdate(request.request_id, [], [], "error", error=error)
            outputs += self._finish(request, update)
        if out.num_scheduled_tokens:
            self._mask_grammars(out)
            outputs += self._run(out)
        return self._gather(outputs)

    def _mask_grammars(self, out: SchedulerOutput) -> None:
        """The masks of the constrained requests that sample this step, into its message."""
        constrained = []
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            samples = out.num_computed_tokens[req_id] + n >= request.num_tokens
            if request.matcher is not None and samples:
                constrained.append(request)
        if constrained:
            matchers = [r.matcher for r in constrained]
            out.grammar_req_ids = [r.request_id for r in constrained]
            out.grammar_bitmask = self.grammar_masks.fill(matchers, self.model.config.vocab_size)

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Run the step's batch; if it fails, run each request alone, so an error ends only
        the requests it concerns (with an error output), and the others go on."""
        try:
            result = self._execute(out)
        except Exception:
            if self.dead is not None:
                raise
            if len(out.num_scheduled_tokens) == 1:
                [req_id] = out.num_scheduled_tokens
                log.exception("request %s failed in a step", req_id)
                error = "the engine failed on this request (see the server log)"
                update = TokenUpdate(req_id, [], [], "error", error=error)
                return self._finish(self.requests[req_id], update)
            return [o for req_id in out.num_scheduled_tokens for o in self._run(out.only(req_id))]
        return self._update_from_output(out, result)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.workers is None:
            return self.runner.execute_model(out)
        # Rank 0 builds its batch first: a failure there stops the step before any rank starts.
        batch = self.runner.prepare_inputs(out)
        try:
            return self.workers.execute(out, lambda msg: self.runner.execute_batch(batch, msg))
        except Exception as e:
            # Some ranks may be inside a collective that the others left: no later step could
            # be trusted to pair them up again.
            self.dead = f"a tensor-parallel step failed ({type(e).__name__}: {e})"
            raise

    def _update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """The bookkeeping after a step, all of it: computed tokens (rolling back rejected
        drafts), prompt logprobs, grammars, tokens appended, finishes, outputs."""
        sampled = [
            (self.requests[req_id], tokens, logprobs)
            for req_id, tokens, logprobs in zip(
                result.req_ids, result.sampled_token_ids, result.logprobs, strict=True
            )
        ]
        # Draft tokens the model rejected are rolled back: their K/V stays in the blocks, to
        # be overwritten by the tokens that really come there.
        rejected = {req: len(req.spec_token_ids) + 1 - len(tokens) for req, tokens, _ in sampled}
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            n -= rejected.get(request, 0)
            self._count(request, n)
            request.num_computed_tokens += n
            if req_id in result.prompt_logprobs:
                request.prompt_logprobs += result.prompt_logprobs[req_id]
        if out.grammar_req_ids:  # no drafts: one token each
            tokens = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
            matchers = [self.requests[r].matcher for r in out.grammar_req_ids]
            self.grammar_masks.advance(matchers, [tokens[r][0] for r in out.grammar_req_ids])
        updates, done = [], []
        for request, tokens, logprobs in sampled:
            if request.spec_token_ids:  # only the speculator sets them
                self.speculator.record(len(request.spec_token_ids), len(tokens) - 1)
                request.spec_token_ids = []
            # A stop token or the length limit inside an accepted run ends it there.
            kept = 0
            while kept < len(tokens) and request.finish_reason is None:
                request.append_token(tokens[kept], self.max_model_len)
                kept += 1
            reason = request.finish_reason
            update = TokenUpdate(
                request.request_id,
                tokens[:kept],
                logprobs[:kept],
                reason,
                request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
                # Complete once the prompt is: with its first sampled token.
                prompt_logprobs=request.prompt_logprobs
                if request.num_output_tokens == kept
                else None,
            )
            updates.append(update)
            self.generation_tokens += kept
            if reason is not None:
                done.append(request)
        step_outputs, stopped = self.output_processor.process(updates)
        for request in done:
            self._release(request)
        for request_id in stopped:  # a stop string: the output processor has reported it
            request = self.requests.get(request_id)
            if request is not None:
                request.finish_reason = "stop"
                self._release(request)
        return step_outputs

    def _gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs become their parent's: one output per parent, where its first
        child's was."""
        by_parent: dict[ParentRequest, list[RequestOutput]] = {}
        order: list[RequestOutput | ParentRequest] = []
        for out in outputs:
            parent = self._parent_of.get(out.request_id)
            if parent is None:
                order.append(out)
                continue
            if parent not in by_parent:
                order.append(parent)
            by_parent.setdefault(parent, []).append(out)
        result = []
        for item in order:
            if isinstance(item, RequestOutput):
                result.append(item)
                continue
            merged = item.merge(by_parent[item])
            if item.finished:
                del self.parents[item.request_id]
                for child in item.child_ids:
                    del self._parent_of[child]
            if merged is not None:
                result.append(merged)
        return result

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
        request.matcher = None  # its grammar state can be large; the request may be kept


def _child_ids(request_id: str, n: int) -> list[str]:
    return [f"{request_id}[{i}]" for i in range(n)]
