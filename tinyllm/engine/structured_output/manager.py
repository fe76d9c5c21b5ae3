"""The engine's structured output: the grammar compiler, and for each step the masks of the
constrained requests that sample and, once they have, their grammars advanced (vLLM's
StructuredOutputManager).

A request's matcher is compiled when it is added (grammar.py), before anything is queued. The
masks go to the sampler in the step's message (engine/step_message.py); the scheduler advances
the matchers with the tokens sampled (sched/scheduler.py `update_from_output`).
"""

from collections.abc import Mapping

from llguidance import LLMatcher

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.request import Request
from tinyllm.engine.step_message import ModelRunnerOutput, SchedulerOutput
from tinyllm.engine.structured_output.grammar import GrammarMasks, StructuredOutputCompiler
from tinyllm.text.tokenizer import Tokenizer


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.compiler = StructuredOutputCompiler(tokenizer, vocab_size)
        self.masks = GrammarMasks()

    def matcher(self, params: SamplingParams) -> LLMatcher | None:
        """A fresh matcher for the request's grammar, None if it has none; ValueError if the
        grammar does not compile."""
        so = params.structured_outputs
        return None if so is None else self.compiler.matcher(so)

    def matchers(self, params: SamplingParams) -> list[LLMatcher | None]:
        """One matcher per completion (n of them): compiled once, since each completion goes
        through the grammar on its own, the others get copies."""
        matcher = self.matcher(params)
        copies = [None if matcher is None else matcher.deep_copy() for _ in range(params.n - 1)]
        return [matcher, *copies]

    def grammar_bitmask(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The masks of the constrained requests that sample this step, into its message."""
        constrained = []
        for req_id, n in out.num_scheduled_tokens.items():
            request = requests[req_id]
            samples = out.num_computed_tokens[req_id] + n >= request.num_tokens
            if request.matcher is not None and samples:
                constrained.append(request)
        if constrained:
            matchers = [r.matcher for r in constrained]
            out.grammar_req_ids = [r.request_id for r in constrained]
            out.grammar_bitmask = self.masks.fill(matchers, self.vocab_size)

    def advance(
        self, out: SchedulerOutput, result: ModelRunnerOutput, requests: Mapping[str, Request]
    ) -> None:
        """Each constrained request's matcher past the token it sampled (no drafts: one each)."""
        if not out.grammar_req_ids:
            return
        tokens = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
        matchers = [requests[r].matcher for r in out.grammar_req_ids]
        self.masks.advance(matchers, [tokens[r][0] for r in out.grammar_req_ids])
