"""Which part of each of the model's weights a tensor-parallel rank holds, read from the
checkpoint without the rest: Megatron-LM's split, as vLLM, nano-vllm and gpt-fast make it.
Each parameter has its own loader (`param_loader`), and the stacked ones load their parts by
shard id (q, k, v; gate, up), from the checkpoint's separate tensors or from one it stacks.

- Column-parallel layers (qkv_proj, gate_up_proj) split their output rows, each part on its
  own: rank r of N holds the r-th N-th of the query heads, of the KV heads and of the FFN
  width, so that its attention and its MLP's activation need nothing from another rank.
- Row-parallel layers (o_proj, down_proj) split their input columns to match: each rank's
  product is a partial sum of the layer's output (adding them, an all-reduce, is the
  tensor-parallel runtime's job). Their biases (gpt-oss's) are rank 0's alone, the other
  ranks' are zeros: the all-reduce adds a bias once, as one process does.
- Per-head parameters (gpt-oss's attention sinks) split as the query heads do.
- A mixture-of-experts layer's experts split as the MLP does, each on its own: every rank holds
  its share of every expert's FFN width (gate_up_proj's rows, down_proj's columns), so the
  experts need no collective beyond the MLP's all-reduce. The router is replicated: each rank
  routes its tokens alike, from the same (all-reduced) input.
- Everything else is replicated: the norms, the routers, and for now the embeddings and the LM head.
  Splitting those by vocabulary saves each rank its share of vocab x hidden but adds an
  all-reduce of the embeddings and a gather of the logits to every step: the runtime that adds
  the collectives decides.

Quantized weights split on their format's boundaries. Rows split anywhere: each row's groups
are its own, and a rank packs its rows into tiles of 16 of its own (model/quant.py pads the
last one), so no tile is ever cut. Columns split between groups of 32, so a rank's share of a
row-parallel layer's inputs is whole groups. From a GGUF file the split selects the blocks'
bytes before anything is decoded (loaders/gguf.py, GGUFTensor).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tinyllm.loaders.stored import StoredTensor, Weight
from tinyllm.model.config import ModelConfig, ModelLoadError
from tinyllm.model.layers import EXPERT_STACKED, STACKED, expert_prefix
from tinyllm.model.quant import GROUP, cat_rows

# The dense MLP's down_proj and each expert's (mlp.experts.E.down_proj).
ROW_PARALLEL = ("self_attn.o_proj", ".down_proj")
HEAD_PARALLEL = "self_attn.sinks"
Tensors = Mapping[str, StoredTensor]


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world_size`, and the range of a dimension it holds."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..world_size-1 ({self.world_size})")

    def part(self, what: str, size: int, unit: int = 1, units: str = "", start: int = 0) -> slice:
        """The rank's range of `size` rows or columns (`what`) from `start`: the rank-th of
        world_size equal parts, each of whole `units` of `unit`."""
        n, rest = divmod(size, self.world_size)
        # One rank's range ends at the dimension's end, where whole units do not matter (the
        # quantized formats pad a row's last group).
        if rest or (self.world_size > 1 and n % unit):
            whole = f" in whole {units}" if unit > 1 else ""
            ranks = self.world_size
            raise ValueError(f"{what} ({size}) do not split over world_size {ranks}{whole}")
        return slice(start + self.rank * n, start + (self.rank + 1) * n)


@dataclass(frozen=True)
class ParamLoader:
    """Loads the model's parameter `name` whole, on every rank (replicated)."""

    name: str

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.name,)

    def found_in(self, tensors: Tensors) -> bool:
        return self.name in tensors

    def load(self, tensors: Tensors, shard: Shard) -> Weight:
        return tensors[self.name].read()


@dataclass(frozen=True)
class RowParallel(ParamLoader):
    unit: int  # GROUP for quantized weights, else 1

    def load(self, tensors: Tensors, shard: Shard) -> Weight:
        stored = tensors[self.name]
        what = f"{self.name}: its input columns"
        groups = f"groups of {self.unit} (the quantized formats')"
        return stored.read(cols=shard.part(what, stored.shape[1], self.unit, groups))


@dataclass(frozen=True)
class RankZero(ParamLoader):
    """A row-parallel layer's bias: rank 0's, zeros on the other ranks."""

    def load(self, tensors: Tensors, shard: Shard) -> Weight:
        bias = tensors[self.name].read()
        return bias if shard.rank == 0 else torch.zeros_like(bias)


