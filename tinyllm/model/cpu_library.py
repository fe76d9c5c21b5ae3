"""tinyllm's C++ CPU ops: paged attention (attention/cpu_kernel.cpp), a decoder layer's
element-wise steps (layer_ops.cpp), linear layers on quantized weights (quant_linear.cpp), and
from those a whole decoder layer (decoder_layer.cpp) and a mixture-of-experts block
(moe_ops.cpp), one library registering torch.ops.tinyllm.*.

Installing the package (`pip install .` or `pip install -e .`, through setup.py) compiles one
library per instruction-set level this CPU runs (install_levels(); every level with
TINYLLM_KERNEL_LEVELS=all) into kernels/ beside this file; a process loads the one for its CPU's
level (level()), so a wheel built on one machine runs on any machine of a lower level.
A library's file name carries a hash of its sources, flags and torch's version: a library built
from other sources (an edited checkout) is never loaded. Where this install has no library for
the level (a checkout used without installing, edited sources, an unusual platform), it is
compiled at first use into the same folder, or into a
per-user cache folder of this install's own when the package's folder is read-only, under a lock
that a dead process cannot hold. The ops run on torch's intra-op threads, so
torch.set_num_threads applies. Where no library loads, callers fall back to torch.

setup.py runs this file on its own (before the package is installed), so it imports only the
standard library and torch.
"""

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("tinyllm")

HERE = Path(__file__).parent
SOURCES = [
    HERE / "attention" / "cpu_kernel.cpp",
    HERE / "layer_ops.cpp",
    HERE / "quant_linear.cpp",
    HERE / "decoder_layer.cpp",
    HERE / "moe_ops.cpp",
]
HEADERS = [HERE / "fast_exp.h", HERE / "cpu_ops.h"]
# The libraries installing the package builds, and where this install compiles a missing one.
KERNELS = HERE / "kernels"
TORCH = Path(torch.__file__).parent
# The flags every level's compile and link share: torch.utils.cpp_extension's, less Python's.
COMPILE = ["-fPIC", "-std=c++20"]
LINK = ["-shared", "-fopenmp", "-lc10", "-ltorch_cpu", "-ltorch"]
# How long a process waits for another's build of the same library before building its own.
LOCK_TIMEOUT = 600.0
# Lets the compiler sum a dot product in a tree of vector adds rather than in order, one lane at
# a time; unlike -ffast-math it keeps inf and NaN semantics.
REASSOCIATE = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


# Instruction-set levels the library is built for, best first. Named levels rather than
# -march=native: a package built on one machine (a wheel) runs on others, where the build
# machine's extensions would crash on an illegal instruction. VNNI (int8 dot products)
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


def install_levels() -> list[str]:
    """The levels installing the package builds: those this CPU runs, so that what it builds
    serves this machine and any of a lower level (a higher one compiles its own level at first
    use), or, with TINYLLM_KERNEL_LEVELS=all, every level, for a wheel to hand out."""
    if os.environ.get("TINYLLM_KERNEL_LEVELS") == "all":
        return list(LEVELS)
    has = torch.cpu.get_capabilities()
    return [name for name in LEVELS if all(has.get(ext) for ext in NEEDS[name])]


def build_flags(name: str) -> list[str]:
    # -fopenmp: at::parallel_for, inlined from torch's headers, is serial without it.
    return ["-O3", "-fopenmp", *REASSOCIATE, *LEVELS[name]]


def library_file(name: str) -> str:
    """The file name of level `name`'s library: a hash of its sources, flags and torch's version
    in it, so that a library built from anything else is never loaded."""
    digest = hashlib.sha256(
        " ".join([torch.__version__, *COMPILE, *build_flags(name), *LINK]).encode()
    )
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return f"tinyllm_cpu_{name}-{digest.hexdigest()[:16]}.so"


def build(names: list[str], directory: Path) -> dict[str, str]:
    """Compile the libraries of the levels `names` into `directory`, every source of every
    level at once (MAX_JOBS compilers, or one per core); returns the compiler's output for each
    level that failed, whose library is not written. The work happens in a folder of this
    process's own and each library is renamed into place whole, so a build interrupted however
    it ends leaves nothing that a later one trips over."""
    directory.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(directory)
    work = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=directory))
    running: set[subprocess.Popen] = set()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    pool = ThreadPoolExecutor(int(os.environ.get("MAX_JOBS") or cores or 1))  # macOS: no affinity
    try:
        objects, compiles = {}, {}
        for name in names:
            (work / name).mkdir()
            objects[name] = [work / name / f"{source.stem}.o" for source in SOURCES]
            compiles[name] = [
                pool.submit(_run, _compile_command(name, source, out), running)
                for source, out in zip(SOURCES, objects[name], strict=True)
            ]
        errors = {}
        for name in names:  # each level links as soon as its own sources are compiled
            library = work / f"{name}.so"
            if error := _first_failure(compiles[name]):
                errors[name] = error
                continue
            link = [_compiler(), *map(str, objects[name]), f"-L{TORCH / 'lib'}", *LINK]
            try:
                _run([*link, "-o", str(library)], running)
            except RuntimeError as e:
                errors[name] = str(e)
                continue
            os.replace(library, directory / library_file(name))
        return errors
    finally:  # an exception here is the caller's (Ctrl-C): stop every compiler, then clean up
        pool.shutdown(wait=False, cancel_futures=True)
        for process in list(running):
            process.kill()
        pool.shutdown(wait=True)
        shutil.rmtree(work, ignore_errors=True)


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # the compiler torch's builds use


