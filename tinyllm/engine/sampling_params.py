"""Per-request sampling settings, in the convention vLLM users know."""

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.engine.validation import is_int, is_real, kind_of, show

# Below this a temperature means greedy: dividing logits by it would overflow (vLLM's value).
_SAMPLING_EPS = 1e-5

# The most a logit_bias entry may add or take away: OpenAI's limit, and the server's through
# this class. Past it a bias only breaks the softmax (1e300 is inf in float32).
LOGIT_BIAS_LIMIT = 100


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # each output holds only what is new since the last one
    FINAL_ONLY = 2  # a single output, when the request finishes


class _Rule(NamedTuple):
    type_ok: Callable[[Any], bool]
    value_ok: Callable[[Any], bool]  # asked only once the type is right
    text: str  # what the value must be, as errors say it

    def check(self, where: str, value: object) -> None:
        if not self.type_ok(value):
            raise ValueError(
                f"SamplingParams.{where}={show(value)} must be {self.text}, not {kind_of(value)}"
            )
        if not self.value_ok(value):
            raise ValueError(f"SamplingParams.{where}={show(value)} must be {self.text}")


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _is(*types: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, types)


def _any(v: object) -> bool:
    return True


_RULES = {
    "max_tokens": _Rule(
        _optional(is_int), _optional(lambda v: v >= 1), "an integer >= 1 (or None)"
    ),
    "temperature": _Rule(is_real, lambda v: 0 <= v <= 100, "a number in [0, 100]"),
    "top_k": _Rule(is_int, lambda v: v >= -1, "an integer >= 0 (0 or -1 = off)"),
    "top_p": _Rule(is_real, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": _Rule(is_real, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "seed": _Rule(
        _optional(is_int),
        _optional(lambda v: -(2**63) <= v < 2**63),
        "an integer that fits in 64 bits (or None)",
    ),
    "ignore_eos": _Rule(_is(bool), _any, "True or False"),
    "repetition_penalty": _Rule(is_real, lambda v: 0 < v <= 10, "a number in (0, 10]"),
    "presence_penalty": _Rule(is_real, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": _Rule(is_real, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "logprobs": _Rule(
        _optional(is_int), _optional(lambda v: 0 <= v <= 20), "an integer in [0, 20] (or None)"
    ),
    "prompt_logprobs": _Rule(
        _optional(is_int), _optional(lambda v: 0 <= v <= 20), "an integer in [0, 20] (or None)"
    ),
    "skip_special_tokens": _Rule(_is(bool), _any, "True or False"),
    "n": _Rule(is_int, lambda v: 1 <= v <= 256, "an integer in [1, 256]"),
    "output_kind": _Rule(_is(RequestOutputKind), _any, "a RequestOutputKind"),
    "structured_outputs": _Rule(
        _optional(_is(StructuredOutputsParams)), _any, "a StructuredOutputsParams (or None)"
    ),
}
# The list fields: the rule for the list, then for each of its items.
_IS_LIST = _is(list, tuple, set, frozenset)
_LISTS = {  # field: (the rule for the list, the rule for each item)
    "stop": (
        _Rule(_IS_LIST, _any, "a string or a list of strings"),
        _Rule(_is(str), lambda v: v != "", "a non-empty string"),
    ),
    "stop_token_ids": (
        _Rule(_IS_LIST, _any, "a list of token ids"),
        _Rule(is_int, _any, "a token id (an integer)"),
    ),
}
_DICT = _Rule(_is(dict), _any, "a dict {token id: bias}")
_BIAS_KEY = _Rule(is_int, _any, "a token id (an integer)")
_BIAS = _Rule(
    is_real,
    lambda v: -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT,
    f"a number in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}]",
)


@dataclass
class SamplingParams:
    # None: up to the context length; the engine resolves it to max_model_len - prompt length.
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0 (or below _SAMPLING_EPS) = greedy
    top_k: int = 0  # 0 (or -1) = whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # one stop string may be given as a str
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-n logprobs per generated token (0 = the chosen one only)
    # The same for each prompt token after the first (under the tokens before it): what
    # perplexity and loglikelihood evaluations read. Such a prompt is computed in full, never
    # read from the prefix cache (cached tokens have no logits).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    n: int = 1  # completions per prompt; the engine expands a request into n
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match a JSON schema, regex, choice or grammar (structured_output/params.py).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        """Every field's type and range, checked here once so that nothing wrong reaches the
        engine: a ValueError naming the field, the value and the rule. None for stop,
        stop_token_ids or logit_bias means none, as in vLLM. Whether token ids are in the
        vocabulary only the engine knows (engine/prompt_limits.py)."""
        for name, rule in _RULES.items():
            rule.check(name, getattr(self, name))
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, (list_rule, item_rule) in _LISTS.items():
            items = getattr(self, name)
            items = [] if items is None else items
            list_rule.check(name, items)
            # A copy, like logit_bias's: changing the caller's list later cannot undo a check.
            setattr(self, name, list(items))
            for i, item in enumerate(getattr(self, name)):
                item_rule.check(f"{name}[{i}]", item)
        self.logit_bias = {} if self.logit_bias is None else self.logit_bias
        _DICT.check("logit_bias", self.logit_bias)
        self.logit_bias = dict(self.logit_bias)
        for token_id, bias in self.logit_bias.items():
            _BIAS_KEY.check("logit_bias key", token_id)
            _BIAS.check(f"logit_bias[{show(token_id)}]", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
