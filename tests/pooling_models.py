"""A tiny random Qwen3 checkpoint with a word-level tokenizer that holds "yes", "no" and
Qwen's chat tokens, and transformers' pooled hidden states and yes/no scores for it: the
reference the pooling tests compare with."""

import json
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

VOCAB = 96
WORDS = ["<unk>", "<s>", "</s>", "yes", "no", "<|im_start|>", "<|im_end|>"]
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def write_qwen3(path: Path) -> transformers.PreTrainedModel:
    """Save a random Qwen3ForCausalLM and its tokenizer at `path`; the model, for reference."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).eval()
    with torch.no_grad():  # HF's init gives near-zero activations that would hide mistakes
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + ("norm" in name))
    model.save_pretrained(path)
    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab |= {f"w{i}": i for i in range(len(WORDS), VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(w, special=True) for w in WORDS[5:]])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return model


def text(ids: list[int]) -> str:
    """Words that the tokenizer reads back as `ids` (each id a word of its own)."""
    return " ".join(WORDS[i] if i < len(WORDS) else f"w{i}" for i in ids)


@torch.no_grad()
def hf_hidden(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) for one prompt, (len, hidden)."""
    return model.model(torch.tensor([ids])).last_hidden_state[0]


def hf_pool(model: transformers.PreTrainedModel, ids: list[int], how: str) -> torch.Tensor:
    h = hf_hidden(model, ids)
    vector = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[how]
    return torch.nn.functional.normalize(vector, dim=0)


@torch.no_grad()
def hf_yes_score(model: transformers.PreTrainedModel, ids: list[int]) -> float:
    """Qwen3-Reranker's score as its model card computes it: P(yes) against P(no) at the last
    token."""
    logits = model(torch.tensor([ids])).logits[0, -1]
    no, yes = WORDS.index("no"), WORDS.index("yes")
    return torch.stack([logits[no], logits[yes]]).log_softmax(0)[1].exp().item()
