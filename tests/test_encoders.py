"""The encoder families (model/bert.py: BERT, XLM-RoBERTa and their cross-encoders;
model/nomic_bert.py: NomicBert) loaded from
sentence-transformers directories (loaders/hf_encoders.py, loaders/pooling_config.py), against
sentence-transformers' SentenceTransformer and CrossEncoder and transformers on the same tiny
random checkpoints: token states, pooled embeddings, classifier scores, a flat batch of prompts
of different lengths against each alone, and int8 weights."""

import json

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import NomicBertConfig

from tests.encoder_runs import CLASSES, SIZES, hidden_states, write_encoder
from tests.model_runs import load
from tests.test_gguf_loader import write_gguf
from tinyllm.loaders.dummy import parameter_count
from tinyllm.loaders.gguf import gguf_config, open_gguf
from tinyllm.loaders.hf import hf_config
from tinyllm.loaders.model_loader import LoadConfig, load_model
from tinyllm.model.attention import get_backend
from tinyllm.model.config import UnsupportedModelError
from tinyllm.model.cpu_library import library_error
from tinyllm.model.layer_executor import choose_layer_executor

TEXTS = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19", "w20", "w40 w41 w42 w43 w44"]
PAIRS = [("w5 w6", "w7 w8 w9"), ("w30 w31 w32", "w33"), ("w50", "w51 w52 w53 w54 w55 w56")]
# fp32 end to end: cosine to the reference's embeddings at least this (the bound).
COSINE = 0.9999
FAMILIES = ["bert", "xlm-roberta"]


def _ids(tokenizer, texts, pairs=None) -> list[list[int]]:
    """Each text's (or pair's) token ids as the reference's tokenizer gives them, unpadded."""
    enc = tokenizer(texts, pairs) if pairs else tokenizer(texts)
    return enc["input_ids"]


def _pool(h: torch.Tensor, mode: str) -> torch.Tensor:
    return h[0] if mode == "cls" else h.mean(0)


@pytest.fixture(
    scope="module",
    params=[("bert", "mean"), ("xlm-roberta", "cls"), ("nomic_bert", "mean")],
    ids=str,
)
def embedder(request, tmp_path_factory):
    family, pooling = request.param
    path = tmp_path_factory.mktemp(family) / "st"
    hf = write_encoder(path, family, pooling)
    return path, hf, pooling


def test_config_from_sentence_transformers_files(embedder):
    path, hf, pooling = embedder
    config = hf_config(path)
    assert (config.pooling, config.normalize, config.is_causal) == (pooling, True, False)
    assert config.num_labels == 0


def test_token_states_and_embeddings_match_references(embedder):
    """Our final hidden states equal transformers' last_hidden_state token by token, and pooled
    and normalized as the directory says, SentenceTransformer.encode's embeddings; every
    prompt in one flat batch."""
    path, hf, pooling = embedder
    st = SentenceTransformer(str(path), device="cpu")
    prompts = _ids(st.tokenizer, TEXTS)
    loaded = load_model(LoadConfig(model=str(path), dtype="float32"), torch.device("cpu"))
    # The loaded tokenizer's ids are sentence-transformers' ([CLS] ... [SEP], <s> ... </s>).
    assert [loaded.tokenizer.encode(t) for t in TEXTS] == prompts
    ours = hidden_states(loaded.model, prompts)
    for prompt, h in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(h, want, atol=1e-4, rtol=1e-4)
    expected = torch.from_numpy(st.encode(TEXTS))
    embeddings = F.normalize(torch.stack([_pool(h, pooling) for h in ours]), dim=-1)
    cosine = F.cosine_similarity(embeddings, expected)
    assert cosine.min() >= COSINE, cosine
    # Different texts give different embeddings: the comparison above can tell them apart.
    assert F.cosine_similarity(embeddings[0], expected[1], dim=0) < 0.99


