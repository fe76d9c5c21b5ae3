"""Tensor-parallel worker processes: start them, send each step to them, notice when one dies.

The engine's process is rank 0. Ranks 1..N-1 are workers: each builds a handler once (its model
shard and runner) and then calls it on every object rank 0 broadcasts, in order, until rank 0
says stop. What the object is, and what the handlers do with it, is not this module's concern;
the handlers' own collectives (the model's all-reduces) keep the ranks in lock-step.

Two process groups: the default one (gloo on CPU, NCCL on CUDA) belongs to the handlers'
collectives, with a timeout; a gloo group carries the messages, because a worker waits on it
for as long as the engine is idle, and NCCL cannot send pickled objects without a device copy.

How death is seen. A process that dies closes its sockets, so a gloo send, receive or
all-reduce waiting on it fails at once ("Connection closed by peer"), and a worker whose own
collective fails exits too. Only the ranks waiting on the dead one notice, though: so when a
worker it spawned exits unasked, rank 0 kills the others, and its own collective fails. Rank 0
names the dead rank from its exit code (ranks it spawned) and from the error text that a
failing worker leaves in the store before it exits (any rank, torchrun too). A worker whose
parent exits notices within half a second (its parent pid changes) and exits. `check()` reads
exit codes and posted errors without waiting, for a health check.

On one host `WorkerGroup.start` spawns the workers. Under torchrun every rank is started by
torchrun: ranks other than 0 call `run_worker`, rank 0 calls `WorkerGroup.attach`.
"""

import atexit
import datetime
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from tinyllm.host.threads import rank_threads, set_threads
from tinyllm.host.torchrun import torchrun_rank

# How long a handler's collective, or rank 0's send, may wait for a live peer before failing.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
# A worker waits for the next message for as long as the engine sits idle.
_IDLE_FOREVER = datetime.timedelta(days=3650)
# A stop sent to idle workers arrives at once; one that does not was sent to workers stuck in
# a collective that rank 0 left (Ctrl-C mid-step), which only killing ends.
_STOP_SEND_S = 1.0
_EXIT_WAIT_S = 5.0
# After a failed collective: how long the dead rank may take to become visible as dead.
_DIAGNOSE_S = 1.0
_POLL_S = 0.02
_PARENT_POLL_S = 0.5
_KEY = "tinyllm/tp/{what}/{rank}"
_STOP = 0  # a message length; any pickled object is longer
_LENGTH = 8  # bytes of the int64 length at the head of each message
_INLINE = 16 * 1024  # bytes of a message sent in the same broadcast as its length


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or failed; `reasons` maps each such rank to why."""

    def __init__(self, reasons: dict[int, str], while_doing: str = ""):
        self.reasons = dict(sorted(reasons.items()))
        text = "; ".join(f"tensor-parallel rank {r} {why}" for r, why in self.reasons.items())
        super().__init__(", ".join(part for part in (text, while_doing) if part))


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device a rank uses: rank 0 the engine's, the next ranks the next GPUs."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def check_world_size(world_size: int, device: torch.device) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size={world_size!r} must be an integer >= 1")
    if device.type == "cuda":
        first, visible = device.index or 0, torch.cuda.device_count()
        if first + world_size > visible:
            raise ValueError(
                f"tensor_parallel_size={world_size} from {device} needs GPUs {first}.."
                f"{first + world_size - 1}, but {visible} CUDA device(s) are visible"
            )


def run_worker(
    device: torch.device, make_handler: Callable, args: tuple = (), threads: int | None = None
) -> None:
    """The body of a rank other than 0 under torchrun: join the group from the environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), build the handler and serve
    rank 0's messages until it stops. Exits the process if anything fails."""
    rank = torchrun_rank()
    if not rank:
        raise ValueError(f"run_worker is for ranks other than 0 under torchrun; RANK={rank}")
    world_size, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    threads = threads or rank_threads(world_size)
    device = rank_device(torch.device(device), local_rank)
    _exit_with_parent(os.getppid())
    _serve(_env_store(rank, world_size), rank, world_size, device, threads, make_handler, args)


