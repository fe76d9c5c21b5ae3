"""What add_request checks before it queues anything, apart from the engine.

The limits are copied out of the engine and the grammar compiler is thread-safe (a cache of
compiled grammars, no part of a step), so the server checks a request on its HTTP side while
the engine thread steps, and answers a bad one before the engine sees it.
"""

from dataclasses import dataclass

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.grammar import StructuredOutputCompiler
from tinyllm.engine.validation import check_token_ids


@dataclass(frozen=True)
class RequestValidator:
    max_model_len: int  # the longest prompt plus output
    context_is: str  # what set max_model_len, for the message that refuses a prompt
    vocab_size: int
    grammars: StructuredOutputCompiler

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem with the prompt's length or ids, or the ids in
        `params`."""
        n, limit = len(prompt_token_ids), self.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= limit:
            raise ValueError(
                f"prompt is {n} tokens, but this model's context is {limit} tokens "
                f"({self.context_is}; the prompt must leave room for a generated token)"
            )
        vocab = self.vocab_size
        check_token_ids("prompt", prompt_token_ids, vocab)
        # SamplingParams checked their types; only the model knows the vocabulary.
        check_token_ids("SamplingParams.stop_token_ids", params.stop_token_ids, vocab)
        check_token_ids("SamplingParams.logit_bias", list(params.logit_bias), vocab)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """`check_prompt`, and a ValueError naming the field if the structured output does
        not compile (compiled here, it is cached for the engine's add_request)."""
        self.check_prompt(prompt_token_ids, params)
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)