def test_batch_equals_each_alone(embedder):
    path, _, _ = embedder
    model = load(path)
    prompts = [[2, 5, 6, 7, 3], [2, *range(10, 30), 3], [2, 40, 3]]
    together = hidden_states(model, prompts)
    for prompt, h in zip(prompts, together, strict=True):
        torch.testing.assert_close(h, hidden_states(model, [prompt])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(library_error() is not None, reason=f"no CPU kernels: {library_error()}")
def test_int8_weights_close_to_reference(embedder):
    path, _, pooling = embedder
    st = SentenceTransformer(str(path), device="cpu")
    prompts = _ids(st.tokenizer, TEXTS)
    ours = hidden_states(load(path, quantization="int8"), prompts)
    embeddings = torch.stack([_pool(h, pooling) for h in ours])
    cosine = F.cosine_similarity(embeddings, torch.from_numpy(st.encode(TEXTS)))
    assert cosine.min() >= 0.99, cosine


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_scores_match_references(family, tmp_path):
    """classify on the CLS row of a (query, document) pair equals transformers' logits and
    CrossEncoder.predict's scores before its sigmoid; a BERT pair's second text takes token
    type 1, as the tokenizer types it."""
    path = tmp_path / "ce"
    hf = write_encoder(path, family, labels=1)
    config = hf_config(path)
    assert (config.num_labels, config.pooling) == (1, "cls")
    ce = CrossEncoder(str(path), device="cpu", activation_fn=torch.nn.Identity())
    prompts = _ids(ce.tokenizer, *zip(*PAIRS, strict=True))
    model = load(path)
    scores = model.classify(torch.stack([h[0] for h in hidden_states(model, prompts)]))
    assert scores.shape == (len(PAIRS), 1)
    expected = torch.from_numpy(ce.predict(PAIRS)).float()
    torch.testing.assert_close(scores[:, 0], expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        enc = ce.tokenizer(*zip(*PAIRS, strict=True), padding=True, return_tensors="pt")
        torch.testing.assert_close(scores, hf(**enc).logits, atol=1e-4, rtol=1e-4)


def test_bert_pair_token_types(tmp_path):
    """A BERT cross-encoder types a pair's second text 1: scoring it as type 0 throughout (an
    embedding model's types) gives other scores, which the test above would catch."""
    path = tmp_path / "ce"
    write_encoder(path, "bert", labels=1)
    model = load(path)
    prompt = [2, 5, 6, 3, 7, 8, 9, 3]  # [CLS] w5 w6 [SEP] w7 w8 w9 [SEP]
    pair = model.classify(hidden_states(model, [prompt])[0][:1])
    model.config.segment_token_id = None
    single = model.classify(hidden_states(model, [prompt])[0][:1])
    assert not torch.allclose(pair, single, atol=1e-3)


@pytest.mark.skipif(library_error() is not None, reason=f"no CPU kernels: {library_error()}")
def test_encoders_refuse_tensor_parallelism_and_fused_layers(embedder):
    path, _, _ = embedder
    model = load(path)
    with pytest.raises(ValueError, match="tensor parallelism does not split encoders"):
        model.config.shard(2)
    backend = get_backend("cpu", torch.device("cpu"))  # the fused ops' backend
    assert choose_layer_executor("auto", model, backend) == "modules"
    with pytest.raises(ValueError, match="encoder"):
        choose_layer_executor("fused", model, backend)


def _qwen3_dir(path, modules, pooling_config):
    """A Qwen3 config.json beside sentence-transformers' module files (no weights: only the
    config is read)."""
    path.mkdir()
    cfg = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=512,
    )  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return path


# modules.json as sentence-transformers before 6 wrote it (real models' directories).
MODULES = [
    {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
    for i, (path, kind) in enumerate(
        [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    )
]


def test_decoder_embedding_directory_pools_last_token(tmp_path):
    """Qwen3-Embedding's layout (the older flag format of 1_Pooling/config.json): a decoder
    with last-token pooling, normalized; max_seq_length caps its context."""
    flags = {"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
             "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}  # fmt: skip
    path = _qwen3_dir(tmp_path / "q", MODULES, flags)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    config = hf_config(path)
    assert (config.architecture, config.is_causal) == ("qwen3", True)
    assert (config.pooling, config.normalize, config.max_position_embeddings) == ("last", True, 128)


def test_pooling_config_refuses_what_tinyllm_does_not_compute(tmp_path):
    with pytest.raises(UnsupportedModelError, match="max"):
        hf_config(_qwen3_dir(tmp_path / "a", MODULES, {"pooling_mode": "max"}))
    dense = [*MODULES, {"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]
    with pytest.raises(UnsupportedModelError, match="Dense"):
        hf_config(_qwen3_dir(tmp_path / "b", dense, {"pooling_mode": "mean"}))


def _nomic_dir(path, **cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "nomic_bert", **cfg}))
    return path


# nomic-embed-text's own config.json keys (its remote code's), at tiny sizes.
NOMIC_OWN = dict(
    architectures=["NomicBertModel"], vocab_size=100, n_embd=64, n_head=4, n_layer=2, n_inner=128,
    n_positions=64, layer_norm_epsilon=1e-12, activation_function="swiglu", rotary_emb_base=1000,
    rotary_emb_fraction=1.0, rotary_emb_interleaved=False, rotary_scaling_factor=None,
    qkv_proj_bias=False, mlp_fc1_bias=False, mlp_fc2_bias=False, prenorm=False, causal=False,
    type_vocab_size=2,
)  # fmt: skip


def test_nomic_own_config_keys_read_as_transformers_keys(tmp_path):
    """A NomicBert config in nomic's own keys gives the config transformers' keys give; the
    options nomic's models leave off are refused by name."""
    theirs = NomicBertConfig(
        vocab_size=100, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
        intermediate_size=128, max_position_embeddings=64,
    )  # fmt: skip
    theirs.save_pretrained(tmp_path / "transformers")
    own = hf_config(_nomic_dir(tmp_path / "own", **NOMIC_OWN))
    assert own == hf_config(tmp_path / "transformers")
    assert (own.hidden_size, own.num_layers, own.rope_theta, own.hidden_act) == (
        64,
        2,
        1000,
        "silu",
    )
    with pytest.raises(UnsupportedModelError, match="rotary_scaling_factor"):
        hf_config(_nomic_dir(tmp_path / "scaled", **{**NOMIC_OWN, "rotary_scaling_factor": 2.0}))


@pytest.mark.parametrize("arch", ["bert", "nomic-bert"])
def test_encoder_gguf_refused_by_name(arch, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {}, arch)
    with pytest.raises(UnsupportedModelError, match=f"'{arch}' \\(an encoder\\) is not supported"):
        gguf_config(open_gguf(path))


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("family", ["bert", "nomic_bert"])
def test_dummy_weights_build_an_encoder_from_its_config(family, quantization, tmp_path):
    """load_format "dummy" on an encoder's config.json (real shapes without downloads): as many
    parameters as transformers' model of that config, and a forward pass of finite states."""
    if quantization != "none" and library_error() is not None:
        pytest.skip(f"no CPU kernels: {library_error()}")
    config_class, model_class = CLASSES[family, False]
    config = config_class(**{**SIZES, "initializer_range": 0.02})
    config.save_pretrained(tmp_path)
    reference = model_class(config, add_pooling_layer=False)
    assert parameter_count(hf_config(tmp_path)) == sum(p.numel() for p in reference.parameters())
    load_config = LoadConfig(model=str(tmp_path), load_format="dummy", quantization=quantization)
    model = load_model(load_config, torch.device("cpu")).model
    (h,) = hidden_states(model, [[2, 5, 6, 7, 3]])
    assert h.isfinite().all() and h.std(0).min() > 0  # tokens differ
