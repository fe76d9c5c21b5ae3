"""A tensor-parallel rank other than 0: its part of the model and its own model runner, which
runs every step's message (engine/step_message.py) beside rank 0's. It never samples: rank 0
does, and the tokens reach this rank in the next step's message like any other token.

`make_worker` is what worker/transport.py calls in each worker process (spawned on one host, or
started by torchrun on several)."""

import torch

from tinyllm.engine.step_message import SchedulerOutput
from tinyllm.engine.worker.model_runner import ModelRunner, RunnerSpec
from tinyllm.engine.worker.transport import WorkerGroup, torchrun_rank
from tinyllm.loaders.model_loader import LoadConfig, load_model
from tinyllm.model.tensor_parallel import apply_tp


class Worker:
    """Runs rank 0's messages: the runner's spec once (rank 0 sizes the KV pool), then steps."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.runner: ModelRunner | None = None

    def __call__(self, message: RunnerSpec | SchedulerOutput) -> None:
        if isinstance(message, RunnerSpec):
            self.runner = message.build(self.model, samples=False)
        else:
            self.runner.execute_model(message)


def make_worker(rank: int, world_size: int, device: torch.device, config: LoadConfig) -> Worker:
    """Load rank `rank`'s part of the model and make it sum its partial outputs with the
    other ranks'."""
    return Worker(apply_tp(load_model(config, device, rank, world_size).model))


def start_workers(
    world_size: int, device: torch.device, config: LoadConfig, threads: int | None
) -> WorkerGroup:
    """Ranks 1..N-1, each with its part of the model loaded: spawned on this host, or under
    torchrun (this process being rank 0) the ones torchrun started, which run `make_worker`
    through `tinyllm`'s command line. `threads`: each rank's (None: its share of the cores)."""
    if torchrun_rank() is not None:
        return WorkerGroup.attach(world_size, device, threads)
    return WorkerGroup.start(world_size, device, make_worker, (config,), threads)
