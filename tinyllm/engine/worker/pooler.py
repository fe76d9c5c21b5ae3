"""The pooler: what a pooling request's prompt becomes instead of a sampled token.

Each chunk of the prompt adds its share as it runs (mean: the sum of its rows; cls: the first
row; last: the last row), kept by the chunk's start, so a step run again after a failure or a
prompt recomputed after preemption (from 0: its shares start over) adds nothing twice. Once the
prompt is done the shares become one hidden-state vector, and that an embedding (Matryoshka
`dimensions`, then L2 normalization) or a reranker's score (its classifier head, or the
probability of the last of its classifier tokens against the others at the last token, as
vLLM scores Qwen3-Reranker with classifier_from_token ["no", "yes"]).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from tinyllm.engine.pooling_params import PoolingParams
from tinyllm.model.llama import Transformer


@dataclass
class PoolState:
    """A pooling request's pool so far, held by the runner."""

    params: PoolingParams
    num_prompt_tokens: int
    parts: dict[int, Tensor] = field(default_factory=dict)  # chunk start -> its share


class Pooler:
    def __init__(self, model: Transformer, classifier_token_ids: tuple[int, ...] = ()):
        self.model, self.kind = model, model.config.pooling
        self.classifier_token_ids = list(classifier_token_ids)

    def add_chunk(self, pool: PoolState, rows: Tensor, start: int) -> None:
        """Take a chunk's hidden states (prompt positions start.., in order)."""
        if start == 0:  # a new prompt, or one recomputed after preemption
            pool.parts.clear()
        if self.kind == "mean":
            pool.parts[start] = rows.float().sum(0)
        elif self.kind == "last":
            pool.parts = {start: rows[-1]}
        elif start == 0:  # cls: the first token's
            pool.parts[0] = rows[0]

    def finish(self, pools: list[PoolState]) -> list[Tensor]:
        """Each finished prompt's embedding or score vector (float32, on the CPU)."""
        hidden = torch.stack([self._vector(pool) for pool in pools]).to(self.model.dtype)
        out: list[Tensor | None] = [None] * len(pools)
        scoring = [i for i, pool in enumerate(pools) if pool.params.task == "score"]
        if scoring:
            for i, score in zip(scoring, self._scores(hidden[scoring]), strict=True):
                out[i] = score
        for i, pool in enumerate(pools):
            if out[i] is None:
                vector = hidden[i].float()[: pool.params.dimensions]
                normalize = pool.params.normalize
                if self.model.config.normalize if normalize is None else normalize:
                    vector = F.normalize(vector, dim=0)
                out[i] = vector
        return [v.cpu() for v in out]

    def _vector(self, pool: PoolState) -> Tensor:
        if self.kind == "mean":
            return sum(pool.parts.values()) / pool.num_prompt_tokens
        return next(iter(pool.parts.values()))

    def _scores(self, hidden: Tensor) -> Tensor:
        """(R, hidden) -> (R, labels): probabilities, one per label (a single label: its
        sigmoid)."""
        if self.classifier_token_ids:
            logits = self.model.logits(hidden)[:, self.classifier_token_ids]
            return logits.float().softmax(-1)[:, -1:]
        logits = self.model.classify(hidden).float()
        return logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
