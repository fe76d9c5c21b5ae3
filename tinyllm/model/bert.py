"""BERT-style encoders (BERT, XLM-RoBERTa) for embeddings and reranking: learned absolute
positions and token types, bidirectional attention within each prompt, a LayerNorm after each
sublayer's residual add, a plain GELU MLP. A cross-encoder (ModelConfig.num_labels > 0) adds
Hugging Face's *ForSequenceClassification head as `classify`, applied to the pooled (CLS) row.

Attribute names are Hugging Face's BertModel's (`embeddings.*`, `encoder.layer.N.*`), XLM-R's
too; the loader strips a classifier checkpoint's `bert.`/`roberta.` prefix and names BERT's
pooler and classifier as XLM-R's head (`classifier.dense`, `classifier.out_proj`). Like the
decoders, `forward(input_ids, positions, ctx)` runs one flat batch of whole prompts and returns
the final hidden states (model/encoder.py has what the encoder families share).
"""

import torch
from torch import Tensor, nn

from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig
from tinyllm.model.encoder import ACTIVATIONS, Encoder, Segments, bidirectional_attention


class SelfAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_heads, c.head_dim
        width = c.num_heads * c.head_dim
        self.query = nn.Linear(c.hidden_size, width)
        self.key = nn.Linear(c.hidden_size, width)
        self.value = nn.Linear(c.hidden_size, width)

    def forward(self, x: Tensor, seg: Segments) -> Tensor:
        shape = (len(x), self.heads, self.head_dim)
        q, k, v = (p(x).view(shape) for p in (self.query, self.key, self.value))
        return bidirectional_attention(q, k, v, seg).reshape(len(x), -1)


class AddNorm(nn.Module):
    """A sublayer's output projection, its residual add and the LayerNorm after it (HF's
    BertSelfOutput and BertOutput)."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self = SelfAttention(c)
        self.output = AddNorm(c.num_heads * c.head_dim, c.hidden_size, c.layer_norm_eps)


class Intermediate(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = AddNorm(c.intermediate_size, c.hidden_size, c.layer_norm_eps)

    def forward(self, h: Tensor, seg: Segments) -> Tensor:
        a = self.attention
        h = a.output(a.self(h, seg), h)
        return self.output(self.intermediate(h), h)


class Embeddings(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        rows = c.max_position_embeddings + c.position_offset
        self.position_embeddings = nn.Embedding(rows, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


class Layers(nn.Module):
    """HF's `encoder` submodule: the layers under `encoder.layer.N`."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))


class ClassifierHead(nn.Module):
    """A cross-encoder's head on the CLS row: out_proj(tanh(dense(x))), HF's
    RobertaClassificationHead, and BERT's pooler with its classifier, which compute the same."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.num_labels)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertEncoder(Encoder):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.encoder = Layers(config)
        self.classifier = ClassifierHead(config) if config.num_labels else None

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions (N,), whole prompts -> final hidden states (N, hidden)."""
        e = self.embeddings
        h = (
            e.word_embeddings(input_ids)
            + e.position_embeddings(positions + self.config.position_offset)
            + e.token_type_embeddings(self.token_types(input_ids, ctx))
        )
        h = e.LayerNorm(h)
        seg = Segments(ctx, h.device)
        for layer in self.encoder.layer:
            h = layer(h, seg)
        return h
