"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM): model/layers.py's
layers composed into its decoder layer, backbone and model.

Every loader produces one state dict format, Hugging Face's names; the model stacks q/k/v and
gate/up into one matrix product each as it loads them (layers.fuse_projections), as vLLM does;
Phi-3's checkpoints store them stacked already, under the model's own names.
The model knows nothing about scheduling or memory: it runs one flat batch of tokens,
`forward(input_ids, positions, ctx)`, where `ctx` (built once per step by the model runner)
carries the attention metadata, the attention backend and each layer's K/V cache. Every token of
every request in the step goes through the linear layers as one (N, hidden) matrix; only
attention needs to know which tokens belong together, and the backend reads that from the
metadata. Under tensor parallelism the same model holds one rank's part (ModelConfig.shard), and
model/tensor_parallel.apply_tp gives each layer the all-reduce it calls after o_proj and
down_proj.

Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) are this model with
model/moe.py's SparseMoE in place of the MLP on the layers their config marks
(ModelConfig.is_moe_layer); gpt-oss's attention adds biases, per-head sinks (Attention.sinks)
and YaRN RoPE, all from the config.

A decoder layer runs as its modules or as two C++ ops from the same kernels
(model/decoder_layer.cpp): which is set once for the whole model (Transformer.set_layer_executor,
from model/layer_executor.py's choice) and is a detail inside DecoderLayer.forward. The ops'
arguments besides the step's are the layer's AttentionArgs and MLPArgs, named as the ops'
schemas name them and gathered once at load (a MoE layer's MLP op is decoder_moe, with MoEArgs).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig
from tinyllm.model.layers import (
    MLP,
    Attention,
    RMSNorm,
    Rope,
    assign_weights,
    fuse_projections,
    op_weight,
)
from tinyllm.model.moe import MoEArgs, SparseMoE


class AttentionArgs(NamedTuple):
    """decoder_attention's arguments after the step's: the layer's own, in the order and under
    the names of the op's schema (model/decoder_layer.cpp; tests/test_fused_op_args.py checks)."""

    weights: list[Tensor]  # input_layernorm, qkv_proj, o_proj (layers.op_weight)
    qkv_bias: Tensor | None  # Qwen2
    q_norm: Tensor | None  # Qwen3's per-head norms, both or neither
    k_norm: Tensor | None
    heads: int
    kv_heads: int
    eps: float
    scale: float
    window: int | None  # the layer's sliding window; None: the whole context
    # Gemma (model/gemma.py): the previous layer's post-feedforward norm, applied to `hidden`
    # before its add; Gemma 2's attention-logit soft-capping.
    hidden_norm: Tensor | None = None
    softcap: float | None = None
    # gpt-oss: its per-head softmax sinks and o_proj's bias.
    sinks: Tensor | None = None
    o_bias: Tensor | None = None


class MLPArgs(NamedTuple):
    """decoder_mlp's arguments after the step's (`o`, `residual`), as the op's schema names them."""

    weights: list[Tensor]  # post_attention_layernorm, gate_up_proj, down_proj
    intermediate: int
    eps: float
    o_norm: Tensor | None = None  # Gemma's post-attention norm, applied to `o` before its add
    activation: str = "silu"  # or "gelu_tanh" (Gemma's GeGLU)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.config = layer, c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c) if c.is_moe_layer(layer) else MLP(c)
        # forward runs the C++ ops, not the modules (Transformer.set_layer_executor).
        self.fused = False
        # The ops' own arguments, once loaded (load_op_args).
        self.attention_args: AttentionArgs | None = None
        self.mlp_args: MLPArgs | MoEArgs | None = None
        # Sums, in place, a row-parallel projection's (o_proj's, down_proj's) partial output
        # over the tensor-parallel ranks, before its residual add; None (one process holds the
        # whole model): nothing to sum. Set by model/tensor_parallel.apply_tp.
        self.all_reduce: Callable[[Tensor], object] | None = None

    def load_op_args(self) -> None:
        """The weights as the C++ ops take them, gathered once: at one decode row, walking the
        submodules for them every step is a cost of its own."""
        a, mlp, c = self.self_attn, self.mlp, self.config
        self.attention_args = AttentionArgs(
            weights=[self.input_layernorm.weight, op_weight(a.qkv_proj), op_weight(a.o_proj)],
            qkv_bias=a.qkv_proj.bias,
            q_norm=None if a.q_norm is None else a.q_norm.weight,
            k_norm=None if a.k_norm is None else a.k_norm.weight,
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            eps=c.rms_norm_eps,
            scale=a.scale,
            window=a.window,
            sinks=a.sinks,
            o_bias=a.o_proj.bias,
        )
        norm = self.post_attention_layernorm
        if isinstance(mlp, SparseMoE):
            mlp.gather()
            self.mlp_args = mlp.args(norm.weight, c.rms_norm_eps)
            return
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        self.mlp_args = MLPArgs(
            weights=[norm.weight, op_weight(gate_up), op_weight(down)],
            intermediate=c.intermediate_size,
            eps=c.rms_norm_eps,
        )

    def forward(
        self, x: Tensor, residual: Tensor | None, positions: Tensor, rope: Rope, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor]:
        """x: the last sublayer's output, not yet added to `residual` (the stream so far; None
        before the first layer). Returns this layer's MLP output and the stream before it.

        Fused, the layer is two C++ ops, attention and MLP, from the same kernels as the
        modules' and the CPU attention backend's. Each returns its last projection's output
        before the residual add, where tensor parallelism all-reduces it; the next op, or the
        final norm, does the add, into `residual`'s memory."""
        if self.fused:
            if residual is None:
                residual, x = x.contiguous(), None
            k_cache, v_cache = ctx.kv_caches[self.layer]
            m = ctx.meta
            o = torch.ops.tinyllm.decoder_attention(
                x, residual, positions, rope.cos, rope.sin, k_cache, v_cache, m.slot_mapping,
                m.block_tables, m.seq_lens, m.query_start_loc, m.num_rows, *self.attention_args,
            )  # fmt: skip
            if self.all_reduce is not None:
                self.all_reduce(o)
            if isinstance(self.mlp_args, MoEArgs):
                out = torch.ops.tinyllm.decoder_moe(o, residual, *self.mlp_args)
            else:
                out = torch.ops.tinyllm.decoder_mlp(o, residual, *self.mlp_args)
            if self.all_reduce is not None:
                self.all_reduce(out)
            return out, residual
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, ctx)
        if self.all_reduce is not None:
            self.all_reduce(x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x, residual


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, layers and the final norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: Rope | None = None
        self.layer_executor = "modules"  # see set_layer_executor

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and K/V's) dtype: the final norm's, which is never quantized."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def load_weights(self, state_dict: dict[str, Tensor], context: int | None = None) -> None:
        """Load HF-named weights; a missing or unexpected tensor is an error, not a warning.
        `context`: the longest sequence it will serve (see Rope)."""
        state_dict = fuse_projections(state_dict, self.config.num_layers)
        # A quantized head (model/quant.py) is already loaded, and ties itself.
        tied = self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear)
        if tied:
            state_dict.pop("lm_head.weight", None)
        assign_weights(self, state_dict)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(self.config, self.device, context)
        for layer in self.model.layers:
            layer.load_op_args()

    def set_layer_executor(self, executor: str) -> None:
        """Run every decoder layer as its C++ ops ("fused") or as its modules ("modules") from
        now on; model/layer_executor.choose_layer_executor says which can run where."""
        if executor not in ("fused", "modules"):
            raise ValueError(f"layer executor {executor!r}: 'fused' or 'modules'")
        self.layer_executor = executor
        for layer in self.model.layers:
            layer.fused = executor == "fused"

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions (N,) -> final hidden states (N, hidden); logits are a separate
        step so that only the positions that sample are projected onto the vocabulary."""
        h, residual = self.model.embed_tokens(input_ids), None
        # forward, not __call__: the layers take no hooks, and __call__'s check for them is a
        # cost per layer that the fused path exists to avoid.
        for layer in self.model.layers:
            h, residual = layer.forward(h, residual, positions, self.rope, ctx)
        return self.model.norm(h, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()
