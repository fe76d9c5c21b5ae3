"""The CPU backend: a C++ kernel that reads the paged K/V blocks in place through the table.

The reference backend copies every row's blocks into a contiguous buffer before SDPA; at
decode that copy costs more than the attention itself. This kernel (cpu_kernel.cpp) does one
fused pass per (row, KV head): an online softmax over tiles of tokens, each tile's K/V rows
found through the block table, all the query heads of a KV group together so each K/V tile is
read once. It is compiled at first use by torch.utils.cpp_extension (g++ and ninja; torch
caches the build, so only the first process pays) and parallelized over torch's intra-op
threads, so torch.set_num_threads applies.
"""

import functools
import logging
import os
import shutil
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata
from tinyllm.model.attention.reference import ReferenceBackend

log = logging.getLogger("tinyllm")

SOURCE = Path(__file__).with_name("cpu_kernel.cpp")
SUPPORTED = (torch.float32, torch.bfloat16)


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


def _compile() -> ModuleType:
    """Build (or load torch's cached build of) the kernel; raises when it cannot."""
    from torch.utils.cpp_extension import load

    cxx = os.environ.get("CXX", "c++")  # the compiler torch's build uses
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH")
    arch, flags = _arch_flags()
    return load(
        name=f"tinyllm_cpu_attention_{arch}",
        sources=[str(SOURCE)],
        # -fopenmp: at::parallel_for runs serially in code compiled without it.
        extra_cflags=["-O3", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"],
    )


@functools.cache
def _kernel() -> ModuleType:
    start = time.perf_counter()
    module = _compile()
    log.info("attention: CPU kernel built or loaded in %.1f s", time.perf_counter() - start)
    return module


class CPUBackend(AttentionBackend):
    """Every row, decode and prefill alike, in the kernel, for fp32 and bf16; other dtypes go
    to the reference backend."""

    name = "cpu"

    def __init__(self, kernel: ModuleType):
        self.kernel = kernel
        self.reference = ReferenceBackend()

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> Tensor:
        if not (q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in SUPPORTED):
            return self.reference.attend(q, k, v, k_cache, v_cache, meta, scale)
        q = q.contiguous()
        out = torch.empty_like(q)
        self.kernel.attend(
            out,
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.num_rows,
            scale,
        )
        return out


def load_cpu_backend() -> tuple[AttentionBackend | None, str]:
    """The CPU backend, or None and why it cannot run here (no compiler, a failed build)."""
    try:
        kernel = _kernel()
    except Exception as e:  # whatever stops the build, the reference backend still works
        log.debug("attention: CPU kernel build failed", exc_info=True)
        return None, f"the CPU attention kernel did not build: {_first_error(e)}"
    return CPUBackend(kernel), "ready"


def _first_error(e: Exception) -> str:
    """One line for the log: a failed build's message starts with the compiler command, so the
    compiler's first `error:` line says more."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [type(e).__name__])[0]
