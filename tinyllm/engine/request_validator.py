"""What add_request checks before it queues anything, apart from the engine.

The limits are an immutable copy and the grammar compiler is thread-safe (a cache of compiled
grammars, no part of a step), so the server checks a request on its HTTP side while the engine
thread steps, and answers a bad one before the engine sees it.
"""

from dataclasses import dataclass

from tinyllm.engine.pooling_params import PoolingParams, PoolingSpec
from tinyllm.engine.prompt_limits import PromptLimits
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.grammar import StructuredOutputCompiler


@dataclass(frozen=True)
class RequestValidator:
    limits: PromptLimits
    grammars: StructuredOutputCompiler
    pooling: PoolingSpec | None = None  # a pooling model's (the engine's)

    def validate_pooling(self, prompt_token_ids: list[int], params: PoolingParams) -> list[int]:
        """The input as the engine runs it (truncated as `params` say); ValueError naming the
        problem if it cannot run, or if this engine does not pool."""
        if self.pooling is None:
            raise ValueError("this model generates text; it does not embed or score")
        token_ids = params.truncate(prompt_token_ids)
        self.pooling.check(token_ids, params)
        return token_ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem if the request cannot run: the prompt's length and
        ids, the ids in `params`, a structured output that does not compile (compiled here,
        it is cached for the engine's add_request)."""
        if self.pooling is not None:
            raise ValueError(
                f"this model is served as a pooling model ({self.pooling.pooling} pooling): it "
                "embeds or scores inputs and does not generate"
            )
        self.limits.check(prompt_token_ids, params)
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)
