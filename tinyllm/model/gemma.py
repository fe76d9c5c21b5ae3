"""Gemma 2 and Gemma 3 (text): llama.py's decoder with Gemma's differences, from layers.py's pieces.

- Embeddings times sqrt(hidden_size), the factor rounded to the activations' dtype first.
- RMSNorms scale by (1 + w): the model holds that multiplier as each norm's weight (the HF
  loader adds the 1, llama.cpp's GGUF converter has added it), so every norm kernel is the
  Llama one.
- A sandwich of norms: each sublayer's output normalized (post_attention_layernorm,
  post_feedforward_layernorm) before its residual add, the MLP's input by
  pre_feedforward_layernorm. Under tensor parallelism a sublayer's output is summed over the
  ranks first, so each post-norm runs in the next step with its add: post_attention_layernorm
  in the MLP's, a layer's post_feedforward_layernorm in the next layer's attention (the last
  layer's before the final norm). The fused C++ ops take them as o_norm and hidden_norm.
- A GeGLU MLP (tanh GELU); attention scaled by query_pre_attn_scalar ** -0.5.
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap)); a sliding
  window on every other layer. Gemma 3: per-head q/k norms, a sliding window on 5 layers of 6,
  whose RoPE has its own base (rope_local_theta) and no scaling.
"""

import torch
from torch import Tensor, nn

from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig
from tinyllm.model.layers import RMSNorm, Rope
from tinyllm.model.llama import DecoderLayer, Transformer


class GemmaDecoderLayer(DecoderLayer):
    """llama.py's layer (input_layernorm, self_attn, post_attention_layernorm, mlp) and Gemma's
    two MLP norms. `previous`: the layer before it, whose post_feedforward_layernorm this one
    applies to the hidden state it is given (None for the first layer)."""

    def __init__(self, c: ModelConfig, layer: int, previous: "GemmaDecoderLayer | None"):
        super().__init__(c, layer)
        self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.previous = (previous,)  # a tuple: not registered as a submodule

    def load_op_args(self) -> None:
        super().load_op_args()
        previous = self.previous[0]
        self.attention_args = self.attention_args._replace(
            hidden_norm=None if previous is None else previous.post_feedforward_layernorm.weight,
            softcap=self.self_attn.softcap,
        )
        gelu = self.config.hidden_act == "gelu_pytorch_tanh"
        self.mlp_args = self.mlp_args._replace(
            weights=[self.pre_feedforward_layernorm.weight, *self.mlp_args.weights[1:]],
            o_norm=self.post_attention_layernorm.weight,
            activation="gelu_tanh" if gelu else "silu",
        )

    def forward(
        self, x: Tensor, residual: Tensor | None, positions: Tensor, rope: Rope, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor]:
        """As llama.py's DecoderLayer.forward; `x`, the previous layer's MLP output, is not yet
        normalized by that layer's post_feedforward_layernorm."""
        if self.fused:  # the same ops, given Gemma's norms and activation (load_op_args)
            return super().forward(x, residual, positions, rope, ctx)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x = self.previous[0].post_feedforward_layernorm(x)
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, ctx)
        if self.all_reduce is not None:
            self.all_reduce(x)
        x = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x = self.mlp(x)
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x, residual


class GemmaBackbone(nn.Module):
    """HF's `model.*` submodule: embeddings, layers and the final norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        layers: list[GemmaDecoderLayer] = []
        for i in range(c.num_layers):
            layers.append(GemmaDecoderLayer(c, i, layers[-1] if layers else None))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Gemma(Transformer):
    """Gemma 2 and Gemma 3's text model: llama.py's Transformer with Gemma's layers, embedding
    scale, last post-feedforward norm, local RoPE tables and final logit soft-capping."""

    def __init__(self, config: ModelConfig):
        nn.Module.__init__(self)
        self.config = config
        self.model = GemmaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: Rope | None = None
        self.layer_ropes: list[Rope] = []  # each layer's tables: local ones on Gemma 3's sliding
        self.layer_executor = "modules"

    def load_weights(self, state_dict: dict[str, Tensor], context: int | None = None) -> None:
        super().load_weights(state_dict, context)
        c = self.config
        local = c.rope_local_theta is not None and c.sliding_window_layers is not None
        local_rope = Rope(c, self.device, context, local=True) if local else self.rope
        self.layer_ropes = [
            local_rope if local and i in c.sliding_window_layers else self.rope
            for i in range(c.num_layers)
        ]

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        h, residual = self.model.embed_tokens(input_ids), None
        if self.config.embedding_scale is not None:
            h = h * torch.tensor(self.config.embedding_scale, dtype=h.dtype)
        for layer, rope in zip(self.model.layers, self.layer_ropes, strict=True):
            h, residual = layer.forward(h, residual, positions, rope, ctx)
        h = self.model.layers[-1].post_feedforward_layernorm(h)
        return self.model.norm(h, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
