"""BERT-style encoders (BERT, XLM-RoBERTa) for embeddings and reranking: learned absolute
positions and token types, bidirectional attention within each prompt, a LayerNorm after each
sublayer's residual add, a plain GELU MLP. A cross-encoder (ModelConfig.num_labels > 0) adds
Hugging Face's *ForSequenceClassification head as `classify`, applied to the pooled (CLS) row.

Attribute names are Hugging Face's BertModel's (`embeddings.*`, `encoder.layer.N.*`), XLM-R's
too; the loader strips a classifier checkpoint's `bert.`/`roberta.` prefix and names BERT's
pooler and classifier as XLM-R's head (`classifier.dense`, `classifier.out_proj`). Like the
decoders, `forward(input_ids, positions, ctx)` runs one flat batch of whole prompts and returns
the final hidden states; the pooler (the engine's) reads them. An encoder keeps no K/V: it
ignores ctx.kv_caches and reads only where each prompt's tokens are (ctx.meta).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinyllm.model.attention import ForwardContext
from tinyllm.model.config import ModelConfig


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
        self.approximate = "tanh" if c.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


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


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Layers(config)
        self.classifier = ClassifierHead(config) if config.num_labels else None
        self.layer_executor = "modules"

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the embeddings' LayerNorm's, which is never quantized."""
        return self.embeddings.LayerNorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.LayerNorm.weight.device

    def load_weights(self, state_dict: dict[str, Tensor], context: int | None = None) -> None:
        """Load HF-named weights (as the loader renames them); a missing or unexpected tensor
        is an error. `context` is the decoders' (their RoPE tables); an encoder's positions are
        its table's rows."""
        own = {k for k, _ in self.named_parameters()}
        missing, unexpected = own - state_dict.keys(), state_dict.keys() - own
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the {self.config.architecture} model: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        self.load_state_dict(state_dict, strict=False, assign=True)
        self.requires_grad_(False)

    def set_layer_executor(self, executor: str) -> None:
        """An encoder's layers run as their modules: the fused C++ ops are the decoder's
        (model/layer_executor.py says so before choosing)."""
        if executor != "modules":
            raise ValueError(f"an encoder's layers run as modules, not {executor!r}")

    def _token_types(self, input_ids: Tensor, ctx: ForwardContext) -> Tensor:
        """Each token's type: 0, or 1 after its prompt's first segment token (a pair's second
        text, as the tokenizer types it)."""
        sep = self.config.segment_token_id
        if sep is None:
            return torch.zeros_like(input_ids)
        types = []
        for part in input_ids.split(ctx.meta.query_lens_cpu):
            is_sep = (part == sep).int()
            types.append(((is_sep.cumsum(0) - is_sep) > 0).long())
        return torch.cat(types)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """input_ids, positions (N,), whole prompts -> final hidden states (N, hidden)."""
        e = self.embeddings
        h = (
            e.word_embeddings(input_ids)
            + e.position_embeddings(positions + self.config.position_offset)
            + e.token_type_embeddings(self._token_types(input_ids, ctx))
        )
        h = e.LayerNorm(h)
        seg = Segments(ctx, h.device)
        for layer in self.encoder.layer:
            h = layer(h, seg)
        return h

    @torch.inference_mode()
    def classify(self, pooled: Tensor) -> Tensor:
        """A cross-encoder's scores: (R, hidden) pooled rows -> (R, num_labels), in fp32."""
        if self.classifier is None:
            raise ValueError(f"{self.config.architecture} here is no cross-encoder (no classifier)")
        return self.classifier(pooled).float()
