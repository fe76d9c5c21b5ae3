"""The engine: add requests any time, call step() until they finish.

One step: the scheduler decides how many tokens each request runs (decodes and prefill chunks
under one token budget, every block allocated and every preemption decided up front) and says
so in a message of data (engine/step_message.py); the executor runs it on the model runner as
one flat batch, which samples for the requests whose tokens are all computed; the scheduler
books what came back (`update_from_output`); the output processor turns the new tokens into
text and outputs. Under tensor parallelism the same message goes to every rank's runner
(engine/worker/executor.py) and rank 0's samples.

The engine wires these parts together and ends the requests that get no token: aborted,
refused, or failed in a step.
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
from tinyllm.engine.parent_request import ParentRequest, ParentRequests, child_ids
from tinyllm.engine.pooling_params import PoolingParams, PoolingSpec, apply_pooling_options
from tinyllm.engine.prompt_limits import PromptLimits
from tinyllm.engine.request_validator import RequestValidator
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams
from tinyllm.engine.sched.kv_cache_sizing import build_kv_cache_manager
from tinyllm.engine.sched.request import Request
from tinyllm.engine.sched.scheduler import Scheduler
from tinyllm.engine.spec_decode.speculator import SpecStats, Speculator
from tinyllm.engine.structured_output.grammar import GrammarStats
from tinyllm.engine.structured_output.manager import StructuredOutputManager
from tinyllm.engine.worker.executor import Executor
from tinyllm.engine.worker.model_runner import ModelRunner, RunnerSpec
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer
from tinyllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch.distributed's import is for tensor-parallel runs only
    from tinyllm.engine.worker.transport import WorkerGroup

log = logging.getLogger("tinyllm")

_FAILED = "the engine failed on this request (see the server log)"
# A pooling request's SamplingParams: it samples nothing; its one output comes at its end.
_POOLED = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
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
        max_model_len = min(
            config.max_model_len or model.config.max_position_embeddings,
            model.config.max_position_embeddings,
        )
        c = model.config
        classifier_ids = apply_pooling_options(
            c, config.pooling, config.classifier_from_token, tokenizer
        )
        # A pooling model's prompts are not shared: no prefix cache.
        caching = config.enable_prefix_caching and c.pooling is None
        kv_config = dataclasses.replace(config, enable_prefix_caching=caching)
        self.kv = build_kv_cache_manager(model, kv_config, max_model_len)
        # A request never outgrows the pool: it finishes with "length" where the pool ends,
        # keeping what it generated, and a longer prompt is refused before it runs.
        vocab_size = model.config.vocab_size
        if self.kv.capacity_tokens < max_model_len:
            cut = "max_model_len, cut to what the KV cache holds"
            self.limits = PromptLimits(self.kv.capacity_tokens, vocab_size, cut)
        else:
            self.limits = PromptLimits(max_model_len, vocab_size)
        # What a pooling model runs (None: a generation model).
        self.pooling: PoolingSpec | None = None
        if c.pooling is not None:
            self.pooling = PoolingSpec(
                c.pooling,
                vocab_size,
                c.hidden_size,
                scorer="tokens" if classifier_ids else "head" if c.num_labels else None,
                max_model_len=self.limits.max_model_len,
                whole_prompt_tokens=None if c.is_causal else config.max_num_batched_tokens,
                prompts=dict(c.prompts),
                default_prompt_name=c.default_prompt_name,
            )
        runner_spec = RunnerSpec(
            self.kv.num_blocks,
            self.kv.block_size,
            config.attention_backend,
            config.layer_executor,
            config.kv_cache_dtype,
            classifier_ids,
        )
        self.executor = Executor(model, runner_spec, workers)
        self.output_processor = OutputProcessor(tokenizer)
        self.structured_output = StructuredOutputManager(tokenizer, vocab_size)
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
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            structured_output=self.structured_output,
            speculator=self.speculator,
            whole_prompts=not c.is_causal,
        )
        self._parents = ParentRequests()
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)

    # -- what the engine's parts hold ----------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def requests(self) -> dict[str, Request]:
        """Every engine request not finished yet (n > 1: each child), by its id."""
        return self.scheduler.requests

    @property
    def parents(self) -> dict[str, ParentRequest]:
        """The n > 1 requests not finished yet, by their id."""
        return self._parents.by_id

    @property
    def runner(self) -> ModelRunner:
        return self.executor.runner

    @property
    def workers(self) -> "WorkerGroup | None":
        return self.executor.workers

    @property
    def dead(self) -> str | None:
        """Why the engine cannot run another step (a tensor-parallel rank died or the ranks
        went out of step); None while it can."""
        return self.executor.dead

    # -- API ------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        """Queue a request (n > 1: n requests reported as one); a text prompt is tokenized
        unless its token ids are given. Raises, with nothing queued, if anything is invalid.
        PoolingParams on a pooling model: its one output's `pooled` is the embedding or the
        scores."""
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
        if isinstance(params, PoolingParams):
            return self._add_pooling(text, ids, params, request_id)
        if self.pooling is not None:
            raise ValueError(
                f"this model is served as a pooling model ({self.pooling.pooling} pooling): it "
                "embeds or scores inputs and does not generate"
            )
        self.limits.check(ids, params)
        matchers = self.structured_output.matchers(params)
        request_id = self._new_id(request_id, params.n)
        children = self._parents.expand(request_id, params)
        for (child, one), matcher in zip(children, matchers, strict=True):
            request = self._request(child, ids, one, matcher)
            self.output_processor.add_request(child, text, request.prompt_token_ids, one)
            self.scheduler.add(request)
        return request_id

    def _add_pooling(
        self, text: str | None, ids: list[int], params: PoolingParams, request_id: str | None
    ) -> str:
        if self.pooling is None:
            raise ValueError(
                "this model generates; it has no pooling (serve it with --pooling last|mean|cls "
                "for embeddings, or --classifier-from-token for a decoder reranker)"
            )
        ids = params.truncate(ids)
        self.pooling.check(ids, params)
        request_id = self._new_id(request_id, 1)
        request = Request(request_id, ids, _POOLED, 1, [], 0, pooling=params)
        self.output_processor.add_request(request_id, text, ids, _POOLED)
        self.scheduler.add(request)
        return request_id

    def _new_id(self, request_id: str | None, n: int) -> str:
        """`request_id`, or a free one when None; an error if it is in use."""
        if request_id is None:
            return next(i for i in map(str, self._ids) if self._id_free(i, n))
        if not self._id_free(request_id, n):
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        return request_id

    def _id_free(self, request_id: str, n: int) -> bool:
        ids = [request_id, *(child_ids(request_id, n) if n > 1 else [])]
        return not any(i in self.requests or i in self.parents for i in ids)

    def _request(
        self, request_id: str, ids: list[int], params: SamplingParams, matcher: LLMatcher | None
    ) -> Request:
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        seed = self._rng.getrandbits(63)
        eos = self.tokenizer.eos_token_ids
        return Request(request_id, ids, params, max_tokens, eos, seed, matcher)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all its completions) and free its blocks; its final output, or
        None if unknown."""
        ids = [i for i in self._parents.engine_ids(request_id) if i in self.requests]
        outputs = self._parents.gather(self._end(ids, "abort"))
        return outputs[0] if outputs else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        pool, sched = self.kv.pool, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_blocks_used=pool.num_used,
            kv_blocks_total=pool.num_blocks,
            kv_usage=pool.num_used / pool.num_blocks,
            num_preemptions=sched.num_preemptions,
            recomputed_tokens=sched.recomputed_tokens,
            prompt_tokens=sched.prompt_tokens,
            generation_tokens=sched.generation_tokens,
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
        self.executor.close()

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
        return RequestValidator(self.limits, self.structured_output.compiler, self.pooling)

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
        return dataclasses.replace(self.structured_output.masks.stats)

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
        for req_id in out.rejected_req_ids:
            error = (
                f"request needs {self.requests[req_id].num_tokens + 1} tokens of KV cache but "
                f"the whole cache holds {self.kv.capacity_tokens} "
                f"(max_model_len {self.max_model_len})"
            )
            outputs += self._end([req_id], "error", error)
        if out.num_scheduled_tokens:
            self.structured_output.grammar_bitmask(out, self.requests)
            # A step that fails is run again request by request: an error ends only the
            # requests it concerns (with an error output), and the others go on.
            for part, result in self.executor.execute_each(out):
                if result is None:
                    outputs += self._end(list(part.num_scheduled_tokens), "error", _FAILED)
                    continue
                step_outputs, stopped = self.output_processor.process(
                    self.scheduler.update_from_output(part, result)
                )
                # A stop string: the output processor has reported it; the request ends here.
                self.scheduler.finish_requests(stopped, "stop")
                outputs += step_outputs
        return self._parents.gather(outputs)

    def _end(
        self, request_ids: list[str], reason: str, error: str | None = None
    ) -> list[RequestOutput]:
        """End requests that get no new token (aborted, refused, failed): their final outputs."""
        updates = [TokenUpdate(r, [], [], reason, error=error) for r in request_ids]
        self.scheduler.finish_requests(request_ids, reason)
        return self.output_processor.process(updates)[0]
