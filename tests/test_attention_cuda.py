"""The CUDA attention backend: loads anywhere or says why not; on a GPU, matches the reference.

The GPU cases are the device check's (benchmarks/cuda_attention_check.py): random batches of
decode and prefill rows over scattered blocks, unused cache slots NaN."""

import subprocess
import sys

import pytest
import torch

from benchmarks.cuda_attention_check import BATCH_KINDS, CASES, error_ratio
from tinyllm.model.attention.cuda import load_cuda_backend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_imports_and_loads_without_triton():
    """With triton unimportable, the module still imports and the loader reports, not raises."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now fails
        "from tinyllm.model.attention.cuda import load_cuda_backend\n"
        "backend, why = load_cuda_backend(); print(backend is None, why)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, why = run.stdout.strip().split(" ", 1)
    assert loaded == "True"
    assert ("CUDA" if not torch.cuda.is_available() else "triton") in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_the_loader_says_so():
    backend, why = load_cuda_backend()
    assert backend is None and "CUDA" in why


@needs_cuda
@pytest.mark.parametrize(("dtype", "block_size", "heads"), CASES)
@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_matches_reference(dtype, block_size, heads, kind):
    backend, why = load_cuda_backend()
    assert backend is not None, why
    _, ratio = error_ratio(backend, dtype, block_size, heads, kind, BATCH_KINDS.index(kind))
    assert ratio <= 1
