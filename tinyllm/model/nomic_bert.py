"""NomicBert (nomic-embed-text v1 and v1.5), as transformers' NomicBertModel computes it: BERT's
post-LayerNorm layers with rotary positions (rotate-half, on every head dim) instead of a
position table, token type 0, no biases in attention and MLP, and a SwiGLU MLP.

Attribute names are the checkpoints' own (nomic's original layout, which transformers reads and
writes): `emb_ln`, `encoder.layers.N.attn.Wqkv` (q, k and v stacked), `attn.out_proj`,
`mlp.fc11` (up), `mlp.fc12` (gate), `mlp.fc2` (down), `norm1` after attention, `norm2` after
the MLP.
"""

import torch
from torch import Tensor, nn

from tinyllm.model import layer_ops
from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig
from tinyllm.model.encoder import ACTIVATIONS, Encoder, Segments, bidirectional_attention
from tinyllm.model.layers import Rope


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_heads, c.head_dim
        width = c.num_heads * c.head_dim
        self.Wqkv = nn.Linear(c.hidden_size, 3 * width, bias=False)
        self.out_proj = nn.Linear(width, c.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, rope: Rope, seg: Segments) -> Tensor:
        H, D = self.heads, self.head_dim
        qkv = self.Wqkv(x)
        layer_ops.rotary(qkv, positions, rope.cos, rope.sin, 2 * H, D)  # q's and k's heads
        q, k, v = qkv.view(len(x), 3 * H, D).split(H, dim=1)
        return self.out_proj(bidirectional_attention(q, k, v, seg).reshape(len(x), -1))


class MLP(nn.Module):
    """fc2(act(fc12(x)) * fc11(x)): SwiGLU, fc12 the gate."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.fc11 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.fc12 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc12(x)) * self.fc11(x))


class Layer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn = Attention(c)
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = MLP(c)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, h: Tensor, positions: Tensor, rope: Rope, seg: Segments) -> Tensor:
        h = self.norm1(h + self.attn(h, positions, rope, seg))
        return self.norm2(h + self.mlp(h))


class Embeddings(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)


class Layers(nn.Module):
    """The checkpoint's `encoder` submodule: the layers under `encoder.layers.N`."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))


class NomicBert(Encoder):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = Layers(config)
        self.rope: Rope | None = None

    def load_weights(self, state_dict: dict[str, Tensor], context: int | None = None) -> None:
        super().load_weights(state_dict, context)
        self.rope = Rope(self.config, self.device, context)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions (N,), whole prompts -> final hidden states (N, hidden)."""
        e = self.embeddings
        types = e.token_type_embeddings(self.token_types(input_ids, ctx))
        h = self.emb_ln(e.word_embeddings(input_ids) + types)
        seg = Segments(ctx, h.device)
        for layer in self.encoder.layers:
            h = layer(h, positions, self.rope, seg)
        return h
