"""Gemma 2 and Gemma 3 (text), model/gemma.py: tiny random checkpoints from a Hugging Face
directory and from GGUF (fp32 and the int4 kernels) against transformers, on prompts longer than
the sliding window; both attention backends and both layer executors; greedy tokens through LLM
with chunked prefill and the prefix cache; TP=2; the text model of a Gemma 3 vision-language
checkpoint; the soft-capping attention kernel against a plain loop (the GeGLU op:
test_layer_ops, test_cpu_op_shapes); the chat
templates, tools through the generic tool prompt."""

import copy
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import transformers

from tests.model_runs import checkpoint_weights, load, prompt_logits, transformers_logits
from tests.test_attention_cpu import build
from tests.test_gguf_loader import write_gguf
from tests.test_hf_loader import VOCAB, _write_tokenizer
from tests.test_tensor_parallel_model import _free_port, _rank, _variants
from tinyllm.loaders.dummy import dummy_config
from tinyllm.loaders.gguf import gguf_config, open_gguf
from tinyllm.loaders.hf import hf_config
from tinyllm.model.attention.backend import AttentionMetadata
from tinyllm.model.attention.cpu import load_cpu_backend
from tinyllm.model.attention.reference import ReferenceBackend
from tinyllm.model.cpu_library import library_error
from tinyllm.model.gemma import Gemma
from tinyllm.text.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)

WINDOW = 5  # prompts of 9 to 20 tokens cross it
HEAD_DIM = 16
DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    max_position_embeddings=128,
    sliding_window=WINDOW,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Soft caps small enough to bite on these weights (Gemma 2's own are 50 and 30); a query scale
# other than head_dim's; Gemma 3's global layer (the 6th) with its own RoPE base and scaling.
FAMILIES = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=2,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=4.0,
            query_pre_attn_scalar=24,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}
LENGTHS = (9, 20, 3)