def _compile_command(name: str, source: Path, out: Path) -> list[str]:
    include = TORCH / "include"
    headers = ["-isystem", str(include), "-isystem", str(include / "torch/csrc/api/include")]
    return [_compiler(), *headers, *COMPILE, *build_flags(name), "-c", str(source), "-o", str(out)]


def _run(command: list[str], running: set[subprocess.Popen]) -> None:
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        running.add(process)
        output, _ = process.communicate()
    running.discard(process)
    if process.returncode:
        raise RuntimeError(f"{shlex.join(command)}\n{output}")


def _first_failure(futures: list[Future]) -> str | None:
    errors = [str(f.exception()) for f in futures if f.exception() is not None]
    return errors[0] if errors else None


def _remove_abandoned(directory: Path) -> None:
    """Delete the work folders of builds whose process is gone (killed before it cleaned up)."""
    for work in directory.glob("build-*-*"):
        pid = work.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _load() -> None:
    """Load the library of this CPU's level: the one installed with the package, else one built
    now; raises when there is none. A compiler too old for AMX's flags (GCC before 11) leaves the
    AVX512-VNNI library."""
    chosen = level()  # once: a fallback from a forced level warns
    try:
        path = _library(chosen)
    except Exception as e:
        if chosen != "avx512amx":
            raise
        log.warning(
            "tinyllm's CPU kernels did not build for avx512amx (%s): using avx512vnni's, "
            "without AMX tile products",
            first_error(e),
        )
        chosen = "avx512vnni"
        path = _library(chosen)
    start = time.perf_counter()
    torch.ops.load_library(str(path))
    log.info(
        "tinyllm's CPU kernels (%s) loaded in %.1f s from %s",
        chosen,
        time.perf_counter() - start,
        path,
    )


def _library(name: str) -> Path:
    """Level `name`'s library for this install: installed with the package, or compiled at an
    earlier start, or else compiled now (one process at a time: a server starts its workers
    together)."""
    file = library_file(name)
    directory = _build_directory()
    for path in (KERNELS / file, directory / file):
        if path.is_file():
            return path
    if shutil.which(_compiler()) is None:
        raise RuntimeError(f"no C++ compiler: {_compiler()!r} is not on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    with _lock(directory / f"{file}.lock", name):
        if not (directory / file).is_file():  # else built by the process this one waited for
            # At warning level: a silent pause on a first run, long enough to look hung.
            log.warning(
                "compiling tinyllm's CPU kernels (%d C++ files, for %s, into %s: this install "
                "has no library built from these sources; once: 15 s, a few minutes on a busy "
                "machine)",
                len(SOURCES),
                name,
                directory,
            )
            start = time.perf_counter()
            if error := build([name], directory).get(name):
                raise RuntimeError(error)
            log.warning(
                "tinyllm's CPU kernels (%s) compiled in %.1f s", name, time.perf_counter() - start
            )
    return directory / file


def _build_directory() -> Path:
    """Where this install compiles a library it lacks: beside the installed ones, or where the
    package's folder is read-only, a per-user cache folder named for this install."""
    if os.access(KERNELS if KERNELS.is_dir() else HERE, os.W_OK):
        return KERNELS
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tinyllm" / hashlib.sha256(str(HERE).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _lock(path: Path, name: str) -> Iterator[None]:
    """Hold `path` while building level `name`'s library, or wait for the process that does.
    The kernel drops a dead process's lock however it died; a holder that the file names but
    that is gone (the lock passed to a child that outlived it), or that is still at it after
    LOCK_TIMEOUT (stopped, hung), is not waited for: this process builds on its own."""
    with open(path, "a+") as f:  # not inherited by the compilers this process starts
        deadline, told = time.monotonic() + LOCK_TIMEOUT, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                f.seek(0)
                f.truncate()
                f.write(f"{os.getpid()}\n")
                f.flush()
                break
            f.seek(0)
            holder = f.read().strip()
            gone = holder.isdigit() and not _alive(int(holder))
            if gone or time.monotonic() > deadline:
                log.warning(
                    "not waiting for process %s any longer (%s): compiling tinyllm's CPU "
                    "kernels for %s without the lock %s",
                    holder or "?",
                    "it is gone" if gone else f"still at it after {LOCK_TIMEOUT:.0f} s",
                    name,
                    path,
                )
                break
            if not told:
                log.warning(
                    "waiting for process %s, which is compiling tinyllm's CPU kernels for %s "
                    "(up to %.0f s; if no such process runs, delete %s)",
                    holder or "?",
                    name,
                    LOCK_TIMEOUT,
                    path,
                )
                told = True
            time.sleep(0.2)
        yield


@functools.cache
def library_error() -> str | None:
    """None once the library is loaded, else why it cannot be: tried once per process, so a
    machine without a compiler does not retry at every call."""
    try:
        _load()
    except Exception as e:  # whatever stops the build, the torch versions of the ops still work
        log.debug("CPU kernels: no library", exc_info=True)
        return first_error(e)
    return None


def first_error(e: Exception) -> str:
    """One line for the log: a failed build's message starts with the compiler command, so the
    compiler's first `error:` line says more."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [type(e).__name__])[0]
