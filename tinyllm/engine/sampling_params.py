"""Per-request sampling settings, in the convention vLLM users know."""

import enum
from dataclasses import dataclass, field

# Below this a temperature means greedy: dividing logits by it would overflow (vLLM's value).
_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # each output holds only what is new since the last one
    FINAL_ONLY = 2  # a single output, when the request finishes


def _is_int(x: object) -> bool:
    # bool is an int subclass, but max_tokens=True is a mistake, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    # None: up to the context length; the engine resolves it to max_model_len - prompt length.
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0 (or below _SAMPLING_EPS) = greedy
    top_k: int = 0  # 0 (or -1) = whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-n logprobs per generated token (0 = the chosen one only)
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    n: int = 1  # completions per prompt; the engine expands a request into n
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        max_tokens_ok = self.max_tokens is None or (
            _is_int(self.max_tokens) and self.max_tokens >= 1
        )
        checks = [
            ("max_tokens", max_tokens_ok, "must be an integer >= 1 (or None)"),
            ("temperature", 0 <= self.temperature <= 100, "must be in [0, 100]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 or -1 = off)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 10, "must be in (0, 10]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in 64 bits"),
            ("n", _is_int(self.n) and 1 <= self.n <= 256, "must be an integer in [1, 256]"),
            (
                "output_kind",
                isinstance(self.output_kind, RequestOutputKind),
                "must be a RequestOutputKind",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