@dataclass(frozen=True)
class HeadParallel(ParamLoader):
    """A parameter with one entry per query head: the rank's heads' entries."""

    def load(self, tensors: Tensors, shard: Shard) -> Weight:
        stored = tensors[self.name]
        return stored.read(shard.part(f"{self.name}: its heads", stored.shape[0]))


@dataclass(frozen=True)
class Part:
    shard_id: str  # "q", "k", "v"; "gate", "up"
    source: str  # the checkpoint's tensor, when it holds the part on its own
    rows: int
    unit: int  # rows that must stay together: a head's


@dataclass(frozen=True)
class ColumnParallel(ParamLoader):
    parts: tuple[Part, ...]  # in the order the parameter stacks them

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.name, *(p.source for p in self.parts))

    def found_in(self, tensors: Tensors) -> bool:
        return self.name in tensors or all(p.source in tensors for p in self.parts)

    def _rows(self, shard: Shard, stacked: bool) -> list[slice]:
        """The rank's rows of each part: in the part's own tensor, or in the stacked one."""
        rows, start = [], 0
        for p in self.parts:
            what, units = f"{self.name} ({p.shard_id}): its rows", f"heads of {p.unit} rows"
            rows.append(shard.part(what, p.rows, p.unit, units, start))
            start += p.rows if stacked else 0
        return rows

    def load(self, tensors: Tensors, shard: Shard) -> Weight:
        if self.name not in tensors:  # Hugging Face's separate q/k/v or gate/up
            rows = self._rows(shard, stacked=False)
            return cat_rows(
                [tensors[p.source].read(r) for p, r in zip(self.parts, rows, strict=True)]
            )
        stacked = tensors[self.name]  # stacked already (Phi-3's checkpoints, dummy weights)
        if shard.world_size == 1:
            return stacked.read()  # as it is: dummy weights share one code tensor per shape
        return cat_rows([stacked.read(r) for r in self._rows(shard, stacked=True)])


def param_loader(name: str, config: ModelConfig, quantized: bool) -> ParamLoader:
    """The loader of the model's parameter `name` (of the whole model `config` describes);
    `quantized`: it runs as groups of 32, so columns split between groups."""
    module, _, kind = name.rpartition(".")
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    rows = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (config.intermediate_size,) * 2}
    own, separate = EXPERT_STACKED
    if (expert := expert_prefix(name)) and module.endswith("." + own):
        # An expert's gate_up_proj: every rank holds its slice of every expert's FFN width.
        width = config.moe_intermediate_size
        parts = tuple(
            Part(hf.removesuffix("_proj"), f"{expert}{hf}.{kind}", width, 1) for hf in separate
        )
        return ColumnParallel(name, parts)
    for own, separate in STACKED.items():
        if module.endswith("." + own):
            layer = module.removesuffix(own)
            head = config.head_dim if own == "self_attn.qkv_proj" else 1
            parts = tuple(
                Part(hf.rpartition(".")[2].removesuffix("_proj"), f"{layer}{hf}.{kind}", n, head)
                for hf, n in zip(separate, rows[own], strict=True)
            )
            return ColumnParallel(name, parts)
    if module.endswith(ROW_PARALLEL):
        return RowParallel(name, GROUP if quantized else 1) if kind == "weight" else RankZero(name)
    if name.endswith(HEAD_PARALLEL):
        return HeadParallel(name)
    return ParamLoader(name)


def read_shard(
    tensors: Tensors,
    names: Iterable[str],
    config: ModelConfig,
    shard: Shard,
    quantized: bool,
    progress: bool = False,
) -> dict[str, Weight]:
    """The rank's part of each of the model's parameters `names` (of the whole model `config`
    describes), read from the checkpoint's `tensors` (Hugging Face's names, or the model's own
    stacked ones), under the model's own names; see param_loader for `quantized`. A tensor the
    model lacks, or one it needs and the checkpoint lacks, is an error."""
    loaders = [param_loader(name, config, quantized) for name in names]
    # A tied LM head is the embeddings: a checkpoint may store it too (Hugging Face's often do).
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [p.name for p in loaders if not p.found_in(tensors) and p.name not in optional]
    unexpected = sorted(tensors.keys() - {s for p in loaders for s in p.sources})
    if missing or unexpected:
        raise ModelLoadError(
            f"weights do not match the {config.architecture} model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    loaders = [p for p in loaders if p.found_in(tensors)]
    bar = tqdm(loaders, desc="loading weights", unit="tensor", disable=not progress)
    return {p.name: p.load(tensors, shard) for p in bar}
