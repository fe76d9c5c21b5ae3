"""Tensor-parallel worker processes (tinyllm/engine/worker/transport.py) with toy handlers
(tests/tp_handlers.py): messages arrive in order and the ranks' all-reduces meet; a worker that
dies or fails is named within seconds; no process outlives the group, after close, a failed
start, rank 0's death or Ctrl-C; under torchrun (or the same environment set by hand) too."""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.tp_handlers import SumHandler, make_failing_handler, make_sum_handler
from tinyllm.engine.worker.transport import WorkerDiedError, WorkerGroup
from tinyllm.host import threads
from tinyllm.host.threads import rank_threads

CPU = torch.device("cpu")
# Seconds a dead rank may take to be reported, and a process to be gone.
PROMPTLY = 5.0


def _step(i: int, **extra) -> dict:
    return {"i": i, "value": i + 1, **extra}


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[1] == str(pid):
            found.append(int(entry))
    return found


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _assert_nothing_left() -> None:
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


@pytest.fixture
def group():
    group = WorkerGroup.start(2, CPU, make_sum_handler)
    yield group
    group.close()
    _assert_nothing_left()


def test_messages_arrive_in_order_and_meet_rank_0s_all_reduce(group):
    handler = SumHandler(0)
    os.kill(group.processes[1].pid, signal.SIGINT)  # workers leave Ctrl-C to rank 0
    for i in range(5):
        pad = "x" * 1000 * 10**i  # up to 10 MB: past the part that rides with the length
        total = group.execute(_step(i, pad=pad), handler)
        # value * (rank + 1) summed, both ranks' message counts, the worker's thread share
        # and the pad it received
        assert total.tolist() == [(i + 1) * 3, 2 * (i + 1), rank_threads(2), len(pad)]
    group.check()
    assert group.threads == rank_threads(2)


def test_a_killed_worker_fails_the_next_message_naming_it(group):
    group.execute(_step(0), SumHandler(0))
    os.kill(group.processes[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 died \(killed by SIGKILL\)"):
        group.execute(_step(1), SumHandler(0))
    assert time.monotonic() - start < PROMPTLY
    with pytest.raises(WorkerDiedError, match="rank 1"):
        group.check()


def test_a_worker_killed_mid_step_fails_rank_0s_all_reduce():
    group = WorkerGroup.start(3, CPU, make_sum_handler)
    try:
        handler = SumHandler(0)
        threading.Timer(0.5, os.kill, (group.processes[1].pid, signal.SIGKILL)).start()
        start = time.monotonic()
        # the workers sleep before their all-reduce; rank 0 is in its own when rank 1 dies,
        # and rank 2 would not join it for a minute
        with pytest.raises(WorkerDiedError) as died:
            group.execute(_step(0, sleep=60), lambda message: handler({**message, "sleep": 0}))
        assert time.monotonic() - start < PROMPTLY
        assert str(died.value) == "tensor-parallel rank 1 died (killed by SIGKILL), during a step"
    finally:
        group.close()
    _assert_nothing_left()


def test_a_failing_handler_is_named_with_its_error(group):
    handler = SumHandler(0)
    group.execute(_step(0), handler)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 failed: ValueError: bad step 1"):
        group.execute(_step(1, **{"raise": "bad step 1"}), lambda m: handler(_step(1)))
    assert time.monotonic() - start < PROMPTLY
    with pytest.raises(WorkerDiedError, match="ValueError: bad step 1"):
        group.broadcast(_step(2))


def test_a_handler_that_cannot_be_built_fails_start_naming_rank_and_error():
    with pytest.raises(
        WorkerDiedError, match="rank 1 failed: ValueError: no shard 1, while building"
    ):
        WorkerGroup.start(2, CPU, make_failing_handler, ("no shard 1",))
    _assert_nothing_left()


def test_close_is_idempotent_and_a_new_group_starts_after_it():
    first = WorkerGroup.start(2, CPU, make_sum_handler)
    with pytest.raises(RuntimeError, match="close it before"):
        WorkerGroup.start(2, CPU, make_sum_handler)
    first.close()
    first.close()
    assert [p.exitcode for p in first.processes.values()] == [0]  # stopped, not killed
    _assert_nothing_left()
    with pytest.raises(RuntimeError, match="closed"):
        first.broadcast(_step(0))
    second = WorkerGroup.start(2, CPU, make_sum_handler)
    try:
        assert second.execute(_step(0), SumHandler(0)).tolist()[0] == 3
    finally:
        second.close()
    _assert_nothing_left()


def test_world_size_one_runs_only_rank_0():
    group = WorkerGroup.start(1, CPU, make_sum_handler)
    assert group.execute({"i": 0}, lambda message: message["i"] + 7) == 7
    group.close()
    _assert_nothing_left()


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_a_bad_world_size_is_refused(size):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size!r} must be an integer"):
        WorkerGroup.start(size, CPU, make_sum_handler)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 from cuda:1 needs GPUs 1..2, "):
        WorkerGroup.start(2, torch.device("cuda:1"), make_sum_handler)


def test_each_rank_gets_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "default_threads", lambda: 8)
    assert [rank_threads(n) for n in (1, 2, 3, 8, 9)] == [8, 4, 2, 1, 1]
    monkeypatch.undo()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the host's budget, shared
    assert rank_threads(2) == 1