def random_gemma(family: str, **overrides) -> torch.nn.Module:
    """A random Gemma whose norms' w is about 0.2 (a multiplier of 1 + w: one of about 0.2 if
    the 1 were missing) and whose other weights give logits of std about 1."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**DIMS, **extra, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.15))
    return model


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    """(family, transformers' model, its saved directory with a tokenizer)."""
    reference = random_gemma(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    _write_tokenizer(path)
    return request.param, reference, path


@pytest.fixture(scope="module")
def dense(family) -> Gemma:
    return load(family[2])


def test_config_reads_gemmas_fields(family):
    name, _, path = family
    c = hf_config(path)
    assert c.architecture == name and c.hidden_act == "gelu_pytorch_tanh" and c.post_norms
    assert c.embedding_scale == 8.0 and c.query_pre_attn_scalar == 24 and c.sliding_window == 5
    if name == "gemma2":
        assert c.sliding_window_layers == (0,) and c.rope_local_theta is None
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (1.5, 4.0)
    else:
        assert c.sliding_window_layers == (0, 1, 2, 3, 4) and c.qk_norm
        assert (c.rope_theta, c.rope_local_theta) == (1e6, 10000.0)
        assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None


@pytest.mark.parametrize(
    "backend,executor", [("cpu", "fused"), ("cpu", "modules"), ("reference", "modules")]
)
def test_checkpoint_matches_transformers(family, dense, backend, executor):
    _, reference, _ = family
    batch = prompts(*LENGTHS)
    ours = prompt_logits(dense, batch, backend=backend, executor=executor)
    assert dense.layer_executor == executor
    for prompt, logits in zip(batch, ours, strict=True):
        expected = transformers_logits(reference, prompt)
        assert expected.std() > 0.5  # logits that vary: the tolerance below is tight
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_fused_and_modules_give_the_same_bits(family, dense):
    """The same kernels in the same order; but Gemma 3's head norms, C++ in the fused op and
    torch on the modules' strided heads (as Qwen3's), which differ by rounding."""
    batch = prompts(*LENGTHS)
    fused = prompt_logits(dense, batch, backend="cpu", executor="fused")
    modules = prompt_logits(dense, batch, backend="cpu", executor="modules")
    for a, b in zip(fused, modules, strict=True):
        if family[0] == "gemma2":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _changed(model: Gemma, batch, undo) -> float:
    """How far the logits move with one of Gemma's steps undone (`undo` edits the model and
    returns what restores it)."""
    before = prompt_logits(model, batch, backend="reference")
    restore = undo(model)
    try:
        after = prompt_logits(model, batch, backend="reference")
    finally:
        restore()
    return max((a - b).abs().max().item() for a, b in zip(before, after, strict=True))


def _without_one(model):  # norms of w instead of 1 + w
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    for p in norms:
        p.data -= 1
    return lambda: [p.data.add_(1) for p in norms]


def _without_embedding_scale(model):
    scale, model.config.embedding_scale = model.config.embedding_scale, None
    return lambda: setattr(model.config, "embedding_scale", scale)


def _without_attention_softcap(model):
    attns = [layer.self_attn for layer in model.model.layers]
    for a in attns:
        a.softcap = None
    return lambda: [setattr(a, "softcap", 1.5) for a in attns]


def _without_final_softcap(model):
    cap, model.config.final_logit_softcapping = model.config.final_logit_softcapping, None
    return lambda: setattr(model.config, "final_logit_softcapping", cap)


def _without_local_rope(model):
    ropes, model.layer_ropes = model.layer_ropes, [model.rope] * len(model.layer_ropes)
    return lambda: setattr(model, "layer_ropes", ropes)


UNDO = {
    "gemma2": [_without_one, _without_embedding_scale, _without_attention_softcap],
    "gemma3": [_without_one, _without_embedding_scale, _without_local_rope],
}


def test_each_gemma_step_matters_beyond_the_tolerance(family, dense):
    """The comparison with transformers would fail without any one of Gemma's steps: each moves
    the logits by far more than its tolerance."""
    name = family[0]
    batch = prompts(*LENGTHS)
    for undo in UNDO[name]:
        assert _changed(dense, batch, undo) > 0.05, undo.__name__
    if name == "gemma2":  # capped at 4: the capped logits move less, but still
        assert _changed(dense, batch, _without_final_softcap) > 0.05


# ---- Gemma 3's text model inside a vision-language checkpoint ----


def test_vision_language_checkpoint_loads_its_text_model(tmp_path):
    text = {**DIMS, **FAMILIES["gemma3"][2]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    reference = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.15))
    reference.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    assert hf_config(tmp_path).architecture == "gemma3"
    model = load(tmp_path)
    batch = prompts(*LENGTHS)
    for prompt, logits in zip(batch, prompt_logits(model, batch), strict=True):
        torch.testing.assert_close(
            logits, transformers_logits(reference, prompt), atol=1e-4, rtol=1e-4
        )


# ---- GGUF files, as llama.cpp's converter writes them ----

GGUF_NORMS = {  # Gemma's norms other than write_gguf's attn_norm and output_norm
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gemma_gguf(path: Path, reference: torch.nn.Module, qtype) -> Path:
    """`reference`'s weights as llama.cpp's converter writes a gemma2/gemma3 file: every norm
    stored as 1 + w, the embeddings tied (no output.weight)."""
    c = reference.config
    arch = c.model_type.removesuffix("_text")
    weights, norms = {}, {}
    for name, w in reference.state_dict().items():
        w = w.numpy() + (1 if name.endswith("norm.weight") else 0)
        layer_norm = next((g for hf, g in GGUF_NORMS.items() if name.endswith(hf)), None)
        if layer_norm is not None:
            norms[f"blk.{name.split('.')[2]}.{layer_norm}"] = w.astype(np.float32)
        elif name != "lm_head.weight":
            weights[name] = w
    metadata = {
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.key_length": HEAD_DIM,
        f"{arch}.attention.value_length": HEAD_DIM,
        f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        f"{arch}.attention.sliding_window": WINDOW,
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.vocab_size": VOCAB,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
    }
    if arch == "gemma2":
        metadata[f"{arch}.attn_logit_softcapping"] = c.attn_logit_softcapping
        metadata[f"{arch}.final_logit_softcapping"] = c.final_logit_softcapping
    else:
        metadata[f"{arch}.rope.freq_base"] = 1e6
        metadata[f"{arch}.rope.scaling.type"] = "linear"
        metadata[f"{arch}.rope.scaling.factor"] = 8.0
    return write_gguf(path, weights, arch, qtype, metadata, extra_tensors=norms)


@pytest.fixture(scope="module")
def gguf_family(family, tmp_path_factory):
    """(reference with llama.cpp's attention scale, fp32 file, Q4_0 file): llama.cpp scales
    queries by head_dim (its 27B sizes aside), the file stores no query_pre_attn_scalar."""
    name = family[0]
    reference = random_gemma(name, query_pre_attn_scalar=HEAD_DIM)
    folder = tmp_path_factory.mktemp(f"{name}-gguf")
    fp32 = gemma_gguf(folder / "f32.gguf", reference, gguf.GGMLQuantizationType.F32)
    q4 = gemma_gguf(folder / "q4.gguf", reference, gguf.GGMLQuantizationType.Q4_0)
    return reference, fp32, q4


def test_gguf_config_is_the_checkpoints(family, gguf_family):
    from_gguf = gguf_config(open_gguf(gguf_family[1]))
    from_hf = hf_config(family[2])
    assert from_gguf.query_pre_attn_scalar == HEAD_DIM
    from_hf.query_pre_attn_scalar = HEAD_DIM
    fields = ("sliding_window_layers", "rope_local_theta", "attn_logit_softcapping",
              "final_logit_softcapping", "qk_norm", "rope_theta", "rope_scaling",
              "tie_word_embeddings", "hidden_act", "embedding_scale", "post_norms")  # fmt: skip
    for field in fields:
        assert getattr(from_gguf, field) == getattr(from_hf, field), field


@pytest.mark.parametrize(
    "arch,pattern,sliding",
    [("gemma2", None, (0,)), ("gemma3", None, (0, 1)), ("gemma3", 2, (0,)),
     ("gemma3", [False, True], (1,))],
)  # fmt: skip
def test_gguf_sliding_layers(arch, pattern, sliding, tmp_path):
    """llama.cpp's pattern for each architecture (2 layers here: Gemma 3's 6th is past them),
    or the file's own, a period or a flag per layer."""
    metadata = {f"{arch}.attention.sliding_window": 4}
    if pattern is not None:
        metadata[f"{arch}.attention.sliding_window_pattern"] = pattern
    path = write_gguf(tmp_path / "m.gguf", {}, arch, metadata=metadata)  # metadata only
    config = gguf_config(open_gguf(path))
    assert config.sliding_window == 4 and config.sliding_window_layers == sliding


def test_gguf_matches_transformers(gguf_family):
    reference, fp32, _ = gguf_family
    model = load(fp32)
    batch = prompts(*LENGTHS)
    for prompt, logits in zip(batch, prompt_logits(model, batch), strict=True):
        torch.testing.assert_close(
            logits, transformers_logits(reference, prompt), atol=1e-4, rtol=1e-4
        )


def test_q4_0_gguf_runs_as_stored(gguf_family):
    """The int4 kernels on the fused layer, against transformers running the file's weights
    (dequantized; the norms less the 1 the file holds)."""
    reference, _, q4 = gguf_family
    reference = copy.deepcopy(reference)
    weights = checkpoint_weights(load(q4))
    weights = {k: w - 1 if k.endswith("norm.weight") else w for k, w in weights.items()}
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embeddings
    model = load(q4, quantization="auto")
    assert model.model.layers[0].self_attn.qkv_proj.bits == 4
    batch = prompts(*LENGTHS)
    for prompt, logits in zip(batch, prompt_logits(model, batch), strict=True):
        expected = transformers_logits(reference, prompt)
        # Only the activations' rounding to 8 bits differs.
        torch.testing.assert_close(logits, expected, rtol=0, atol=0.02 * expected.std().item())


# ---- through LLM: greedy tokens, chunked prefill, prefix cache ----


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(transformers_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_llm_greedy_with_chunked_prefill_and_prefix_cache(family):
    """Prompts prefilled in chunks of 4 (max_num_batched_tokens), the second sharing the first's
    blocks through the prefix cache: transformers' greedy tokens, past the window."""
    from tinyllm import LLM, SamplingParams

    _, reference, path = family
    llm = LLM(str(path), "float32", quantization="none", block_size=4,
              max_num_batched_tokens=4, enable_prefix_caching=True, max_model_len=64)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (first,) = prompts(13)
    second = first[:8] + [7, 9, 11]  # two shared blocks
    for prompt in (first, second):
        (out,) = llm.generate(prompt, greedy, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 6)


# ---- tensor parallelism: two ranks give the one process's logits ----


def test_two_ranks_give_the_whole_models_logits(tmp_path):
    """Gemma 3 (its post-norms after each all-reduce, q/k norms, local RoPE) split over two
    processes, dense and int4, on both executors, as test_tensor_parallel_model runs Llama.
    Dense fp32 differs only in the order of the sums: measured within 3e-6 of logits of std
    1.25. In int4, a last-bit difference can move an activation's 8-bit code, and Gemma's
    post-norms scale each sublayer's output (its rounding too) back to unit size: measured within
    3e-4. A post-norm applied to a rank's partial sum, or a missing all-reduce, moves the logits
    by about their std."""
    path = tmp_path / "model"
    random_gemma("gemma3").save_pretrained(path)
    _write_tokenizer(path)
    whole = _variants(path, 0, 1)
    mp.spawn(_rank, args=(2, _free_port(), path, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for variant, want in whole.items():
        for step, expected in enumerate(want):
            got = ranks[0][variant][step]
            assert torch.equal(ranks[1][variant][step], got), variant
            atol = (2e-5 if variant[0] == "none" else 2e-3) * expected.std().item()
            torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=str(variant))
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), variant


# ---- the kernels: soft-capped attention and GeGLU ----


def naive_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, window, softcap):
    """One query at a time, in fp64: its keys through the block table, scores soft-capped."""
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // Hkv
    for r in range(meta.num_rows):
        start, n, L = int(meta.query_start_loc[r]), meta.query_lens_cpu[r], meta.seq_lens_cpu[r]
        pos = torch.arange(L)
        slots = meta.block_tables[r, pos // bs] * bs + pos % bs
        keys = k_cache.view(-1, Hkv, k_cache.shape[3])[slots].double()
        values = v_cache.view(-1, Hkv, v_cache.shape[3])[slots].double()
        for i in range(n):
            p = L - n + i
            seen = (pos <= p) & (pos > p - (window or L + 1))
            for h in range(q.shape[1]):
                s = keys[:, h // group] @ q[start + i, h].double() * scale
                s = torch.tanh(s / softcap) * softcap
                w = torch.softmax(s.masked_fill(~seen, -math.inf), 0)
                out[start + i, h] = w @ values[:, h // group]
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("D", [16, 64])
def test_softcapped_attention_matches_a_naive_loop(window, D):
    backend, _ = load_cpu_backend()
    rows = [(1, 1), (23, 1), (40, 40), (37, 12)]  # decodes, a whole prompt, a later chunk
    (q, k, v, k_cache, v_cache, meta), _ = build(rows, bs=16, Hq=4, Hkv=2, D=D, seed=D)
    q = q * 3  # scores of several units, where the cap of 2 bites
    expected = naive_attention(q, k_cache, v_cache, meta, D**-0.5, window, 2.0)
    for be in (backend, ReferenceBackend()):
        out = be.attend(q, k, v, k_cache, v_cache, meta, D**-0.5, window, 2.0)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    uncapped = backend.attend(q, k, v, k_cache, v_cache, meta, D**-0.5, window)
    assert (uncapped.double() - expected).abs().max() > 0.01


def test_softcapped_tokens_keep_their_bits_whatever_the_chunk():
    """The same-bits guarantee with soft-capping: a token's output alone (a decode) and in
    chunks of any size is the same."""
    backend, _ = load_cpu_backend()
    L, n = 60, 20
    (q, _, _, k_cache, v_cache, meta), _ = build([(L, n)], bs=16, Hq=4, Hkv=2, D=64, seed=5)
    q = q * 3

    def span(first: int, end: int) -> torch.Tensor:
        k = end - first
        slots = meta.slot_mapping[first - (L - n) : end - (L - n)]
        m = AttentionMetadata(slots, meta.block_tables, torch.tensor([end]),
                              torch.tensor([0, k]), int(k == 1), [end], [k])  # fmt: skip
        part = q[first - (L - n) : end - (L - n)]
        return backend.attend(part, None, None, k_cache, v_cache, m, 0.125, 7, 2.0)

    whole = span(L - n, L)
    for size in (1, 3, 16):
        for first in range(L - n, L, size):
            end = min(first + size, L)
            assert torch.equal(span(first, end), whole[first - (L - n) : end - (L - n)])


# ---- the named dummy config ----


def test_gemma_3_4b_dummy_config():
    """The text part of google/gemma-3-4b-it's config: 34 layers, every 6th global with RoPE
    base 1e6 scaled linearly by 8, the others sliding over 1024 tokens with base 10000."""
    _, _, c = dummy_config("gemma-3-4b")
    assert c.architecture == "gemma3" and c.num_layers == 34 and c.sliding_window == 1024
    assert [i for i in range(34) if c.layer_window(i) is None] == [5, 11, 17, 23, 29]
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert c.query_pre_attn_scalar == 256 and c.tie_word_embeddings


def test_dummy_weights_run_a_tiny_gemma(tmp_path):
    from tinyllm import LLM, SamplingParams

    cfg = {**DIMS, **FAMILIES["gemma2"][2], "model_type": "gemma2", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=32)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3


# ---- chat templates ----

TEMPLATES = Path(__file__).parent / "data" / "templates"


def _template_tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend, bos_token_id=2, eos_token_ids=[1], chat_template=template)


def test_gemma_chat_templates_render():
    for name in ("google-gemma-3-4b-it.jinja", "google-gemma-2-2b-it.jinja"):
        tok = _template_tokenizer((TEMPLATES / name).read_text())
        messages = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "Weather?"}]  # fmt: skip
        text, _ = tok.encode_chat(messages)
        assert text == (
            "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
            "<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n"
        ), name


def test_gemma_2_gets_the_system_text_in_the_first_user_turn():
    """Gemma 2's template has no system turn (it raises on one): the system message's text, and
    the generic tool prompt's, go at the head of the first user turn, a blank line apart; the
    prompt is the one Gemma 3's template, which folds the system message itself, writes."""
    from tests.test_tool_prompt import EXCHANGE, TOOLS

    gemma2, gemma3 = (
        _template_tokenizer((TEMPLATES / name).read_text())
        for name in ("google-gemma-2-2b-it.jinja", "google-gemma-3-4b-it.jinja")
    )
    system = {"role": "system", "content": "Be brief."}
    asks = [system, {"role": "user", "content": "Weather?"}]
    text, _ = gemma2.encode_chat(asks)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nWeather?<end_of_turn>\n<start_of_turn>model\n"
    )
    for messages in (asks, [system, *EXCHANGE], EXCHANGE):
        for tools in (None, TOOLS):
            text, _ = gemma2.encode_chat(messages, tools=tools)
            assert text == gemma3.encode_chat(messages, tools=tools)[0]
    text, _ = gemma2.encode_chat([system, *EXCHANGE], tools=TOOLS)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools\n")
    first_turn = text[: text.index("<end_of_turn>")]
    assert json.dumps(TOOLS[0]) in first_turn and first_turn.endswith("\n\nWeather in Paris?")


def test_a_template_with_a_system_turn_is_rendered_as_sent():
    """Where the template renders a system message, the conversation reaches it unchanged: the
    prompt is the template's own rendering of the messages."""
    from tinyllm.text.chat_template import render_chat_template

    template = (TEMPLATES / "meta-llama-Llama-3.3-70B-Instruct.jinja").read_text()
    tok = _template_tokenizer(template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = render_chat_template(template, messages, True, "<bos>", "<eos>")
    assert tok.encode_chat(messages)[0] == expected
    assert "<|start_header_id|>system<|end_header_id|>" in expected


def test_gemma_2_tool_call_through_llm_chat(tmp_path):
    """A tiny random Gemma 2 checkpoint with its real chat template and the default model's
    tokenizer: a request with a system message and tools renders (no 400), the tools are in the
    first user turn, and the call the grammar makes parses back from the generic format."""
    from tests.test_llm_tools import TOOLS
    from tinyllm import LLM, SamplingParams
    from tinyllm.loaders.source import default_model_path

    backend = Tokenizer.from_gguf(gguf.GGUFReader(default_model_path())).backend
    backend.save(str(tmp_path / "tokenizer.json"))
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(specials))
    template = (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text(template)
    ids = {k: backend.token_to_id(v) for k, v in specials.items() if k != "add_bos_token"}
    random_gemma(
        "gemma2",
        vocab_size=backend.get_vocab_size(),
        max_position_embeddings=1024,
        bos_token_id=ids["bos_token"],
        eos_token_id=ids["eos_token"],
    ).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), "float32", quantization="none", max_model_len=1024)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the weather in Rome?"}]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=48)
    (out,) = llm.chat(messages, params, use_tqdm=False, tools=TOOLS, tool_choice="required")
    assert out.prompt.startswith("<|endoftext|><start_of_turn>user\nBe brief.\n\n# Tools\n")
    first_turn = out.prompt[: out.prompt.index("<end_of_turn>")]
    assert json.dumps(TOOLS[0]) in first_turn
    assert first_turn.endswith("</tool_call>\n\nWhat is the weather in Rome?")
    completion = out.outputs[0]
    assert completion.text.startswith("<tool_call>\n") and completion.finish_reason == "stop"
    (call,) = completion.tool_calls
    assert call.name == "get_weather" and call.complete
    assert isinstance(json.loads(call.arguments)["city"], str)


def test_gemma_3_tools_through_the_generic_tool_prompt():
    """Gemma 3's template reads no tools: tinyllm's generic format puts them in the system
    message, which the template folds into the first user turn; a call in the history is a
    <tool_call> block of the model's turn and its result a user turn, so roles still alternate."""
    from tests.test_tool_prompt import EXCHANGE, TOOLS

    tok = _template_tokenizer((TEMPLATES / "google-gemma-3-4b-it.jinja").read_text())
    text, _ = tok.encode_chat([{"role": "system", "content": "Be brief."}, *EXCHANGE], tools=TOOLS)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert (
        '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><end_of_turn>\n'
    ) in text
    assert (
        "<start_of_turn>user\n<tool_response>\n18 C\n</tool_response>\n"
        "<tool_response>\nsunny\n</tool_response><end_of_turn>\n<start_of_turn>model\n"
    ) in text
