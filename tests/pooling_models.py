"""A tiny random Qwen3 checkpoint with a word-level tokenizer that holds "yes", "no" and
Qwen's chat tokens, and transformers' pooled hidden states and yes/no scores for it: the
reference the pooling tests compare with."""

import json
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tests.test_hf_loader import _random_hf_model

VOCAB = 96
WORDS = ["<unk>", "<s>", "</s>", "yes", "no", "<|im_start|>", "<|im_end|>"]
# test_hf_loader's small shapes; a context long enough for a prompt over the default budget.
QWEN3 = dict(vocab_size=VOCAB, head_dim=32, tie_word_embeddings=False, max_position_embeddings=1024)


def write_qwen3(path: Path) -> transformers.PreTrainedModel:
    """Save a random Qwen3ForCausalLM and its tokenizer at `path`; the model, for reference."""
    model = _random_hf_model("Qwen3", **QWEN3)
    model.save_pretrained(path)
    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab |= {f"w{i}": i for i in range(len(WORDS), VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(w, special=True) for w in WORDS[5:]])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        # A class and a pad token for transformers' AutoTokenizer (sentence-transformers' batches).
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
            | {"tokenizer_class": "PreTrainedTokenizerFast"}
        )
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


def write_qwen3_embedding(
    path: Path, prompts: dict[str, str], default_prompt_name: str | None
) -> transformers.PreTrainedModel:
    """A random Qwen3 laid out as Qwen3-Embedding's directory is: the causal LM checkpoint,
    sentence-transformers' modules (last-token Pooling, Normalize) and its prompts."""
    model = write_qwen3(path)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (p, t) in enumerate(modules)
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": model.config.hidden_size, "pooling_mode_lasttoken": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "2_Normalize").mkdir()
    (path / "config_sentence_transformers.json").write_text(
        json.dumps(
            {"prompts": prompts, "default_prompt_name": default_prompt_name}
            | {"similarity_fn_name": "cosine"}
        )
    )
    return model
