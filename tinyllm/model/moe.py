"""Mixture-of-experts layers (Qwen3-MoE, Mixtral, OLMoE, gpt-oss): a router picks each token's
top-k experts, each expert a SwiGLU MLP, and the layer's output is their outputs weighted by the
router's probabilities. gpt-oss's router and experts have biases, its router takes the softmax
of the top-k logits, and its experts a clamped SwiGLU (ModelConfig.swiglu_limit). DecoderLayer
(model/llama.py) builds one instead of the MLP on the layers ModelConfig.is_moe_layer marks.

Each expert is its own module with the dense MLP's names (`experts.E.gate_up_proj`,
`experts.E.down_proj`, one nn.Linear each), so quantization, tensor-parallel sharding and the
loaders treat it as they treat the MLP. The router (`gate`) stays dense: its few rows choose
the experts, and rounding them would change the choice. The experts run grouped by expert
(layer_ops.moe_experts): a step reads each chosen expert's weights once, however many of its
tokens chose it.
"""

from typing import NamedTuple

import torch
from torch import Tensor, nn

from tinyllm.model import layer_ops
from tinyllm.model.config import ModelConfig
from tinyllm.model.layers import op_weight


class MoEArgs(NamedTuple):
    """decoder_moe's arguments after the step's (`o`, `residual`), as the op's schema names them
    (model/moe_ops.cpp)."""

    weights: list[Tensor]  # post_attention_layernorm, the router gate (dense)
    gate_up: list[Tensor]  # each expert's gate_up_proj (layers.op_weight)
    down: list[Tensor]  # each expert's down_proj
    top_k: int
    norm_topk_prob: bool
    intermediate: int  # an expert's FFN width
    eps: float
    # gpt-oss: the router's bias and routing, the experts' biases (each stacked, a row per
    # expert) and their clamped SwiGLU.
    router_bias: Tensor | None = None
    softmax_after_topk: bool = False
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


class ExpertMLP(nn.Module):
    """One expert: the gated MLP at the experts' width. Run by SparseMoE through
    layer_ops.moe_experts, not by its own forward."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        width = c.moe_intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * width, bias=c.moe_bias)
        self.down_proj = nn.Linear(width, c.hidden_size, bias=c.moe_bias)


class SparseMoE(nn.Module):
    """The router and the experts of one layer; its forward is the modules' path, the C++ op
    decoder_moe the fused one (same routing, same expert op)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.softmax_after_topk = c.softmax_after_topk
        self.swiglu_limit, self.swiglu_alpha = c.swiglu_limit, c.swiglu_alpha
        self.intermediate = c.moe_intermediate_size
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=c.moe_bias)
        self.experts = nn.ModuleList(ExpertMLP(c) for _ in range(c.num_experts))
        # Each expert's weights as the expert op takes them, gathered once loaded (gather), and
        # their biases stacked, a row per expert (None without).
        self.gate_up: list[Tensor] = []
        self.down: list[Tensor] = []
        self.gate_up_bias: Tensor | None = None
        self.down_bias: Tensor | None = None

    def gather(self) -> None:
        """Collect the experts' weights (layers.op_weight) once: walking every expert's module
        at every step would cost more than the few experts a decode row runs."""
        self.gate_up = [op_weight(e.gate_up_proj) for e in self.experts]
        self.down = [op_weight(e.down_proj) for e in self.experts]
        if self.gate.bias is not None:
            self.gate_up_bias = torch.stack([e.gate_up_proj.bias for e in self.experts])
            self.down_bias = torch.stack([e.down_proj.bias for e in self.experts])

    def args(self, norm: Tensor, eps: float) -> MoEArgs:
        """decoder_moe's arguments, the pre-MoE norm's weight `norm` and `eps` with this block's."""
        return MoEArgs(
            weights=[norm, self.gate.weight],
            gate_up=self.gate_up,
            down=self.down,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            intermediate=self.intermediate,
            eps=eps,
            router_bias=self.gate.bias,
            softmax_after_topk=self.softmax_after_topk,
            gate_up_bias=self.gate_up_bias,
            down_bias=self.down_bias,
            swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha,
        )

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's top-k experts (N, k) int64 and their weights (N, k) fp32: softmax of the
        router's logits in fp32, then the top k (ties to the lower expert id), renormalised to
        sum to 1 where the family does (Mixtral always; Qwen3-MoE and OLMoE by config); or
        (gpt-oss) the top k logits, then their softmax."""
        w = self.gate.weight
        # Each row's logits by a product of its own (a batch of 1-row matrices): torch's GEMM
        # picks its blocking by the row count, and a logit's last bit moves the weights, so a
        # token's experts' weights would depend on what else is in the step.
        logits = torch.bmm(x.unsqueeze(1), w.T.expand(len(x), *w.T.shape)).squeeze(1)
        if self.gate.bias is not None:
            logits += self.gate.bias
        if self.softmax_after_topk:
            top, ids = torch.topk(logits.float(), self.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def forward(self, x: Tensor) -> Tensor:
        ids, weights = self.route(x)
        return layer_ops.moe_experts(
            x, ids, weights, self.gate_up, self.down, self.intermediate,
            self.gate_up_bias, self.down_bias, self.swiglu_limit, self.swiglu_alpha,
        )  # fmt: skip
