"""Building tinyllm's C++ CPU ops: paged attention (attention/cpu_kernel.cpp), a decoder
layer's element-wise steps (layer_ops.cpp), linear layers on quantized weights
(quant_linear.cpp) and a whole decoder layer from those (decoder_layer.cpp), one library
registering torch.ops.tinyllm.*.

It is compiled at first use by torch.utils.cpp_extension (a C++ compiler and ninja; 15 s on a
quiet machine, a few minutes on a busy one); torch caches the build, so later processes only
load it. The ops run on torch's intra-op threads, so torch.set_num_threads applies. Where it
cannot build, callers fall back to torch.
"""

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger("tinyllm")

HERE = Path(__file__).parent
SOURCES = [
    HERE / "attention" / "cpu_kernel.cpp",
    HERE / "layer_ops.cpp",
    HERE / "quant_linear.cpp",
    HERE / "decoder_layer.cpp",
]
HEADERS = [HERE / "fast_exp.h", HERE / "cpu_ops.h"]
# Lets the compiler sum a dot product in a tree of vector adds rather than in order, one lane at
# a time; unlike -ffast-math it keeps inf and NaN semantics.
REASSOCIATE = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


# Instruction-set levels the library is built for, best first. Named levels rather than
# -march=native: torch caches the build by name, and a cache carried to a machine without the
# build machine's extensions would crash on an illegal instruction. VNNI (int8 dot products)
# and AMX (int8 tile products) make levels of their own: quant_linear.cpp's fastest paths.
LEVELS = {
    "avx512amx": [
        "-march=x86-64-v4",
        "-mavx512vnni",
        "-mamx-tile",
        "-mamx-int8",
        "-mprefer-vector-width=512",
    ],
    "avx512vnni": ["-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=512"],
    "avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
    "avx2vnni": ["-march=x86-64-v3", "-mavxvnni"],
    "avx2": ["-march=x86-64-v3"],
    "generic": [],
}
# The CPU extensions (torch.cpu.get_capabilities()'s names) each level's code may use. VNNI
# levels are not ordered by width alone: AVX-VNNI (avx2vnni) is an extension of its own, which
# CPUs with AVX512-VNNI may lack.
X86_64_V3 = ("avx", "avx2", "bmi", "bmi2", "f16c", "fma3", "lzcnt")
X86_64_V4 = (*X86_64_V3, "avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl")
NEEDS = {
    "avx512amx": (*X86_64_V4, "avx512_vnni", "amx_tile", "amx_int8"),
    "avx512vnni": (*X86_64_V4, "avx512_vnni"),
    "avx512": X86_64_V4,
    "avx2vnni": (*X86_64_V3, "avx_vnni"),
    "avx2": X86_64_V3,
    "generic": (),
}


def level() -> str:
    """The best level this CPU runs, or TINYLLM_CPU_LEVEL's (a lower one, to measure or debug
    the paths another machine would take). A forced level that needs an extension this CPU
    lacks would die on its first illegal instruction (SIGILL, no message): this CPU's level
    runs instead, with a warning."""
    forced, best = os.environ.get("TINYLLM_CPU_LEVEL"), _detected()
    if not forced:
        return best
    if forced not in LEVELS:
        raise ValueError(f"TINYLLM_CPU_LEVEL={forced!r}: choose one of {', '.join(LEVELS)}")
    has = torch.cpu.get_capabilities()
    if missing := [ext for ext in NEEDS[forced] if not has.get(ext)]:
        log.warning(
            "TINYLLM_CPU_LEVEL=%s needs %s, which this CPU lacks: using this CPU's level, %s",
            forced,
            ", ".join(missing),
            best,
        )
        return best
    return forced


def _detected() -> str:
    """The best level this CPU runs, as torch's own kernels detect it."""
    cap, has = torch.backends.cpu.get_cpu_capability(), torch.cpu.get_capabilities()
    if cap == "AVX512":
        if not has.get("avx512_vnni"):
            return "avx512"
        return "avx512amx" if has.get("amx_tile") and has.get("amx_int8") else "avx512vnni"
    if cap == "AVX2":
        return "avx2vnni" if has.get("avx_vnni") else "avx2"
    return "generic"


def build_flags(name: str) -> list[str]:
    # -fopenmp: at::parallel_for, inlined from torch's headers, is serial without it.
    return ["-O3", "-fopenmp", *REASSOCIATE, *LEVELS[name]]


def _compile() -> None:
    """Build (or load torch's cached build of) the library; raises when it cannot. A compiler
    too old for AMX's flags (GCC before 11) still gets the AVX512-VNNI build."""
    cxx = os.environ.get("CXX", "c++")  # the compiler torch's build uses
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH")
    chosen = level()  # once: a fallback from a forced level warns
    try:
        _build(chosen)
    except Exception as e:
        if chosen != "avx512amx":
            raise
        log.warning(
            "tinyllm's CPU kernels did not build for avx512amx (%s): building them for "
            "avx512vnni, without AMX tile products",
            first_error(e),
        )
        _build("avx512vnni")


def _build(chosen: str) -> None:
    from torch.utils.cpp_extension import load

    name = f"tinyllm_cpu_{chosen}"
    built = _is_built(name)
    if not built:  # else a silent pause on a first run, long enough to look hung
        log.warning(
            "compiling tinyllm's CPU kernels (%d C++ files, for %s; once per machine: 15 s, "
            "a few minutes on a busy machine)",
            len(SOURCES),
            chosen,
        )
    start = time.perf_counter()
    load(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=build_flags(chosen),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,  # the library registers its ops with torch
    )
    # At warning level after a build, so whoever saw it start sees it end.
    log.log(
        logging.INFO if built else logging.WARNING,
        "tinyllm's CPU kernels (%s) %s in %.1f s",
        chosen,
        "loaded" if built else "compiled",
        time.perf_counter() - start,
    )


def _is_built(name: str) -> bool:
    """Whether torch's extension cache holds a build of `name` newer than the sources, which
    torch then only loads (an older one it rebuilds)."""
    from torch.utils.cpp_extension import _get_build_directory

    library = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    newest = max(s.stat().st_mtime for s in SOURCES + HEADERS)
    return library.is_file() and library.stat().st_mtime >= newest


@functools.cache
def library_error() -> str | None:
    """None once the library is built or loaded, else why it cannot be: tried once per process,
    so a machine without a compiler does not retry at every call."""
    try:
        _compile()
    except Exception as e:  # whatever stops the build, the torch versions of the ops still work
        log.debug("CPU kernels: build failed", exc_info=True)
        return first_error(e)
    return None


def first_error(e: Exception) -> str:
    """One line for the log: a failed build's message starts with the compiler command, so the
    compiler's first `error:` line says more."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [type(e).__name__])[0]
