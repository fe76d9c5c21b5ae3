"""Choosing an attention backend by name or by device."""

import logging

import torch

from tinyllm.model.attention.backend import AttentionBackend
from tinyllm.model.attention.reference import ReferenceBackend
from tinyllm.model.choices import ATTENTION_BACKENDS as BACKENDS

log = logging.getLogger("tinyllm")


def get_backend(
    name: str, device: torch.device, sliding_window: int | None = None
) -> AttentionBackend:
    """`auto`: the in-place backend for the device if it loads here and runs the model's
    `sliding_window` (ModelConfig's), else the reference (with a warning saying why). Naming a
    backend that cannot run here, or cannot run the model, is an error."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "reference":
        return ReferenceBackend()
    wanted = name if name != "auto" else device.type
    if wanted not in ("cpu", "cuda"):
        return ReferenceBackend()
    if wanted != device.type:
        raise ValueError(f"attention_backend={name!r} cannot run on device {device.type!r}")
    if wanted == "cpu":
        from tinyllm.model.attention.cpu import load_cpu_backend as load
    else:
        from tinyllm.model.attention.cuda import load_cuda_backend as load
    backend, why = load()
    if backend is not None and sliding_window is not None and not backend.supports_sliding_window:
        why = f"the {wanted} backend has no sliding window, and the model sets {sliding_window=}"
        backend = None
    if backend is not None:
        return backend
    if name != "auto":
        raise ValueError(f"the {name} attention backend is not available here: {why}")
    log.warning("attention: using the reference backend (%s)", why)
    return ReferenceBackend()
