"""What add_request checks before it queues anything, apart from the engine.

The limits are an immutable copy and the grammar compiler is thread-safe (a cache of compiled
grammars, no part of a step), so the server checks a request on its HTTP side while the engine
thread steps, and answers a bad one before the engine sees it.
"""

from dataclasses import dataclass

from tinyllm.engine.prompt_limits import PromptLimits
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.grammar import StructuredOutputCompiler


@dataclass(frozen=True)
class RequestValidator:
    limits: PromptLimits
    grammars: StructuredOutputCompiler

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem if the request cannot run: the prompt's length and
        ids, the ids in `params`, a structured output that does not compile (compiled here,
        it is cached for the engine's add_request)."""
        self.limits.check(prompt_token_ids, params)
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)
