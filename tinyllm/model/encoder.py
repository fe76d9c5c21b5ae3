"""What every encoder family (model/bert.py, model/nomic_bert.py) shares: attention within each
prompt of the step's flat batch, the activations, and the model's interface beside the
decoders' (dtype, device, load_weights, set_layer_executor) with a cross-encoder's classify.

An encoder's prompt arrives whole in one step (the scheduler never chunks one), so its tokens
attend to all of its own tokens and to no other prompt's, and it keeps no K/V: it ignores
ctx.kv_caches and reads only where each prompt's tokens are (ctx.meta). It returns the final
hidden states; the pooler (the engine's) reads them.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig
from tinyllm.model.layers import assign_weights

# ModelConfig.hidden_act -> the function (transformers' ACT2FN of the same names).
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


class Segments:
    """Where each prompt of a step lies in the flat batch, for attention within it: `index`
    (R, L) each prompt's token rows padded to the longest L, `valid` (R, L) which are real."""

    def __init__(self, ctx: ForwardContext, device: torch.device):
        lens = torch.tensor(ctx.meta.query_lens_cpu, device=device)
        offsets = torch.arange(int(lens.max()), device=device)
        self.valid = offsets < lens[:, None]
        starts = ctx.meta.query_start_loc[:-1].to(device)
        self.index = (starts[:, None] + offsets).where(self.valid, 0)
        self.single = len(lens) == 1


def bidirectional_attention(q: Tensor, k: Tensor, v: Tensor, seg: Segments) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over each prompt's own tokens: q, k, v (N, H, D) -> (N, H, D)."""
    if seg.single:  # one prompt: no padding, no mask
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)))
        return out.transpose(0, 1)
    # (R, H, L, D), padded; padded keys are masked out, padded queries dropped after.
    q, k, v = (t[seg.index].transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.valid[:, None, None, :])
    return out.transpose(1, 2)[seg.valid]


class Encoder(nn.Module):
    """An encoder family's model: its subclass builds `embeddings` (with `word_embeddings`,
    never quantized), its layers and, for a cross-encoder, `classifier`; and runs forward."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.classifier: nn.Module | None = None
        self.layer_executor = "modules"

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the token embeddings', which are never quantized."""
        return self.embeddings.word_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    def load_weights(self, state_dict: dict[str, Tensor], context: int | None = None) -> None:
        """Load the weights under the model's names; a missing or unexpected tensor is an
        error. `context`: the longest sequence it will serve (a rotary family's tables)."""
        assign_weights(self, state_dict)

    def set_layer_executor(self, executor: str) -> None:
        """An encoder's layers run as their modules: the fused C++ ops are a decoder's layer
        (model/layer_executor.py says so before choosing)."""
        if executor != "modules":
            raise ValueError(f"an encoder's layers run as modules, not {executor!r}")

    def token_types(self, input_ids: Tensor, ctx: ForwardContext) -> Tensor:
        """Each token's type: 0, or 1 after its prompt's first segment token (a pair's second
        text, as BERT's tokenizers type it) where the config names one."""
        sep = self.config.segment_token_id
        if sep is None:
            return torch.zeros_like(input_ids)
        types = []
        for part in input_ids.split(ctx.meta.query_lens_cpu):
            is_sep = (part == sep).int()
            types.append(((is_sep.cumsum(0) - is_sep) > 0).long())
        return torch.cat(types)

    @torch.inference_mode()
    def classify(self, pooled: Tensor) -> Tensor:
        """A cross-encoder's scores: (R, hidden) pooled rows -> (R, num_labels), in fp32."""
        if self.classifier is None:
            raise ValueError(f"this {self.config.architecture} model is not a cross-encoder")
        return self.classifier(pooled).float()
