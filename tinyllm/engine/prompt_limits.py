"""What a request's token ids must fit before it is queued: the context and the vocabulary.

Engine-free and immutable, so any thread may check a request against it; the engine holds one,
made once it knows its context (max_model_len, possibly cut to what the KV cache holds).
"""

from dataclasses import dataclass

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.validation import check_token_ids


@dataclass(frozen=True)
class PromptLimits:
    max_model_len: int
    vocab_size: int
    context_is: str = "max_model_len"  # what set max_model_len, for the error message

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem if the prompt is empty or leaves no room for a
        generated token, or an id in it or in `params` is outside the vocabulary."""
        n, limit = len(prompt_token_ids), self.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= limit:
            raise ValueError(
                f"prompt is {n} tokens, but this model's context is {limit} tokens "
                f"({self.context_is}; the prompt must leave room for a generated token)"
            )
        check_token_ids("prompt", prompt_token_ids, self.vocab_size)
        # SamplingParams checked their types; only the model knows the vocabulary.
        check_token_ids("SamplingParams.stop_token_ids", params.stop_token_ids, self.vocab_size)
        check_token_ids("SamplingParams.logit_bias", list(params.logit_bias), self.vocab_size)
