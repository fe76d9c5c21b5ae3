"""The baseline: Hugging Face transformers on the same weights in fp32, static batches of 16
left-padded prompts; what a user gets without an inference engine."""

import importlib.util
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from tinyllm.entrypoints.bench.report import Run, measured
from tinyllm.entrypoints.workloads import Request
from tinyllm.loaders.source import resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BASELINE_BATCH = 16
INSTALL_BASELINE = "pip install -e '.[test]'"


def load_transformers(model: str | None, device: torch.device) -> "PreTrainedModel":
    """The same weights through transformers, fp32 (the loaded GGUF is dequantized)."""
    missing = [
        m for m in ("transformers", "accelerate", "gguf") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise ValueError(
            f"the transformers baseline needs {', '.join(missing)}: install it with "
            f"`{INSTALL_BASELINE}`, or pass --baseline none"
        )
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf.to(device).eval()


def _hf_generate(hf: "PreTrainedModel", batch: list[Request]) -> None:
    L = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.zeros(len(batch), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, L - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, L - n :] = 1
    # A static batch runs until its longest request is done; the rest is wasted work.
    n_new = max(r.max_tokens for r in batch)
    dev = hf.device
    hf.generate(
        input_ids=ids.to(dev),
        attention_mask=mask.to(dev),
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        do_sample=False,
        pad_token_id=0,
    )


def run_transformers(
    hf: "PreTrainedModel", requests: list[Request], batch_size: int = BASELINE_BATCH
) -> Run:
    """Static batches of `batch_size` (one at a time: 1), each request making max_tokens tokens
    (EOS ignored)."""
    _hf_generate(hf, [Request(requests[0].prompt_token_ids, 2)])
    bar = tqdm(total=len(requests), desc="transformers", unit="req")
    t = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        _hf_generate(hf, batch)
        bar.update(len(batch))
    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)
    seconds = time.perf_counter() - t
    bar.close()
    return measured("transformers", requests, seconds)
