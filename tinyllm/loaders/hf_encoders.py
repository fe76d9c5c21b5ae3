"""Hugging Face encoder checkpoints: BERT and XLM-RoBERTa (BertModel, XLMRobertaModel and their
*ForSequenceClassification cross-encoders) and NomicBert (NomicBertModel): config.json ->
ModelConfig, and the checkpoint's tensor names -> model/bert.py's and model/nomic_bert.py's."""

import json
from pathlib import Path

import tokenizers

from tinyllm.model.config import ModelConfig, ModelLoadError, UnsupportedModelError

ENCODER_CLASSES = {
    "BertModel": "bert",
    "BertForSequenceClassification": "bert",
    "XLMRobertaModel": "xlm-roberta",
    "XLMRobertaForSequenceClassification": "xlm-roberta",
    "NomicBertModel": "nomic_bert",
}
# transformers' hidden_act names -> ModelConfig's ("gelu_new" is the tanh approximation);
# nomic's own configs say "swiglu" for a SiLU-gated MLP.
_ACTS = {
    "gelu": "gelu", "gelu_new": "gelu_pytorch_tanh", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "silu": "silu", "swish": "silu", "swiglu": "silu",
}  # fmt: skip
# nomic's own config.json keys (its remote code's) for the transformers names NomicBertConfig
# uses; a config has one or the other.
_NOMIC_KEYS = {
    "hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
    "intermediate_size": "n_inner", "max_position_embeddings": "n_positions",
    "layer_norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function",
}  # fmt: skip
# Options of nomic's remote code that its NomicBert models leave off, and that tinyllm's lacks.
_NOMIC_UNSUPPORTED = (
    "qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias", "prenorm", "rotary_emb_interleaved",
    "rotary_scaling_factor", "use_rms_norm", "causal",
)  # fmt: skip
# A classifier checkpoint's encoder, under these prefixes; BERT's pooler and classifier under
# the head's names model/bert.ClassifierHead shares with XLM-R's.
_BACKBONE_PREFIXES = ("bert.", "roberta.", "nomic_bert.")
_BERT_HEAD = {"pooler.dense.": "classifier.dense.", "classifier.": "classifier.out_proj."}
# Buffers BERT checkpoints may carry; the model gets positions and types from each step.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def encoder_config(cfg: dict, arch: str, model_dir: Path) -> ModelConfig:
    """An encoder's config.json (`cfg`, architecture `arch`) as ModelConfig; a cross-encoder's
    classifier outputs in num_labels, and for a BERT pair its [SEP] token (`model_dir`'s
    tokenizer) as segment_token_id."""
    if arch == "nomic_bert":
        return _nomic_config(cfg)
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise UnsupportedModelError(f"{arch} with position_embedding_type {kind!r}: absolute only")
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTS:
        raise UnsupportedModelError(f"{arch} with hidden_act {act!r}; needs one of {list(_ACTS)}")
    classifier = any(n.endswith("ForSequenceClassification") for n in cfg.get("architectures", []))
    num_labels = len(cfg.get("id2label") or {0: 0, 1: 1}) if classifier else 0  # HF's default 2
    # XLM-R numbers positions from padding_idx + 1 (transformers'
    # create_position_ids_from_input_ids): its table's first rows are never read.
    offset = cfg.get("pad_token_id", 1) + 1 if arch == "xlm-roberta" else 0
    types = cfg.get("type_vocab_size", 2)
    # BERT's tokenizers type a pair's second text 1; XLM-R's give no types (all 0).
    pair_types = arch == "bert" and num_labels > 0 and types > 1
    return ModelConfig(
        **_shape(cfg, arch),
        max_position_embeddings=cfg["max_position_embeddings"] - offset,
        hidden_act=_ACTS[act],
        num_labels=num_labels,
        position_offset=offset,
        segment_token_id=_sep_token(model_dir) if pair_types else None,
    )


def _nomic_config(cfg: dict) -> ModelConfig:
    """NomicBert's config.json, in nomic's own keys or transformers' (NomicBertConfig's)."""
    cfg = cfg | {new: cfg[old] for new, old in _NOMIC_KEYS.items() if old in cfg}
    if any(n.endswith("ForSequenceClassification") for n in cfg.get("architectures", [])):
        raise UnsupportedModelError("NomicBert cross-encoders are not supported")
    unsupported = [key for key in _NOMIC_UNSUPPORTED if cfg.get(key)]
    fraction = cfg.get("rotary_emb_fraction", 1.0)
    if unsupported or fraction != 1.0:
        found = [*unsupported, *(["rotary_emb_fraction"] if fraction != 1.0 else [])]
        raise UnsupportedModelError(f"NomicBert with {', '.join(found)} is not supported")
    act = cfg.get("hidden_act", "silu")
    if _ACTS.get(act) != "silu":
        raise UnsupportedModelError(f"NomicBert with activation {act!r}; needs swiglu (silu)")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"NomicBert with rope_type {rope['rope_type']!r}: default only")
    return ModelConfig(
        **_shape(cfg, "nomic_bert"),
        max_position_embeddings=cfg["max_position_embeddings"],
        rope_theta=float(rope.get("rope_theta", cfg.get("rotary_emb_base", 1000.0))),
        hidden_act="silu",
    )


def _shape(cfg: dict, arch: str) -> dict:
    """The ModelConfig fields every encoder's config.json gives alike (transformers' keys)."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    return dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        is_causal=False,
        pooling="cls",  # transformers' heads' and vLLM's default; modules.json may say otherwise
        layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
        type_vocab_size=cfg.get("type_vocab_size", 2),
    )


def _sep_token(model_dir: Path) -> int:
    """The id of the tokenizer's sep_token, which ends a pair's first text."""
    try:
        sep = json.loads((model_dir / "tokenizer_config.json").read_text()).get("sep_token")
        sep = sep.get("content") if isinstance(sep, dict) else sep
        token_id = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(
            sep or "[SEP]"
        )
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
        raise ModelLoadError(f"cannot read the tokenizer in {model_dir}: {e}") from e
    if token_id is None:
        raise ModelLoadError(f"{model_dir}'s tokenizer has no sep token {sep!r} to split pairs by")
    return token_id


def encoder_tensor_name(name: str, classifier: bool) -> str | None:
    """model/bert.py's name for a checkpoint tensor; None for what it does not use (BERT's pooler
    in an embedding model, saved buffers)."""
    for prefix in _BACKBONE_PREFIXES:
        if name.startswith(prefix):
            name = name.removeprefix(prefix)
    if name.startswith(_BUFFERS) or (name.startswith("pooler.") and not classifier):
        return None
    if classifier and not name.startswith(("classifier.dense.", "classifier.out_proj.")):
        for old, new in _BERT_HEAD.items():
            if name.startswith(old):
                return new + name.removeprefix(old)
    return name
