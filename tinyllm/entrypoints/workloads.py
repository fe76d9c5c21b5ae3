"""The named benchmark workloads (the table in the engineering notes), as token-id requests.

Prompts are random token ids in [100, vocab - 100), so no tokenizer is involved and the low and
high ids (special tokens in most vocabularies) never appear; except `grounded`'s, which are
chat requests over the standard library's text (tinyllm.entrypoints.grounded), rendered with
the model's chat template. Every run of the same workload and seed produces the same requests,
so numbers from different engines are comparable.
"""

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyllm.entrypoints.grounded import grounded_conversations

if TYPE_CHECKING:
    from tinyllm.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range of each request's own prompt tokens
    output_len: tuple[int, int]  # inclusive range of generated tokens (EOS ignored)
    shared_prefix: int = 0  # tokens every prompt starts with
    # > 1: a chat replay. num_requests conversations of this many turns; a turn's prompt is the
    # conversation so far (every earlier prompt and answer) plus its own new tokens, so it
    # can only be sent once the previous turn's answer is in.
    turns: int = 1
    max_concurrency: int | None = None  # requests in flight at once (None: all)

    def summary(self) -> str:
        def length(lo: int, hi: int) -> str:
            return str(lo) if lo == hi else f"U[{lo}, {hi}]"

        n = self.num_requests
        if self.turns > 1:
            return (
                f"{n} conversations x {self.turns} turns, each resending its history plus "
                f"{length(*self.prompt_len)} new tokens, output {length(*self.output_len)}"
            )
        prefix = f"{self.shared_prefix} shared + " if self.shared_prefix else ""
        return (
            f"{n} request{'s' if n > 1 else ''}, prompt {prefix}{length(*self.prompt_len)} "
            f"tokens, output {length(*self.output_len)}"
        )


@dataclass(frozen=True)
class GroundedWorkload:
    """Edit, extract and quote tasks over the standard library's source and docstrings, as chat
    requests, each ending at EOS: text the answer copies, so what prompt lookup speculation
    sees is what a user's would. Run one at a time by default: a single stream."""

    num_requests: int
    max_tokens: int  # each request's cap; it normally ends at EOS before it
    max_concurrency: int | None = 1
    turns: int = 1

    def summary(self) -> str:
        at_once = "one at a time" if self.max_concurrency == 1 else "all at once"
        return (
            f"{self.num_requests} chat requests editing, extracting from and quoting the "
            f"standard library's source, {at_once}, each to EOS (at most {self.max_tokens} "
            "tokens)"
        )


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True  # False: the request ends at EOS, max_tokens is only its cap


WORKLOADS: dict[str, Workload | GroundedWorkload] = {
    "offline": Workload(64, (32, 512), (16, 256)),
    "offline-small": Workload(16, (32, 256), (16, 128)),
    "shared-prefix": Workload(64, (16, 64), (16, 64), shared_prefix=512),
    "single": Workload(1, (128, 128), (256, 256)),
    "multi-turn": Workload(8, (32, 64), (32, 32), turns=10),
    "serve": Workload(200, (32, 512), (16, 256)),
    "grounded": GroundedWorkload(8, 384),
}
# Run in-process by `tinyllm bench NAME`; `serve` is sent to a server by `tinyllm bench serve`.
OFFLINE_WORKLOADS = (
    "offline",
    "offline-small",
    "shared-prefix",
    "single",
    "multi-turn",
    "grounded",
)

# `tinyllm bench WORKLOAD --structured json`: every output is JSON under this schema, a list of
# at least 64 records (over 1000 tokens), so that every request makes its whole output length,
# as the unconstrained run does, and the two runs do the same work.
_RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]}, "maxItems": 3},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "score", "active"],
    "additionalProperties": False,
}
STRUCTURED_SCHEMAS = {
    "json": {
        "type": "object",
        "properties": {"records": {"type": "array", "items": _RECORD, "minItems": 64}},
        "required": ["records"],
        "additionalProperties": False,
    }
}


def check_workload(
    name: str, num_requests: int | None = None, max_concurrency: int | None = None
) -> None:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"--num-requests={num_requests} must be >= 1")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency={max_concurrency} must be >= 1")


def make_requests(
    name: str,
    vocab_size: int,
    seed: int = 0,
    num_requests: int | None = None,
    tokenizer: "Tokenizer | None" = None,
) -> list[Request]:
    """The workload's requests; `num_requests` keeps the first n of them (a scaled-down run, or
    for `grounded` a larger one). A chat replay's are its turns' new tokens, conversation after
    conversation, and `num_requests` keeps the first n conversations. `grounded`'s prompts are
    text: they need the model's `tokenizer`."""
    check_workload(name, num_requests)
    w = WORKLOADS[name]
    if isinstance(w, GroundedWorkload):
        if tokenizer is None:
            raise ValueError(f"the {name} workload's prompts are text: give the model's tokenizer")
        conversations = grounded_conversations(seed, num_requests or w.num_requests)
        return [
            Request(tokenizer.encode_chat(c)[1], w.max_tokens, ignore_eos=False)
            for c in conversations
        ]
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size - 100) for _ in range(n)]

    prefix = tokens(w.shared_prefix)
    requests = []
    for _ in range(w.num_requests * w.turns):
        n_prompt, n_out = rng.randint(*w.prompt_len), rng.randint(*w.output_len)
        requests.append(Request(prefix + tokens(n_prompt), n_out))
    return requests[: None if num_requests is None else num_requests * w.turns]
