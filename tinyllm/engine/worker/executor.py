"""Runs a step's message on every rank: rank 0's model runner, here, and under tensor
parallelism the other ranks' beside it (transport.py, tp_worker.py).

A step that fails is run again request by request, so a failure ends only the requests it
concerns. A failed tensor-parallel step is different: some ranks may be inside a collective
that the others left, so no later step could be trusted to pair them up again, and the
executor is dead from then on (`dead` says why).
"""

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tinyllm.engine.step_message import ModelRunnerOutput, SchedulerOutput
from tinyllm.engine.worker.model_runner import RunnerSpec
from tinyllm.model.llama import Transformer

if TYPE_CHECKING:  # torch.distributed's import is for tensor-parallel runs only
    from tinyllm.engine.worker.transport import WorkerGroup

log = logging.getLogger("tinyllm")


class Executor:
    def __init__(
        self, model: Transformer, spec: RunnerSpec, workers: "WorkerGroup | None" = None
    ) -> None:
        """`workers`: under tensor parallelism, the other ranks (`model` is rank 0's part);
        each builds its runner from the same spec."""
        self.runner = spec.build(model)
        self.workers = workers
        if workers is not None:
            workers.broadcast(spec)
        # Why no other step can run (a tensor-parallel rank died or the ranks went out of
        # step); None while one can.
        self.dead: str | None = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step on every rank; rank 0's runner samples."""
        if self.workers is None:
            return self.runner.execute_model(out)
        # Rank 0 builds its batch first: a failure there stops the step before any rank starts.
        batch = self.runner.prepare_inputs(out)
        try:
            return self.workers.execute(out, lambda msg: self.runner.execute_batch(batch, msg))
        except Exception as e:
            self.dead = f"a tensor-parallel step failed ({type(e).__name__}: {e})"
            raise

    def execute_each(
        self, out: SchedulerOutput
    ) -> Iterator[tuple[SchedulerOutput, ModelRunnerOutput | None]]:
        """Run the step; if it fails, each of its requests alone, until every request has run
        or failed by itself. Yields each part that ran with its output, and each request that
        failed alone with None (logged). A dead executor's failure is raised."""
        try:
            result = self.execute(out)
        except Exception:
            if self.dead is not None:
                raise
            if len(out.num_scheduled_tokens) == 1:
                [req_id] = out.num_scheduled_tokens
                log.exception("request %s failed in a step", req_id)
                yield out, None
                return
            for req_id in out.num_scheduled_tokens:
                yield from self.execute_each(out.only(req_id))
            return
        yield out, result

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.close()
