"""The machine's own limits, measured in the same run as the engines: its fp32 GEMM rate (what
batched work is bound by) and its read bandwidth (what single-stream decode is bound by)."""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Machine:
    device: str
    threads: int
    cpu_capability: str  # torch's: "AVX2", "AVX512", ...; the kernels torch picked
    gemm_flops: float  # FLOP/s
    read_bandwidth: float  # bytes/s


def best_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """The fastest of a few timed calls after one warm-up: on a shared machine the minimum is
    the run least disturbed by other work."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _synced(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """fn, waiting for the device to finish it (CUDA kernels run asynchronously)."""

    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return call


def gemm_flops(device: torch.device, n: int = 2048) -> float:
    """Peak fp32 matmul rate in FLOP/s, from a large square torch.mm."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return 2 * n**3 / best_seconds(_synced(lambda: a @ b, device))


def read_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Bytes per second a large sum reads: a read-only stream, as decode reads its weights. A
    copy would also write as many bytes, and measure about half the rate."""
    src = torch.ones(nbytes // 4, device=device)
    return nbytes / best_seconds(_synced(src.sum, device))


def measure_machine(device: torch.device) -> Machine:
    return Machine(
        device=device.type,
        threads=torch.get_num_threads(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        gemm_flops=gemm_flops(device),
        read_bandwidth=read_bandwidth(device),
    )
