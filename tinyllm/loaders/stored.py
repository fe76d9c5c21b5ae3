"""A checkpoint's tensors before they are read: each one's shape, and a read of any range of its
rows and columns, so that a tensor-parallel rank reads its shard of a weight and nothing more
(loaders/sharding.py says which shard). Each format has its own kind: GGUFTensor (gguf.py) and
SafetensorsTensor (hf.py) read from the file's map; InMemory holds weights made in memory (dummy
weights)."""

import math
from abc import ABC, abstractmethod

from torch import Tensor

from tinyllm.model.quant import GroupQuantized

Weight = Tensor | GroupQuantized  # dense, or a quantized linear weight's groups as stored
ALL = slice(None)


class StoredTensor(ABC):
    shape: tuple[int, ...]  # as the model uses it: (rows, columns) for a matrix

    @abstractmethod
    def read(self, rows: slice = ALL, cols: slice = ALL) -> Weight:
        """Rows `rows` and (of a matrix) columns `cols`, each a slice with step 1; the whole
        tensor by default."""

    def numel(self) -> int:
        return math.prod(self.shape)


def covers(shape: tuple[int, ...], rows: slice, cols: slice) -> bool:
    """Whether `rows` and `cols` take all of a tensor of `shape`."""
    ranges = (rows, cols)[: len(shape)]
    return all(len(range(n)[s]) == n for n, s in zip(shape, ranges, strict=True))


class InMemory(StoredTensor):
    def __init__(self, weight: Weight) -> None:
        self.weight, self.shape = weight, tuple(weight.shape)

    def read(self, rows: slice = ALL, cols: slice = ALL) -> Weight:
        w = self.weight
        if isinstance(w, GroupQuantized):
            return w.map_rows(lambda t: t[rows]).columns(cols)
        return w[rows] if w.dim() == 1 else w[rows, cols].contiguous()
