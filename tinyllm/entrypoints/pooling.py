"""Embeddings and relevance scores from a pooling engine: vLLM's output shapes for LLM.embed and
LLM.score, and what both they and the server's routes share: the (query, document) pairs as
prompts, and scores from the pooled vectors.

A reranker scores a pair in one pass: a cross-encoder (a classifier head) reads the pair as
its tokenizer joins two texts; a decoder scored by classifier tokens (Qwen3-Reranker) reads it
in Qwen3-Reranker's prompt. An embedding model scores a pair by the cosine similarity of the
two embeddings.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.pooling_params import PoolingParams, PoolingSpec
from tinyllm.text.tokenizer import Tokenizer

# Qwen3-Reranker's prompt, from its model card: the instruction, query and document in a chat
# that the model answers with "yes" or "no".
_QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
_QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def pooled(out: RequestOutput) -> torch.Tensor:
    """A finished pooling request's vector; RuntimeError if the engine failed it."""
    if out.pooled is None:
        raise RuntimeError(f"request {out.request_id} failed: {out.error or out.finish_reason}")
    return out.pooled


def qwen3_reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    body = (
        f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
        f"<Document>: {document}"
    )
    return _QWEN3_RERANKER_PREFIX + body + _QWEN3_RERANKER_SUFFIX


@dataclass
class ScorePlan:
    """The pooling requests that score a list of (query, document) pairs, and how their
    vectors become the pairs' scores."""

    prompts: list[tuple[str | None, list[int]]]  # (text, token ids)
    params: PoolingParams
    # Each prompt's text in the pairs, as (pair, side: 0 the first text, 1 the second), to
    # name it in an error; a reranker's prompt of a whole pair is its second text's.
    sources: list[tuple[int, int]]
    # For an embedding model: each pair's two prompts (each distinct text is embedded once).
    embedded_pairs: list[tuple[int, int]] | None = None

    def scores(self, vectors: list[torch.Tensor]) -> list[float]:
        if self.embedded_pairs is None:  # a reranker: the (last) label's probability
            return [v[-1].item() for v in vectors]
        return [
            F.cosine_similarity(vectors[a], vectors[b], dim=0).item()
            for a, b in self.embedded_pairs
        ]


def plan_scores(
    tokenizer: Tokenizer,
    spec: PoolingSpec,
    texts: list[tuple[str, str]],
    instruction: str | None = None,
    truncate_prompt_tokens: int | None = None,
) -> ScorePlan:
    """How `spec`'s model scores the pairs: a reranker reads each pair in one prompt
    (Qwen3-Reranker's format with classifier tokens, else the tokenizer's pair of texts);
    an embedding model embeds each text. ValueError for text the tokenizer refuses."""
    if spec.scorer is None:
        first: dict[str, tuple[int, int]] = {}  # each distinct text's first place
        for i, pair in enumerate(texts):
            for side, t in enumerate(pair):
                first.setdefault(t, (i, side))
        index = {t: i for i, t in enumerate(first)}
        prompts = [(t, tokenizer.encode(t)) for t in first]
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        embedded = [(index[a], index[b]) for a, b in texts]
        return ScorePlan(prompts, params, list(first.values()), embedded)
    if spec.scorer == "tokens":
        prompts = [tokenizer.encode(qwen3_reranker_prompt(a, b, instruction)) for a, b in texts]
    else:
        prompts = [tokenizer.backend.encode(a, b).ids for a, b in texts]
    params = PoolingParams("score", truncate_prompt_tokens=truncate_prompt_tokens)
    return ScorePlan([(None, ids) for ids in prompts], params, [(i, 1) for i in range(len(texts))])


def pairs(data_1: str | list[str], data_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's score pairs: one text against each of the others, or the two lists pairwise."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("score: give at least one text on each side")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"score: {len(first)} texts against {len(second)}: give one text, or lists of the "
            "same length (scored pairwise)"
        )
    return list(zip(first, second, strict=True))