def _rank0_script(mode: str) -> subprocess.Popen:
    """tests/tp_handlers.py as rank 0 with one spawned worker, in its own session so that a
    Ctrl-C can go to the whole process group, as a terminal sends it."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.tp_handlers", mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _worker_pids(rank0: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 60
    while not (pids := _children(rank0.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def _end(rank0: subprocess.Popen, workers: list[int]) -> None:
    """Kill what a failed test left, so that reading rank 0's pipes (which the workers
    inherited) ends."""
    for pid in [rank0.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rank0.communicate(timeout=30)


@pytest.mark.parametrize("mode", ["building", "idle"])
def test_workers_exit_when_rank_0_is_killed(mode):
    rank0, pids = _rank0_script(mode), []
    try:
        if mode == "idle":  # the worker waits for a message
            assert rank0.stdout.readline().startswith("pids")
        pids = _worker_pids(rank0)  # when building, only the parent watch can see rank 0 go
        assert pids
        time.sleep(0.5)
        rank0.kill()
        rank0.wait()
        assert _gone_within(pids, PROMPTLY)
    finally:
        _end(rank0, pids)


@pytest.mark.parametrize("mode, exit_codes", [("idle", "[0]"), ("mid-step", "[-9]")])
def test_ctrl_c_closes_the_group_and_leaves_no_worker(mode, exit_codes):
    rank0, pids = _rank0_script(mode), []
    try:
        assert rank0.stdout.readline().startswith("pids")
        pids = _worker_pids(rank0)
        time.sleep(0.5)
        os.killpg(rank0.pid, signal.SIGINT)
        out, err = rank0.communicate(timeout=30)
        assert "KeyboardInterrupt" in err
        # a worker's tqdm lock is no named semaphore, which one killed would leave behind
        assert "leaked semaphore" not in err
        # idle workers take the stop; ones left inside a collective are killed
        assert f"worker exit codes {exit_codes}" in out
        assert _gone_within(pids, PROMPTLY)
    finally:
        _end(rank0, pids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_from_the_environment(monkeypatch):
    """The torchrun path with its variables set by hand: rank 0 here hosts the store."""
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.tp_handlers", "idle"],
        env={**os.environ, **env, "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for name, value in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match="tensor_parallel_size=3, but torchrun started"):
            WorkerGroup.attach(3, CPU)
        group = WorkerGroup.attach(2, CPU)
        handler = SumHandler(0)
        assert [group.execute(_step(i), handler).tolist() for i in range(2)] == [
            [3, 2, rank_threads(1), 0],
            [6, 4, rank_threads(1), 0],
        ]
        group.close()
        assert worker.wait(timeout=30) == 0
        assert "rank 1" in worker.stdout.read() and not dist.is_initialized()
    finally:
        worker.kill()
        worker.communicate()


def test_torchrun():
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        + ["--master-port", str(_free_port()), "-m", "tests.tp_handlers", "steps"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr  # torchrun's, and so every rank's
    # from rank 0, before the other rank prints anything; torchrun sets OMP_NUM_THREADS=1
    assert run.stdout.startswith("pids\nsum [3, 2, 1, 0]\nsum [6, 4, 1, 0]\n")
