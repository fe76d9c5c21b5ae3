"""Toy tensor-parallel handlers for tests/test_workers.py, in a module the spawned workers can
import. `python -m tests.tp_handlers MODE` is rank 0 of two (spawning the other), or either rank
under torchrun; rank 0 prints the workers' pids and what it saw."""

import argparse
import atexit
import os
import signal
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from tinyllm.engine.worker.transport import WorkerGroup, run_worker, torchrun_rank


class SumHandler:
    """Each message is {"i": its number, "value": v} with optional "sleep" (seconds before the
    all-reduce), "raise" (an error text) and "pad" (a string). Every rank all-reduces
    [v * (rank + 1), messages it has seen, then from workers only: torch threads, the pad's
    length]; a message out of order is an error."""

    def __init__(self, rank: int):
        self.rank = rank
        self.seen = 0

    def __call__(self, message: dict) -> torch.Tensor:
        if message["i"] != self.seen:
            raise AssertionError(f"message {message['i']} arrived when {self.seen} was next")
        self.seen += 1
        if "raise" in message:
            raise ValueError(message["raise"])
        time.sleep(message.get("sleep", 0))
        own = [torch.get_num_threads(), len(message.get("pad", ""))] if self.rank else [0, 0]
        total = torch.tensor([message["value"] * (self.rank + 1), self.seen, *own])
        dist.all_reduce(total)
        return total


def make_sum_handler(rank: int, world_size: int, device: torch.device) -> SumHandler:
    tqdm(range(1), disable=True)  # as loading the weights does: tqdm makes its lock
    return SumHandler(rank)


def make_slow_handler(rank: int, world_size: int, device: torch.device) -> SumHandler:
    time.sleep(60)  # a long load, during which only the parent watch can notice rank 0 die
    return SumHandler(rank)


def make_failing_handler(rank: int, world_size: int, device: torch.device, text: str):
    raise ValueError(text)


def _rank0(group: WorkerGroup, mode: str) -> None:
    """Prints the workers' pids, then runs two steps or waits to be killed or interrupted."""
    print("pids", *(p.pid for p in group.processes.values()), flush=True)
    handler = SumHandler(0)
    if mode == "steps":
        for i in range(2):
            print("sum", group.execute({"i": i, "value": i + 1}, handler).tolist(), flush=True)
        group.close()
    elif mode == "mid-step":  # rank 0 stays out of the step's all-reduce
        group.execute({"i": 0, "value": 1}, lambda message: time.sleep(60))
    else:
        time.sleep(60)


def _exit_codes(groups: list[WorkerGroup]) -> list:
    return [p.exitcode for group in groups for p in group.processes.values()]


def main() -> None:
    # Ctrl-C raises KeyboardInterrupt, as at a terminal, even when this runs under a shell's
    # background job, which starts it with SIGINT ignored (Python keeps an ignored SIGINT).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["building", "idle", "mid-step", "steps"])
    mode = parser.parse_args().mode
    rank, cpu = torchrun_rank(), torch.device("cpu")
    started: list[WorkerGroup] = []
    # registered before the group's own close, so it runs after it
    atexit.register(lambda: print("worker exit codes", _exit_codes(started), flush=True))
    if rank:
        run_worker(cpu, make_sum_handler)
    elif rank == 0:
        started.append(WorkerGroup.attach(2, cpu))
        _rank0(started[0], mode)
    else:
        make = make_slow_handler if mode == "building" else make_sum_handler
        started.append(WorkerGroup.start(2, cpu, make))
        _rank0(started[0], mode)
    print("rank", rank, "pid", os.getpid(), "done", flush=True)


if __name__ == "__main__":
    main()
