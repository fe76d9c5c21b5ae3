"""The CPU backend: a C++ kernel that reads the paged K/V blocks in place through the table.

The reference backend copies every row's blocks into a contiguous buffer before SDPA; at
decode that copy costs more than the attention itself. The kernel (cpu_kernel.cpp) makes one
pass per (row, KV head) instead: an online softmax over tiles of 32 tokens, each token's K/V
rows found through the block table, the query heads of a KV group together so each tile is
read from memory once. Decode, SmolLM2 shapes, 64 rows x 512 tokens, fp32: 0.62-0.66x the bound
(K and V bytes over the measured copy bandwidth; a copy also writes, so a pass that only reads
can beat it) and 3-7x faster than the reference, whose time varies with its page faults;
`python benchmarks/decode_attention.py [--threads 1]`.

Prefill rows (chunks, with or without earlier context) run in the same kernel, 32 queries to a
work item in the lanes of vectors, as in a matrix multiply: 1.2-2.7x faster than the reference's
per-row SDPA for chunks of 16-512 tokens after 0-2048 earlier ones, with AVX-512, AVX2 or SSE
builds; `python benchmarks/decode_attention.py --prefill-new 16 64 256 512 --prefill-ctx 0 512
2048`. So only dtypes other than fp32 and bf16 go to the reference (bf16 is read as is and
accumulated in fp32).

The kernel is compiled at first use by torch.utils.cpp_extension (a C++ compiler and ninja,
about 12 s; torch caches the build, so later processes only load it) and runs on torch's
intra-op threads, so torch.set_num_threads applies.
"""

import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata
from tinyllm.model.attention.reference import ReferenceBackend

log = logging.getLogger("tinyllm")

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
SUPPORTED = (torch.float32, torch.bfloat16)
# Lets the compiler sum a dot product in a tree of vector adds rather than in order, one lane at
# a time; unlike -ffast-math it keeps inf and NaN semantics.
REASSOCIATE = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


def _arch_flags() -> tuple[str, list[str]]:
    """A name for the instruction set the build targets, and the flags that target it.

    Named levels rather than -march=native: torch caches the build by name, and a cache carried
    to a machine without the build machine's extensions would crash on an illegal instruction."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return "avx512", ["-march=x86-64-v4", "-mprefer-vector-width=512"]
    if cap == "AVX2":
        return "avx2", ["-march=x86-64-v3"]
    return "generic", []


def _compile() -> Callable[..., None]:
    """Build (or load torch's cached build of) the kernel; raises when it cannot."""
    from torch.utils.cpp_extension import load

    cxx = os.environ.get("CXX", "c++")  # the compiler torch's build uses
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH")
    arch, flags = _arch_flags()
    load(
        name=f"tinyllm_cpu_attention_{arch}",
        sources=[str(SOURCE)],
        # -fopenmp: at::parallel_for, inlined from torch's headers, is serial without it.
        extra_cflags=["-O3", "-fopenmp", *REASSOCIATE, *flags],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,  # the library registers torch.ops.tinyllm.paged_attention
    )
    return torch.ops.tinyllm.paged_attention


@functools.cache
def _kernel() -> Callable[..., None]:
    start = time.perf_counter()
    op = _compile()
    log.info("attention: CPU kernel built or loaded in %.1f s", time.perf_counter() - start)
    return op


class CPUBackend(AttentionBackend):
    """Every row, decode and prefill alike, in the kernel, for fp32 and bf16 (q and both caches
    of one dtype); anything else goes to the reference backend."""

    name = "cpu"

    def __init__(self, kernel: Callable[..., None]):
        self.kernel = kernel
        self.reference = ReferenceBackend()

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> Tensor:
        if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in SUPPORTED):
            return self.reference.attend(q, k, v, k_cache, v_cache, meta, scale)
        q = q.contiguous()
        out = torch.empty_like(q)
        tables, lens, starts = (
            t.contiguous() for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        )
        self.kernel(out, q, k_cache, v_cache, tables, lens, starts, meta.num_rows, scale)
        return out


def load_cpu_backend() -> tuple[AttentionBackend | None, str]:
    """The CPU backend, or None and why it cannot run here (no compiler, a failed build)."""
    try:
        kernel = _kernel()
    except Exception as e:  # whatever stops the build, the reference backend still works
        log.debug("attention: CPU kernel build failed", exc_info=True)
        return None, f"the CPU attention kernel did not build: {_first_error(e)}"
    return CPUBackend(kernel), "ok"


def _first_error(e: Exception) -> str:
    """One line for the log: a failed build's message starts with the compiler command, so the
    compiler's first `error:` line says more."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [type(e).__name__])[0]
