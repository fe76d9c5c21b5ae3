"""Tensor parallelism on the model (model/tensor_parallel.py), across real processes: each rank
of a gloo process group loads its shard (load_model with its rank), apply_tp makes its layers
all-reduce after o_proj and down_proj, and its forward passes (a prefill of three prompts, then
a decode step of each) give the logits one process gives with the whole model: at TP=2 and
TP=4 on a model with 4 KV heads, at TP=3 on one shaped like the default model (3 KV heads), at
TP=2 on a tiny gpt-oss (sinks split by head, o_proj's and the experts' biases added once), in
dense fp32 and int4, on both layer executors. test_sharded_loading checks the shards."""

import itertools
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_gpt_oss import random_gpt_oss
from tests.test_hf_loader import _write_tokenizer
from tests.test_sharded_loading import SMALL, hf_dir
from tinyllm.loaders.model_loader import LoadConfig, load_model
from tinyllm.model.attention import AttentionMetadata, ForwardContext, get_backend
from tinyllm.model.config import ModelConfig
from tinyllm.model.cpu_library import library_error
from tinyllm.model.llama import Transformer
from tinyllm.model.tensor_parallel import apply_tp

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)

CPU = torch.device("cpu")
# Like the default model (9 query heads, 3 KV heads): each of 3 ranks' o_proj inputs (3 heads
# of 32) and down_proj inputs (64) are whole groups of 32 in int4.
THREE_KV = dict(hidden=96, heads=9, kv_heads=3, head_dim=32, ffn=192)
MODELS = {"4kv": SMALL, "3kv": THREE_KV}  # SMALL: 8 heads, 4 KV heads, hidden 64, FFN 128
QUANTIZATIONS = ("none", "int4")
EXECUTORS = ("fused", "modules")
BLOCK = 4
PROMPTS = [[3, 17, 42, 8, 99], [5, 60, 2], [7, 7, 81, 33, 120, 64, 11]]
NEXT = [12, 90, 45]  # each prompt's decode step's token
# Logits of N ranks against one process, as a fraction of the logits' std (about 0.09 on the
# Llama shapes' random weights, 0.8 on gpt-oss's): in fp32 only the order of the sums differs
# (the row-parallel products in N parts, added by the all-reduce), measured within 1.5e-6 of
# the std; int4's kernel rounds activations to int8 per group of 32, where a last-bit
# difference can move a code by one step, measured within 5e-5 of it. 2.5e-4 is 5x that, and
# far below what a missing all-reduce, or a bias added once per rank, gives (about 1).
TOLERANCE = 2.5e-4


def _context(kv_caches: list, seq_lens: list[int], query_lens: list[int]):
    """One step of PROMPTS' sequences, decodes first, as the model runner lays it out: sequence
    r ends at seq_lens[r] tokens with query_lens[r] new ones and owns blocks 2r and 2r + 1."""
    tables = [[2 * r, 2 * r + 1] for r in range(len(seq_lens))]
    slots = [
        table[p // BLOCK] * BLOCK + p % BLOCK
        for table, end, n in zip(tables, seq_lens, query_lens, strict=True)
        for p in range(end - n, end)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.tensor(list(itertools.accumulate(query_lens, initial=0))),
        num_decodes=sum(n == 1 for n in query_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    return ForwardContext(meta, get_backend("cpu", CPU), kv_caches)


def _logits(model: Transformer, executor: str) -> list[torch.Tensor]:
    """The logits of every position of PROMPTS' prefill, then of their decode step, with the
    model's layers run by `executor`."""
    model.set_layer_executor(executor)
    c = model.config  # a rank's: its KV cache holds its own KV heads
    shape = (2 * len(PROMPTS) + 1, BLOCK, c.num_kv_heads, c.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
    lens = [len(p) for p in PROMPTS]
    ids, positions = [t for p in PROMPTS for t in p], [i for n in lens for i in range(n)]
    prefill = _context(kv, lens, lens)
    out = [model.logits(model(torch.tensor(ids), torch.tensor(positions), prefill))]
    decode = _context(kv, [n + 1 for n in lens], [1] * len(lens))
    out.append(model.logits(model(torch.tensor(NEXT), torch.tensor(lens), decode)))
    return out


def _variants(path: Path, rank: int, world_size: int) -> dict:
    """(quantization, executor): the logits of _logits, for rank `rank`'s part of the model."""
    out = {}
    for quantization in QUANTIZATIONS:
        config = LoadConfig(str(path), "float32", quantization, max_model_len=64)
        model = load_model(config, CPU, rank, world_size).model
        if world_size > 1:
            apply_tp(model)
        for executor in EXECUTORS:
            out[quantization, executor] = _logits(model, executor)
    return out


def _rank(rank: int, world_size: int, port: int, path: Path, out: Path) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    try:
        torch.save(_variants(path, rank, world_size), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {
        name: hf_dir(tmp_path_factory.mktemp(name), "llama", dims, tied=False)
        for name, dims in MODELS.items()
    }
    dirs["gpt-oss"] = tmp_path_factory.mktemp("gpt_oss")  # 4 heads, 2 KV heads, experts of 64
    random_gpt_oss().save_pretrained(dirs["gpt-oss"])
    _write_tokenizer(dirs["gpt-oss"])
    return dirs


@pytest.fixture(scope="module")
def one_process(model_dirs) -> dict[str, dict]:
    """Each model's _variants run whole, in this process: what the ranks must give."""
    return {name: _variants(path, 0, 1) for name, path in model_dirs.items()}


@pytest.mark.parametrize("name,world_size", [("4kv", 2), ("4kv", 4), ("3kv", 3), ("gpt-oss", 2)])
def test_ranks_give_the_whole_models_logits(name, world_size, model_dirs, one_process, tmp_path):
    path, whole = model_dirs[name], one_process[name]
    mp.spawn(_rank, args=(world_size, _free_port(), path, tmp_path), nprocs=world_size)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    for variant, want in whole.items():
        for step, expected in enumerate(want):
            atol = TOLERANCE * float(expected.std())
            got = ranks[0][variant][step]
            # The all-reduce gives every rank the same sums: the ranks' streams never drift.
            assert all(torch.equal(r[variant][step], got) for r in ranks), variant
            torch.testing.assert_close(
                got, expected, rtol=0, atol=atol, msg=lambda m, v=variant: f"{v}: {m}"
            )
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), variant


def test_apply_tp_checks_the_group_and_leaves_one_process_alone(model_dirs):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = load_model(LoadConfig(str(model_dirs["4kv"]), "float32", "none"), CPU).model
        assert apply_tp(model) is model
        assert all(layer.all_reduce is None for layer in model.model.layers)
        with torch.device("meta"):
            half = Transformer(ModelConfig("llama", 128, 64, 128, 2, 8, 4, 16, 64).shard(2))
        with pytest.raises(ValueError, match="tensor_parallel_size 2 ranks, .* world_size 1"):
            apply_tp(half)
    finally:
        dist.destroy_process_group()
