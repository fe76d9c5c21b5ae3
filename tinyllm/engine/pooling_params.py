"""Per-request pooling settings (vLLM's PoolingParams) and what a pooling model accepts.

A pooling request runs its prompt only: once the prompt is computed, the runner's pooler
(engine/worker/pooler.py) turns its hidden states into one vector, an embedding (task "embed")
or a relevance score (task "score", a reranker's), and the request finishes with it.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyllm.engine.validation import check_token_ids, is_int, kind_of, show
from tinyllm.model.config import ModelConfig

if TYPE_CHECKING:
    from tinyllm.text.tokenizer import Tokenizer

TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    task: str = "embed"
    # Matryoshka truncation: the embedding's first `dimensions` values (then normalized, when
    # it is). None: all of them.
    dimensions: int | None = None
    normalize: bool | None = None  # L2-normalize the embedding; None: as the model says
    # Keep only the prompt's last k tokens (vLLM's truncation side); None: a longer prompt than
    # the context is an error.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"PoolingParams.task={show(self.task)} must be one of {TASKS}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ValueError(f"PoolingParams.{name} must be an integer, not {kind_of(value)}")
            if value is not None and value < 1:
                raise ValueError(f"PoolingParams.{name}={show(value)} must be >= 1 (or None)")
        if self.normalize not in (None, True, False):
            raise ValueError(f"PoolingParams.normalize={show(self.normalize)} must be a bool")

    def truncate(self, token_ids: list[int]) -> list[int]:
        k = self.truncate_prompt_tokens
        return list(token_ids) if k is None else list(token_ids)[-k:]


@dataclass(frozen=True)
class PoolingSpec:
    """What a pooling model accepts: its pooling, its embedding width, whether it scores, and
    how long a prompt it runs (a non-causal one whole, in one step). Immutable: the server
    checks requests with it on its own threads."""

    pooling: str
    vocab_size: int
    hidden_size: int
    # A reranker's score: "head" (a cross-encoder's classifier), "tokens" (the logits of
    # classifier tokens, Qwen3-Reranker's); None: an embedding model.
    scorer: str | None
    max_model_len: int
    whole_prompt_tokens: int | None  # non-causal: a prompt runs in one step of this budget
    # sentence-transformers' named prompts and the default one's name (ModelConfig's).
    prompts: dict[str, str] = field(default_factory=dict, hash=False)
    default_prompt_name: str | None = None

    def prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text put before each text input, as sentence-transformers' encode picks it:
        `prompt` as given, else the prompt named `prompt_name`, else the default prompt, else
        none (""). ValueError for a name the model's prompts lack."""
        if prompt is not None:
            return prompt
        name = self.default_prompt_name if prompt_name is None else prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            has = f"its prompts are {', '.join(self.prompts)}" if self.prompts else "it has none"
            raise ValueError(
                f"prompt_name={name!r} is not one of this model's prompts ({has}, from "
                "config_sentence_transformers.json)"
            )
        return self.prompts[name]

    def check(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        """ValueError naming the problem if this model cannot run the request."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the input is empty: give at least one token")
        check_token_ids("input", prompt_token_ids, self.vocab_size)
        if n > self.max_model_len:
            raise ValueError(
                f"input is {n} tokens, but this model's context is {self.max_model_len} tokens "
                "(max_model_len); shorten it or set truncate_prompt_tokens"
            )
        budget = self.whole_prompt_tokens
        if budget is not None and n > budget:
            raise ValueError(
                f"input is {n} tokens, but this encoder runs each input whole in one step of at "
                f"most {budget} tokens (max_num_batched_tokens); shorten it, set "
                "truncate_prompt_tokens, or raise max_num_batched_tokens"
            )
        if params.task == "score" and self.scorer is None:
            raise ValueError(
                "this model embeds; it has no relevance score (score task): a reranker has a "
                "classifier head or --classifier-from-token"
            )
        if params.task == "embed" and self.scorer is not None:
            raise ValueError("this model is a reranker: it scores (task 'score'), not embed")
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions={params.dimensions}: this model's embeddings have {self.hidden_size}"
            )


def apply_pooling_options(
    model: ModelConfig,
    pooling: str | None,
    classifier_from_token: str | None,
    tokenizer: "Tokenizer",
) -> tuple[int, ...]:
    """Make `model` a pooling model as the engine's options say (--pooling: that pooling,
    normalized; --classifier-from-token: last-token pooling); the classifier tokens' ids."""
    if pooling is not None:
        model.pooling, model.normalize = pooling, True
    if classifier_from_token is None:
        return ()
    if model.pooling not in (None, "last"):
        raise ValueError(
            f"classifier_from_token scores the last token; this model pools by {model.pooling}"
        )
    model.pooling = "last"
    ids = []
    for token in classifier_from_token.split(","):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"classifier_from_token: {token!r} is not a token of this model's vocabulary"
            )
        ids.append(token_id)
    return tuple(ids)