class WorkerGroup:
    """Rank 0's handle on the workers. `threads` is each rank's thread count, which the workers
    have applied; rank 0 applies it itself (the engine sets threads before loading weights)."""

    def __init__(self, world_size: int, threads: int, timeout: datetime.timedelta):
        self.world_size = world_size
        self.threads = threads
        self.processes: dict[int, mp.Process] = {}  # by rank; empty under torchrun
        self._store = None
        self._timeout = timeout
        self._messages = None
        self._failure: str | None = None  # why the group cannot take another message
        self._killed: set[int] = set()  # workers rank 0 killed because another one died
        self._closed = False

    @classmethod
    def start(
        cls,
        world_size: int,
        device: torch.device,
        make_handler: Callable,
        args: tuple = (),
        threads: int | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> "WorkerGroup":
        """Spawn ranks 1..N-1 on this host and make this process rank 0. Each worker calls
        `make_handler(rank, world_size, device, *args)` (importable, its args picklable) with
        the device it runs on, then `handler(obj)` for each broadcast. Returns once every
        handler is built; a worker that fails to build one is a WorkerDiedError naming it.
        world_size 1 starts nothing."""
        device = torch.device(device)
        check_world_size(world_size, device)
        group = cls(world_size, threads or rank_threads(world_size), timeout)
        if world_size == 1:
            return group
        group._claim_default_group()
        spawn = mp.get_context("spawn")
        try:
            group._store = dist.TCPStore(
                "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout
            )
            for rank in range(1, world_size):
                work = (rank, world_size, group._store.port, rank_device(device, rank))
                setup = (group.threads, make_handler, args, timeout, os.getpid())
                process = spawn.Process(target=_spawned, args=work + setup, name=f"tp-rank{rank}")
                process.start()
                group.processes[rank] = process
            watch = threading.Thread(target=group._end_with_first_death, daemon=True)
            watch.start()
            group._join(rank_device(device, 0))
        except BaseException:
            group.close()
            raise
        return group

    @classmethod
    def attach(
        cls,
        world_size: int,
        device: torch.device,
        threads: int | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> "WorkerGroup":
        """Rank 0 under torchrun: join the ranks torchrun started (they call `run_worker`)."""
        rank, started = torchrun_rank(), os.environ.get("WORLD_SIZE")
        if rank != 0:
            raise ValueError(f"attach is for rank 0 under torchrun; RANK={rank}")
        device = torch.device(device)
        check_world_size(world_size, device)
        if int(started) != world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size}, but torchrun started WORLD_SIZE={started} "
                "processes: give torchrun one process per rank"
            )
        group = cls(world_size, threads or rank_threads(world_size), timeout)
        group._claim_default_group()
        try:
            group._store = _env_store(0, world_size, timeout)
            group._join(rank_device(device, int(os.environ.get("LOCAL_RANK", 0))))
        except BaseException:
            group.close()
            raise
        return group

    def broadcast(self, obj) -> None:
        """Every worker runs handler(obj), after the messages before it. Raises
        WorkerDiedError if a worker is dead or dies while this is sent."""
        if self.processes:  # their exit codes cost nothing to read; a rank elsewhere fails the send
            self.check()
        elif self._failure:
            raise RuntimeError(f"this tensor-parallel group cannot continue: {self._failure}")
        if self._closed:
            raise RuntimeError("this tensor-parallel group is closed")
        if self.world_size == 1:
            return
        try:
            _send(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)), self._messages)
        except Exception as e:
            raise self._failed(e, "while rank 0 sent a message") from e

    def execute(self, obj, local: Callable):
        """Broadcast obj, then return local(obj) here on rank 0. When local fails because a
        worker died (its collective lost the peer), the error is a WorkerDiedError naming it."""
        self.broadcast(obj)
        try:
            return local(obj)
        except Exception as e:
            self._failure = f"rank 0 failed mid-step ({type(e).__name__}: {e})"
            reasons = self._reasons(wait_s=_DIAGNOSE_S)
            if reasons:
                raise WorkerDiedError(reasons, "during a step") from e
            raise

    def check(self) -> None:
        """Raise WorkerDiedError if a worker has died or failed; returns at once."""
        if self._closed:
            return
        reasons = self._reasons()
        if reasons:
            self._failure = "a worker died"
            raise WorkerDiedError(reasons)
        if self._failure:
            raise RuntimeError(f"this tensor-parallel group cannot continue: {self._failure}")

    def close(self) -> None:
        """Stop the workers, wait a few seconds for them, kill what is left, and leave the
        process group so another WorkerGroup can start. Idempotent; also runs at exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        stopped = False
        if self._messages is not None and not self._failure and not self._reasons():
            try:
                _send(bytearray(), self._messages, timeout=_STOP_SEND_S)
                stopped = True
            except Exception:
                pass
        deadline = time.monotonic() + (_EXIT_WAIT_S if stopped else 0)
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
            process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._messages = self._store = None

    def _claim_default_group(self) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed group (another WorkerGroup "
                "that is not closed?): close it before starting tensor-parallel workers"
            )
        atexit.register(self.close)

    def _join(self, device: torch.device) -> None:
        """Rank 0's half of `_serve`: the same group calls, in the same order. Waits for
        spawned workers in steps that see them die and that Ctrl-C can interrupt."""
        if self.processes:
            self._await("joined", "while starting")
        _init_group(self._store, 0, self.world_size, device, self._timeout)
        self._messages = dist.new_group(backend="gloo", timeout=self._timeout)
        if self.processes:
            self._await("built", "while building its handler")
        failures: list = [None] * self.world_size
        try:
            dist.all_gather_object(failures, None, group=self._messages)
        except Exception as e:
            raise self._failed(e, "while building its handler") from e
        built = {r: f"failed: {why}" for r, why in enumerate(failures) if why}
        if built:
            self._failure = "a worker failed to start"
            raise WorkerDiedError(built, "while building its handler")

    def _end_with_first_death(self) -> None:
        """Rank 0's thread: once a spawned worker exits unasked, kill the others. gloo fails a
        collective at once only where it waits on the dead peer itself; a rank waiting on a
        live one (which waits on the dead one, or computes) would hold the others."""
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        dead = {sentinels[s] for s in multiprocessing.connection.wait(list(sentinels))}
        if self._closed:
            return
        for rank, process in self.processes.items():
            if rank not in dead and process.exitcode is None:
                self._killed.add(rank)
                process.kill()

    def _await(self, what: str, while_doing: str) -> None:
        """Wait for every spawned worker to post `what`, failing as soon as one dies."""
        waiting = set(self.processes)
        while waiting:
            waiting -= {r for r in waiting if self._store.check([_KEY.format(what=what, rank=r)])}
            reasons = self._reasons()
            if reasons:
                raise WorkerDiedError(reasons, while_doing)
            time.sleep(_POLL_S)

    def _reasons(self, wait_s: float = 0.0) -> dict[int, str]:
        """Why each dead or failed rank stopped, from the errors posted in the store and the
        exit codes of spawned workers; waits up to wait_s for a first one."""
        deadline = time.monotonic() + wait_s
        while True:
            reasons = {}
            for rank in range(1, self.world_size):
                process = self.processes.get(rank)
                if process is not None and process.exitcode is None:
                    continue  # a failing worker posts its error before it exits
                error = _KEY.format(what="error", rank=rank)
                if self._store is not None and self._store.check([error]):
                    reasons[rank] = "failed: " + self._store.get(error).decode()
                elif rank in self._killed:
                    continue  # a consequence, not a cause
                elif process is not None:
                    reasons[rank] = _exit_reason(process.exitcode)
            if reasons or time.monotonic() >= deadline:
                return reasons
            time.sleep(_POLL_S)

    def _failed(self, error: Exception, while_doing: str) -> WorkerDiedError:
        self._failure = f"{type(error).__name__}: {error}"
        reasons = self._reasons(wait_s=_DIAGNOSE_S)
        if not reasons:  # a rank on another host, gone without a word: gloo says which peer
            return WorkerDiedError({}, f"tensor-parallel group failed {while_doing}: {error}")
        return WorkerDiedError(reasons, while_doing)


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"died (killed by {signal.Signals(-code).name})"
    return f"died (exited with code {code})"


def _env_store(rank: int, world_size: int, timeout=DEFAULT_TIMEOUT) -> dist.TCPStore:
    """The store at MASTER_ADDR:MASTER_PORT. torchrun's agent may already host it there
    (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 does."""
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not hosted,
        wait_for_workers=False,
        timeout=timeout,
    )


def _init_group(store, rank: int, world_size: int, device: torch.device, timeout) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _send(payload: bytearray, group, timeout: float | None = None) -> None:
    """Broadcast from rank 0 one buffer holding the length (0 means stop) and the first
    _INLINE bytes, then the rest if any: most steps take one round trip, not two."""
    head = torch.zeros(_LENGTH + _INLINE, dtype=torch.uint8)
    head[:_LENGTH].view(torch.int64)[0] = len(payload)
    inline = min(len(payload), _INLINE)
    if inline:
        head[_LENGTH : _LENGTH + inline] = torch.frombuffer(payload[:inline], dtype=torch.uint8)
    works = [dist.broadcast(head, src=0, group=group, async_op=True)]
    if len(payload) > _INLINE:
        rest = torch.frombuffer(payload[_INLINE:], dtype=torch.uint8)
        works.append(dist.broadcast(rest, src=0, group=group, async_op=True))
    for work in works:
        work.wait(datetime.timedelta(seconds=timeout)) if timeout else work.wait()


def _receive(group):
    """The next message from rank 0, or _STOP."""
    head = torch.empty(_LENGTH + _INLINE, dtype=torch.uint8)
    dist.broadcast(head, src=0, group=group)
    length = int(head[:_LENGTH].view(torch.int64).item())
    if length == _STOP:
        return _STOP
    payload = head[_LENGTH : _LENGTH + min(length, _INLINE)].numpy().tobytes()
    if length > _INLINE:
        rest = torch.empty(length - _INLINE, dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=group)
        payload += rest.numpy().tobytes()
    return pickle.loads(payload)


def _spawned(rank, world_size, port, device, threads, make_handler, args, timeout, parent):
    """A spawned worker's entry point: connect to rank 0's store and serve."""
    _exit_with_parent(parent)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, wait_for_workers=False, timeout=timeout
    )
    _serve(store, rank, world_size, device, threads, make_handler, args, timeout)


def _serve(store, rank, world_size, device, threads, make_handler, args, timeout=DEFAULT_TIMEOUT):
    """A worker's life: join, build the handler, run it on each message, stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides what Ctrl-C stops
    # tqdm's default lock (its bars: loading the weights) is a named semaphore, which a worker
    # that leaves through _exit or is killed never unlinks: the resource tracker then warns of
    # a leak at shutdown. A worker's bars are its own process's alone: a thread lock does.
    tqdm.set_lock(threading.RLock())
    set_threads(threads)
    store.set(_KEY.format(what="joined", rank=rank), "")
    _init_group(store, rank, world_size, device, timeout)
    messages = dist.new_group(backend="gloo", timeout=_IDLE_FOREVER)
    failure = None
    try:
        handler = make_handler(rank, world_size, device, *args)
    except Exception as e:
        traceback.print_exc()
        failure = f"{type(e).__name__}: {e}"
        store.set(_KEY.format(what="error", rank=rank), failure)
    store.set(_KEY.format(what="built", rank=rank), "")
    failures: list = [None] * world_size
    dist.all_gather_object(failures, failure, group=messages)
    if any(failures):
        _exit(1 if failure else 0)
    while True:
        try:
            obj = _receive(messages)
        except Exception as e:
            print(f"tensor-parallel rank {rank}: lost rank 0's messages: {e}", file=sys.stderr)
            _exit(1)
        if obj is _STOP:
            break
        try:
            handler(obj)
        except Exception as e:
            traceback.print_exc()
            store.set(_KEY.format(what="error", rank=rank), f"{type(e).__name__}: {e}")
            _exit(1)
    dist.destroy_process_group()


def _exit(code: int) -> None:
    """Leave now: a broken group's teardown or an interpreter exit that joins threads could
    block, and there is nothing to save."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent(parent: int) -> None:
    """A daemon thread that ends this process once `parent` is no longer its parent (it
    exited and the orphan was adopted), checking at once: it may have gone already."""

    def watch():
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        _exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
