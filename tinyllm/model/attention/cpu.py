"""The CPU backend: a C++ kernel that reads the paged K/V blocks in place through the table.

The reference backend copies every row's blocks into a contiguous buffer before SDPA; at
decode that copy costs more than the attention itself. The kernel (cpu_kernel.cpp) reads the
blocks in place instead: one pass per (row, up to 16 of its new tokens, KV head) over tiles of
32 keys with an online softmax, each tile read from memory once for those tokens and the KV
group's query heads, each query computed exactly as it would be alone (so a token's bits do not
depend on how its prompt was chunked). `python benchmarks/decode_attention.py [--threads 1]
[--dtype bfloat16]` times it against the reference and against the bound that K and V's bytes
over the machine's copy bandwidth set (a copy also writes, so a pass that only reads can beat it).
Prefill rows run in the same kernel, so only dtypes other than fp32 and bf16 go to the
reference (bf16 is read as is and accumulated in fp32).

The kernel is part of tinyllm's C++ CPU library (model/cpu_library.py), built at first use.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata
from tinyllm.model.attention.reference import ReferenceBackend
from tinyllm.model.cpu_library import first_error, library_error

SUPPORTED = (torch.float32, torch.bfloat16)


def _kernel() -> Callable[..., None]:
    why = library_error()
    if why is not None:
        raise RuntimeError(why)
    return torch.ops.tinyllm.paged_attention


class CPUBackend(AttentionBackend):
    """Every row, decode and prefill alike, in the kernel, for fp32 and bf16 (both caches of q's
    dtype, or int8); anything else goes to the reference backend. On those dtypes the layers
    may run as C++ ops (model/decoder_layer.cpp) that call the same kernel and let it write the
    step's new K/V too: only with this backend (tinyllm.model.layer_executor), which is the
    kernel's entry for the modules' path and the tests."""

    name = "cpu"

    def __init__(self, kernel: Callable[..., None]):
        self.kernel = kernel
        self.reference = ReferenceBackend()

    def attend(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window=None,
        softcap=None,
        sinks=None,
    ) -> Tensor:
        if not _native(q, k_cache, v_cache):
            return self.reference.attend(
                q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks
            )
        out = q.new_empty(q.shape)
        tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
        self.kernel(out, q, k_cache, v_cache, None, None, None, tables, lens, starts,
                    meta.num_rows, scale, window, softcap, sinks)  # fmt: skip
        return out


def _native(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """q fp32 or bf16, the caches of its dtype or int8 (dequantized as the tiles are read)."""
    return k_cache.dtype == v_cache.dtype in (q.dtype, torch.int8) and q.dtype in SUPPORTED


def load_cpu_backend() -> tuple[AttentionBackend | None, str]:
    """The CPU backend, or None and why it cannot run here (no compiler, a failed build)."""
    try:
        kernel = _kernel()
    except Exception as e:  # whatever stops the build, the reference backend still works
        return None, f"the CPU attention kernel did not build: {first_error(e)}"
    return CPUBackend(kernel), "ok"
