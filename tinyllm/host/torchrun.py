"""What torchrun tells each process it starts, through the environment: its rank, and how many
ranks share its host."""

import os


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or anything that sets RANK and WORLD_SIZE) started
    it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def ranks_on_host(world_size: int) -> int:
    """The ranks on this host: torchrun's LOCAL_WORLD_SIZE, else all `world_size` of them (the
    workers spawned here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
