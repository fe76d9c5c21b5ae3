"""Memory as the operating system counts it: what the machine has free (to size the KV pool),
what this process holds resident (to report it), and freed heap pages handed back after load."""

import ctypes

import torch

_MEMINFO, _STATUS = "/proc/meminfo", "/proc/self/status"


def _proc_kib(path: str, field: str) -> int | None:
    """A `Field:  N kB` line of a /proc file, in bytes; None where the kernel does not say."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(device: torch.device) -> int | None:
    """Memory that can still be allocated on the device without swapping or failing: free GPU
    memory on CUDA, MemAvailable (free plus reclaimable page cache) on a Linux CPU; None where
    nothing says."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _proc_kib(_MEMINFO, "MemAvailable")


def resident_bytes() -> int | None:
    """This process's resident set (VmRSS): the pages it actually holds in RAM."""
    return _proc_kib(_STATUS, "VmRSS")


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim). Loading allocates
    and frees many temporaries below malloc's mmap threshold; glibc keeps their pages, which
    stay resident until trimmed. No-op without glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to trim
        return
    trim(0)
