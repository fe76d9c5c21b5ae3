"""How a model's weights run: its activations' dtype and its linear layers' quantization, each
chosen for the device (and the file) when left to "auto", with the reason, for the log."""

import torch

from tinyllm.model.choices import DTYPE_NAMES, QUANTIZATIONS
from tinyllm.model.cpu_library import library_error

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def amx() -> bool:
    """Whether this CPU has AMX tiles, where bf16 matrix products run several times faster than
    fp32. With AVX512-BF16 alone they measured slower than fp32 (docs/MEASUREMENTS.md, "Weight
    formats")."""
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


def resolve_quantization(mode: str, file_bits: set[int], device: torch.device) -> tuple[str, str]:
    """The quantization to run and why. "auto" on CPU runs a GGUF's 4-bit weights in int4 and
    its 8-bit ones in int8 (`file_bits`: the bits its linear weights are stored in), and
    anything else dense; on other devices, or without tinyllm's CPU kernels, dense."""
    if mode not in ("auto", *QUANTIZATIONS):
        raise ValueError(f"quantization={mode!r}: choose auto or one of {', '.join(QUANTIZATIONS)}")
    if mode == "none":
        return mode, "as asked"
    if device.type != "cpu":
        if mode != "auto":
            raise ValueError(
                f"quantization={mode!r} runs on CPU only (tinyllm's C++ kernels); "
                f"use quantization='none' on {device.type}"
            )
        return "none", f"dense weights on {device.type}"
    if error := library_error():
        if mode != "auto":
            raise ValueError(
                f"quantization={mode!r} needs tinyllm's CPU kernels, which did not build "
                f"({error}); use quantization='none'"
            )
        return "none", f"tinyllm's CPU kernels did not build: {error}"
    if mode != "auto":
        return mode, "as asked"
    if 4 in file_bits:
        return "int4", "the file's weights are 4-bit"
    if 8 in file_bits:
        return "int8", "the file's weights are 8-bit"
    return "none", "the checkpoint's weights are not 4- or 8-bit"


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> tuple[torch.dtype, str]:
    """The activations' dtype and why: bf16 on CUDA and on a CPU with AMX; fp32 elsewhere.
    Quantized weights take either: their kernel quantizes the activations to int8 itself."""
    if isinstance(dtype, torch.dtype):
        return dtype, "as asked"
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)} or 'auto'")
        return DTYPES[dtype], "as asked"
    if device.type == "cuda":
        return torch.bfloat16, "on CUDA"
    if amx():
        return torch.bfloat16, "this CPU has AMX for bf16 matrix products"
    return torch.float32, "without AMX, fp32 matrix products are the fastest"
