"""gpt-oss's experts as its Hugging Face checkpoints store them, under the model's per-expert
names (model/moe.py's `experts.E.gate_proj` etc., which loaders/sharding.py stacks and splits):
one tensor per layer and kind for all experts, `mlp.experts.gate_up_proj` (experts, hidden,
2F) with gate and up interleaved (gate in the even columns), `down_proj` (experts, F, hidden),
their biases `*_bias`, or in MXFP4 (quant_method mxfp4) `*_blocks` and `*_scales` with the
output rows first (loaders/mxfp4.py). Each expert is read from the file's map on its own.
"""

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from tinyllm.loaders.mxfp4 import hf_codes, mxfp4_groups
from tinyllm.loaders.stored import ALL, StoredTensor, Weight
from tinyllm.model.config import ModelLoadError

STACKED_EXPERTS = re.compile(
    r"(?P<layer>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>_bias|_blocks|_scales)?"
)
ROUTER = re.compile(r"\.mlp\.router\.")  # gpt-oss's router is the model's `mlp.gate`


class StackedExpert(StoredTensor):
    """Expert `expert`'s `part` ("gate", "up" or "down") of a stacked tensor, weight or bias,
    as the model's nn.Linear holds it: (out, in) weights, (out,) biases. MXFP4 weights read as
    8-bit groups (exact), dense ones in `dtype`."""

    def __init__(
        self, file: safe_open, path: Path, name: str, expert: int, part: str, dtype: torch.dtype
    ) -> None:
        self.file, self.path, self.name, self.expert, self.part = file, path, name, expert, part
        self.dtype = dtype
        self.mxfp4 = name.endswith("_blocks")
        self.bias = name.endswith("_bias")
        shape = file.get_slice(name).get_shape()[1:]
        if self.mxfp4:  # (out, groups, 16): in = groups * 32
            out, inputs = shape[0], shape[1] * 32
        elif self.bias:
            out, inputs = shape[0], None
        else:  # (in, out): transposed
            inputs, out = shape
        out //= 2 if part != "down" else 1
        self.shape = (out,) if inputs is None else (out, inputs)

    def _rows(self) -> slice:
        """The part's rows of the stored expert's output rows: gate and up interleaved."""
        return slice({"gate": 0, "up": 1}[self.part], None, 2) if self.part != "down" else ALL

    def _whole(self) -> Weight:
        try:
            stored = self.file.get_slice(self.name)[self.expert]
            if self.mxfp4:
                scales = self.file.get_slice(self.name.replace("_blocks", "_scales"))
                codes = hf_codes(stored[self._rows()])
                return mxfp4_groups(codes, scales[self.expert][self._rows()])
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {self.path}: {e}") from e
        w: Tensor = stored[self._rows()] if self.bias else stored.T[self._rows()]
        return w.contiguous().to(self.dtype)

    def read(self, rows: slice = ALL, cols: slice = ALL) -> Weight:
        w = self._whole()
        if self.mxfp4:
            return w.map_rows(lambda t: t[rows].contiguous()).columns(cols)
        return w[rows] if w.dim() == 1 else w[rows, cols].contiguous()


def stacked_expert_tensors(
    file: safe_open, path: Path, name: str, num_experts: int, dtype: torch.dtype
) -> dict[str, StackedExpert]:
    """The per-expert tensors, by the model's names, of the stacked tensor `name` (a
    STACKED_EXPERTS match); none for MXFP4 scales, which their blocks read."""
    m = STACKED_EXPERTS.fullmatch(name)
    kind = m["kind"] or ""
    if kind == "_scales":
        return {}
    suffix = "bias" if kind == "_bias" else "weight"
    parts = ("gate", "up") if m["proj"] == "gate_up_proj" else ("down",)
    return {
        f"{m['layer']}.{e}.{part}_proj.{suffix}": StackedExpert(file, path, name, e, part, dtype)
        for e in range(num_experts)
        for part in parts
    }
