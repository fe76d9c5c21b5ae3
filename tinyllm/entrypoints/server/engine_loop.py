"""One thread drives the engine; HTTP handlers talk to it only through queues.

The engine is not thread-safe, so every add_request, abort and step happens on this thread.
Handlers put commands on a thread-safe queue; outputs go back on each HTTP request's asyncio
queue, handed over with `loop.call_soon_threadsafe`. If the thread dies, every waiting handler
gets an error instead of hanging, and later requests are refused.
"""

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.entrypoints.server.errors import APIError, EngineDeadError
from tinyllm.entrypoints.server.metrics import ServerMetrics

log = logging.getLogger("tinyllm.server")


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per choice), on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[list[RequestOutput] | APIError] = asyncio.Queue()

    def put(self, item: list[RequestOutput] | APIError) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def get(self) -> list[RequestOutput]:
        """Every output that has arrived, in order, waiting for at least one. Outputs are
        deltas: each holds only what is new since the request's previous one."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        outputs = []
        for item in items:
            if isinstance(item, APIError):
                raise item
            outputs += item
        return outputs


@dataclass
class _Tracked:
    stream: RequestStream
    arrival: float
    first_token: float | None = None
    num_tokens: dict[int, int] = field(default_factory=dict)  # per completion (n > 1)
    reasons: dict[int, str] = field(default_factory=dict)  # finish reason per completion

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.num_tokens[c.index] = self.num_tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.reasons[c.index] = c.finish_reason


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        # Held while deciding to enqueue, and while the thread shuts down: no command can slip
        # into the queue after the last drain and wait forever.
        self._lock = threading.Lock()
        self.error: str | None = "not started"  # why requests are refused; None while running

    @property
    def alive(self) -> bool:
        return self.error is None

    def start(self) -> None:
        self.error = None
        self._thread = threading.Thread(target=self._run, name="tinyllm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout)

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestStream:
        """Queue engine requests (request_id, prompt token ids, params); they all report to the
        one stream returned. Call from the event loop that reads it."""
        stream = RequestStream(asyncio.get_running_loop())
        now = time.monotonic()
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(self.error)
            for request_id, token_ids, params in requests:
                self._commands.put(("add", request_id, token_ids, params, stream, now))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._commands.put(("abort", request_id))

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefix blocks, on the engine thread; how many."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(self.error)
            self._commands.put(("reset_prefix_cache", loop, done))
        return await done

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            running = self._handle_commands(block=True)
            while running:
                # Commands run between steps; the engine's run goes on while it has work.
                for outputs in self._steps():
                    self._publish(outputs)
                    running = self._handle_commands(block=False)
                    if not running:
                        break
                else:  # idle: what the commands did (an abort, a refused add) shows in stats
                    self._publish([])
                    running = self._handle_commands(block=True)
        except Exception as e:
            log.exception("the engine loop died")
            self._shut_down(f"the engine loop died ({type(e).__name__}: {e})")
            return
        self.engine.abort_all()  # leave the engine clean for whoever owns it next
        ended = self._shut_down("the server is shutting down")
        if ended:
            log.info("shutting down: %d request(s) still running end with an error", ended)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        # Metrics first: a client that got its last token sees them already counted.
        self.metrics.record_stats(self.engine.stats())
        self._deliver(outputs)

    def _steps(self) -> Iterator[list[RequestOutput]]:
        """The engine's steps while it has work. The engine ends a request whose work fails
        with an error output; an exception that still escapes a step (a fault outside any one
        request's work) fails every request in the engine with a 500 and ends this run, and
        the server goes on serving new ones."""
        try:
            yield from self.engine.outputs()
        except Exception as e:
            log.exception(
                "an engine step failed: failing the %d request(s) in it", len(self._tracked)
            )
            error = APIError(500, f"the engine failed: {type(e).__name__}: {e}")
            for tracked in self._tracked.values():
                tracked.stream.put(error)
            self._tracked.clear()
            self.engine.abort_all()
            # The engine cannot step again (a tensor-parallel rank died), or its queues no
            # longer match its requests: the loop ends and /health says why.
            if not self.engine.alive or self.engine.has_unfinished():
                raise

    def _handle_commands(self, block: bool) -> bool:
        """Run the queued commands, waiting for one first when the engine is idle. False: stop."""
        commands = [self._commands.get()] if block else []
        while not self._commands.empty():
            commands.append(self._commands.get_nowait())
        running = True
        for command in commands:
            match command:
                case ("add", request_id, token_ids, params, stream, arrival):
                    self._add(request_id, token_ids, params, stream, arrival)
                case ("abort", request_id):
                    self._abort(request_id)
                case ("reset_prefix_cache", loop, done):
                    _settle(loop, done, self.engine.reset_prefix_cache())
                case ("stop",):
                    running = False
        return running

    def _add(self, request_id, token_ids, params, stream: RequestStream, arrival: float) -> None:
        try:
            self.engine.add_request(token_ids, params, request_id=request_id)
        except ValueError as e:  # the handler checks first; the engine has the last word
            stream.put(APIError(400, str(e)))
            return
        except Exception as e:  # one bad request must not take everyone's engine down
            log.exception("add_request(%s) failed", request_id)
            stream.put(APIError(500, f"could not add the request: {type(e).__name__}: {e}"))
            return
        self._tracked[request_id] = _Tracked(stream, arrival)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        out = self.engine.abort(request_id)
        if tracked is not None and out is not None:
            tracked.add(out)
            self._record_finished(tracked, time.monotonic())

    def _record_finished(self, tracked: _Tracked, now: float) -> None:
        """Each completion is a finished request to the metrics (n > 1 counts n)."""
        for i, reason in tracked.reasons.items():
            tokens = tracked.num_tokens.get(i, 0)
            self.metrics.record_finished(reason, tokens, tracked.arrival, tracked.first_token, now)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        by_stream: dict[RequestStream, list[RequestOutput]] = {}
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if tracked.first_token is None and any(c.token_ids for c in out.outputs):
                tracked.first_token = now
                self.metrics.ttft.observe(now - tracked.arrival)
            tracked.add(out)
            if out.finished:
                del self._tracked[out.request_id]
                self._record_finished(tracked, now)
            by_stream.setdefault(tracked.stream, []).append(out)
        for stream, outs in by_stream.items():
            stream.put(outs)

    def _shut_down(self, why: str) -> int:
        """Refuse what comes next and fail every request waiting; how many HTTP requests."""
        with self._lock:
            self.error = why
        streams = {t.stream for t in self._tracked.values()}
        self._tracked.clear()
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if command[0] == "add":
                streams.add(command[4])
            elif command[0] == "reset_prefix_cache":
                _settle(command[1], command[2], EngineDeadError(why))
        for stream in streams:
            stream.put(EngineDeadError(why))
        return len(streams)


def _settle(loop: asyncio.AbstractEventLoop, done: asyncio.Future, result: object) -> None:
    """Hand a command's result (or exception) to the handler awaiting it on its event loop."""

    def settle() -> None:
        if done.cancelled():  # the client went away
            return
        if isinstance(result, BaseException):
            done.set_exception(result)
        else:
            done.set_result(result)

    with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
        loop.call_soon_threadsafe(settle)
