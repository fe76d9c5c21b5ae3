"""torch's CPU thread pool: how many threads, and a warning when other work leaves it no cores.

torch splits each operation across its threads and waits for the slowest; a thread that the
kernel does not schedule (because other processes hold the cores) stalls every operation. On a
2-core machine with other work on both cores that makes two threads several times slower than
one (docs/MEASUREMENTS.md, "Threads on a busy machine").
"""

import logging
import os
import time

from tinyllm.host.torchrun import ranks_on_host

log = logging.getLogger("tinyllm")

_LOADAVG = "/proc/loadavg"
# Reads of the runnable count, a little apart: one read can catch a short-lived task (a shell,
# a compiler) and the fewest seen is the work that stays.
_SAMPLES, _SAMPLE_GAP_S = 5, 0.02
_warned = False


def default_threads() -> int:
    """OMP_NUM_THREADS when set (how a run is pinned to one thread on a busy machine), else the
    cores this process may run on."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    return allowed_cores()


def rank_threads(world_size: int, threads: int | None = None) -> int:
    """Torch threads for each of `world_size` tensor-parallel ranks: `threads`, the host's budget
    (None: default_threads()), shared by the ranks on this host, at least 1 each."""
    budget = default_threads() if threads is None else threads
    return max(1, budget // ranks_on_host(world_size))


def allowed_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores a container or taskset allows
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_threads(threads: int) -> None:
    """torch.set_num_threads, after checking the number; call it before loading weights, whose
    conversion uses the pool too."""
    import torch

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} must be an integer >= 1")
    torch.set_num_threads(threads)


def _running_now() -> int | None:
    """Runnable threads machine-wide, this one included ("3/88": 3 of 88 threads)."""
    try:
        with open(_LOADAVG) as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def other_runnable_threads() -> int | None:
    """Threads other than this one that are runnable now, machine-wide (fewest of a few reads
    of /proc/loadavg); None where the kernel does not say (not Linux)."""
    counts = []
    for i in range(_SAMPLES):
        running = _running_now()
        if running is None:
            return None
        counts.append(running - 1)  # the thread reading the file is running too
        if i + 1 < _SAMPLES:
            time.sleep(_SAMPLE_GAP_S)
    return min(counts)


def warn_if_oversubscribed(threads: int) -> bool:
    """Log once per process when other runnable work and our `threads` need more cores than this
    process may use: the case where one thread beats several. Returns whether it warned."""
    global _warned
    if _warned or threads < 2:
        return False
    others, cores = other_runnable_threads(), allowed_cores()
    if others is None or others + threads <= cores:
        return False
    _warned = True
    log.warning(
        "this machine is busy: %d other runnable thread(s) besides tinyllm's %d, on %d core(s); "
        "torch's threads wait for each other and run several times slower. Use one thread: "
        "--threads 1, OMP_NUM_THREADS=1 or LLM(threads=1)",
        others,
        threads,
        cores,
    )
    return True
