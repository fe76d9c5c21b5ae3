"""gpt-oss (GptOssForCausalLM) against transformers on a tiny random checkpoint: attention sinks,
sliding-window attention on every other layer, YaRN RoPE, the router's bias and softmax of its
top-k logits, the experts' biases and clamped SwiGLU, gate and up interleaved as transformers
stores them. Logits on both attention backends and layer executors, greedy tokens and prompt
logprobs through the engine, a token's bits alone and batched, chunked, preempted, drafted or
from the prefix cache; the kernel's sinks against transformers' eager attention; MXFP4 experts
read exactly (against transformers' dequantization, and run as 8-bit groups); the gpt-oss-20b
dummy shape."""

import json
import math
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from tests.engine_runs import assert_settings_give_the_bits_alone
from tests.model_runs import load, prompt_logits, transformers_logits
from tests.test_attention_cpu import REFERENCE, build
from tests.test_gguf_loader import VOCAB, write_gguf
from tests.test_hf_loader import _random_hf_model, _write_tokenizer
from tests.test_moe_models import ENGINE_SETTINGS
from tinyllm import LLM, SamplingParams
from tinyllm.loaders import dummy
from tinyllm.loaders.dummy import dummy_config, parameter_count
from tinyllm.loaders.gguf import gguf_config, open_gguf
from tinyllm.loaders.hf import hf_config
from tinyllm.loaders.mxfp4 import E2M1_TIMES_2, hf_codes, mxfp4_groups
from tinyllm.model.attention import cpu, get_backend
from tinyllm.model.attention.cuda import CudaBackend
from tinyllm.model.config import ModelLoadError, UnsupportedModelError
from tinyllm.model.cpu_library import library_error
from tinyllm.model.layer_executor import choose_layer_executor
from tinyllm.model.layer_ops import moe_experts_torch
from tinyllm.model.quant import QuantLinear, int8_groups, unpack

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)

CPU = torch.device("cpu")
Q = gguf.GGMLQuantizationType
EXPERTS, WIDTH, WINDOW = 4, 64, 6
GPT_OSS = dict(
    num_local_experts=EXPERTS, num_experts_per_tok=2, intermediate_size=WIDTH, head_dim=16,
    # A window shorter than most prompts below, on layer 0 (transformers' default layer_types).
    sliding_window=WINDOW,
    # A limit the random gates and ups cross, so the clamps change the output.
    swiglu_limit=0.5,
    # YaRN over a short pretrained context: head_dim 16's frequencies kept, ramped and scaled.
    rope_parameters=dict(
        rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=16, rope_theta=10000.0,
    ),
)  # fmt: skip


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def random_gpt_oss() -> torch.nn.Module:
    reference = _random_hf_model("GptOss", **GPT_OSS)
    with torch.no_grad():  # sinks of std 2: some heads give the sink most of their weight
        for layer in reference.model.layers:
            layer.self_attn.sinks.mul_(20)
    return reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    reference = random_gpt_oss()
    path = tmp_path_factory.mktemp("gpt_oss")
    reference.save_pretrained(path)
    _write_tokenizer(path)
    return reference, path


def test_config_reads_gpt_oss(checkpoint):
    c = hf_config(checkpoint[1])
    assert c.architecture == "gpt_oss" and c.attention_sinks and c.o_proj_bias and c.moe_bias
    assert (c.sliding_window, c.sliding_window_layers) == (WINDOW, (0,))
    assert c.softmax_after_topk and not c.norm_topk_prob
    assert (c.swiglu_limit, c.swiglu_alpha) == (0.5, 1.702)
    assert c.rope_scaling["rope_type"] == "yarn" and c.moe_intermediate_size == WIDTH
    half = c.shard(2)  # tests/test_tensor_parallel_model.py runs it
    assert (half.num_heads, half.num_kv_heads, half.moe_intermediate_size) == (2, 1, WIDTH // 2)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_logits_match_transformers(checkpoint, backend):
    reference, path = checkpoint
    model = load(path)
    batch = prompts(7, 12, 3)
    executors = ("modules", "fused") if backend == "cpu" else ("modules",)
    for executor in executors:
        model.set_layer_executor(executor)
        for prompt, ours in zip(batch, prompt_logits(model, batch, backend=backend), strict=True):
            expected = transformers_logits(reference, prompt)
            assert expected.std() > 0.3
            torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_each_difference_from_llama_changes_the_logits(checkpoint):
    """The test above would catch a missing sink, clamp or bias: each changes the logits by far
    more than its tolerance."""
    reference, path = checkpoint
    model = load(path)
    model.set_layer_executor("fused")
    layer = model.model.layers[0]
    (prompt,) = prompts(12)
    expected = transformers_logits(reference, prompt)

    def gap() -> float:
        layer.load_op_args()
        return (prompt_logits(model, [prompt])[0] - expected).abs().max().item()

    assert gap() < 1e-4
    changes = {
        "sinks": (layer.self_attn, "sinks", None),
        "clamp": (layer.mlp, "swiglu_limit", 100.0),
        "o bias": (layer.self_attn.o_proj, "bias", None),
        "router bias": (layer.mlp.gate, "bias", None),
    }
    for what, (module, name, value) in changes.items():
        kept = getattr(module, name)
        setattr(module, name, value)
        assert gap() > 1e-2, what
        setattr(module, name, kept)


def test_other_quantizations_are_refused_naming_what_is_read(checkpoint, tmp_path):
    config = json.loads((checkpoint[1] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quantized by 'bitsandbytes'.*reads mxfp4"):
        hf_config(tmp_path)


def test_executor_auto_fuses_gpt_oss(checkpoint):
    model = load(checkpoint[1])
    assert choose_layer_executor("auto", model, get_backend("cpu", CPU)) == "fused"


def test_greedy_tokens_and_prompt_logprobs_match_transformers(checkpoint):
    reference, path = checkpoint
    dense = LLM(str(path), "float32", quantization="none", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    batch = prompts(6, 11)
    for prompt, out in zip(batch, dense.generate(batch, params, use_tqdm=False), strict=True):
        ids = list(prompt)
        for _ in range(8):
            ids.append(int(transformers_logits(reference, ids)[-1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt) :]
        logprobs = transformers_logits(reference, prompt).log_softmax(-1)
        expected = [logprobs[i - 1, t].item() for i, t in enumerate(prompt) if i]
        ours = [lp.logprob for lp in out.prompt_logprobs[1:]]
        assert ours == pytest.approx(expected, abs=1e-4)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint[1]), "float32", quantization="int4", max_model_len=128)


def test_engine_settings_give_each_request_its_bits_alone(llm):
    """int4 on the kernels, fused: a batch, chunked prefill, the prefix cache, preemption and
    ngram speculative decoding give each request the tokens and logprobs it gets alone."""
    base = prompts(9, 4, 13, 7)
    batch = base + [base[0] + base[2][:5], base[2][:8] * 2]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    settings = {"batched": {}, **ENGINE_SETTINGS}
    assert_settings_give_the_bits_alone(llm, batch, params, settings)


def test_a_tokens_logits_do_not_depend_on_its_batch(llm):
    model = llm.engine.model
    assert model.layer_executor == "fused"
    target, *others = prompts(10, 17, 5, 23)
    (alone,) = prompt_logits(model, [target])
    for n in range(1, len(others) + 1):
        assert prompt_logits(model, [*others[:n], target])[-1].equal(alone)


def test_the_expert_op_matches_its_torch_twin(llm):
    """moe_experts' C++ op, with the experts' biases and the clamped SwiGLU, against the torch
    steps that spell them out."""
    moe = llm.engine.model.model.layers[1].mlp
    x = torch.randn(
        30, llm.engine.model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    ids, weights = moe.route(x)
    assert len(ids.unique()) == EXPERTS
    args = (moe.gate_up_bias, moe.down_bias, moe.swiglu_limit, moe.swiglu_alpha)
    op = torch.ops.tinyllm.moe_experts(x, ids, weights, moe.gate_up, moe.down, WIDTH, *args)
    twin = moe_experts_torch(x, ids, weights, moe.gate_up, moe.down, WIDTH, *args)
    torch.testing.assert_close(op, twin, atol=1e-5, rtol=1e-5)


# ---- attention sinks in the CPU kernel and the reference ----


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_sinks_match_the_reference_and_keep_a_tokens_bits(window, dtype):
    """Decode and prefill rows with sinks: the kernel against the reference backend, and each
    token's output the same bits as a step of its own."""
    backend, why = cpu.load_cpu_backend()
    assert backend is not None, why
    rows = [(40, 1), (9, 1), (70, 33), (50, 50)]
    args, _ = build(rows, bs=4, Hq=6, Hkv=2, D=64, seed=3, dtype=dtype)
    sinks = (torch.randn(6, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    scale = 64**-0.5
    out = backend.attend(*args, scale=scale, window=window, sinks=sinks)
    expected = REFERENCE.attend(*args, scale=scale, window=window, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    plain = REFERENCE.attend(*args, scale=scale, window=window)
    assert (plain - expected).abs().max() > 0.1  # the sinks matter
    q, k, v, k_cache, v_cache, meta = args
    for r in range(len(rows)):  # each row alone: the same bits
        start, end = meta.query_start_loc[r : r + 2].tolist()
        alone = type(meta)(
            slot_mapping=meta.slot_mapping[start:end],
            block_tables=meta.block_tables[r : r + 1],
            seq_lens=meta.seq_lens[r : r + 1],
            query_start_loc=torch.tensor([0, end - start]),
            num_decodes=int(end - start == 1),
            seq_lens_cpu=meta.seq_lens_cpu[r : r + 1],
            query_lens_cpu=meta.query_lens_cpu[r : r + 1],
        )
        mine = backend.attend(q[start:end], None, None, k_cache, v_cache, alone, scale, window,
                              None, sinks)  # fmt: skip
        assert mine.equal(out[start:end]), r


def test_the_reference_sinks_are_transformers_eager_attention():
    """The reference backend's sinks against transformers' gpt-oss eager attention, causal."""
    (q, k, v, k_cache, v_cache, meta), _ = build([(12, 12)], bs=4, Hq=4, Hkv=2, D=16, seed=5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)) * 2
    ours = REFERENCE.attend(q, k, v, k_cache, v_cache, meta, 0.25, None, None, sinks)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks = 2, sinks
    mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    theirs, _ = eager_attention_forward(
        module, *(t.transpose(0, 1)[None] for t in (q, k, v)), mask, scaling=0.25
    )
    torch.testing.assert_close(ours, theirs[0], atol=1e-6, rtol=1e-5)


def test_the_cuda_backend_refuses_sinks_by_name():
    """Its kernel has no sinks: it says so before launching anything (`auto` on CUDA takes the
    reference for gpt-oss anyway, for its sliding window)."""
    (q, k, v, k_cache, v_cache, meta), _ = build([(5, 5)], bs=4, Hq=2, Hkv=1, D=8, seed=0)
    with pytest.raises(ValueError, match="no attention sinks .*attention_backend='reference'"):
        CudaBackend(kernel=None).attend(q, k, v, k_cache, v_cache, meta, 1.0, sinks=torch.zeros(2))


# ---- MXFP4 experts ----


def test_the_e2m1_table_is_the_ocp_specs():
    """OCP MX v1.0's E2M1 values (sign, 2 exponent bits of bias 1, 1 mantissa bit), worked out
    from the encoding, and transformers' table, times 2."""
    spec = []
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
        value = man * 0.5 if exp == 0 else (1 + man / 2) * 2 ** (exp - 1)
        spec.append(-value if sign else value)
    assert (E2M1_TIMES_2 / 2).tolist() == spec == FP4_VALUES


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (..., groups, 16) of random codes and scales (..., groups) of 2^-9 .. 2^-4."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 124, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_groups_equal_transformers_dequantization():
    blocks, scales = random_mxfp4((3, 20, 4), seed=0)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    for e in range(3):
        groups = mxfp4_groups(hf_codes(blocks[e]), scales[e])
        assert groups.dequantize().equal(expected[e])
        # Packed for the int8 kernel and read back: the same values, bit for bit.
        assert unpack(QuantLinear(groups, None, torch.float32, 128).packed, 8)[:20].equal(
            expected[e]
        )
    scales[1, 3, 2] = 140  # 2^13: m = -128 d overflows fp16's range
    with pytest.raises(ModelLoadError, match=r"MXFP4 scale 140 .* outside 104\.\.136"):
        mxfp4_groups(hf_codes(blocks[1]), scales[1])
    blocks[1, 3, 2] = 0  # a block of zeros needs no scale
    assert mxfp4_groups(hf_codes(blocks[1]), scales[1]).dequantize()[3, 64:96].eq(0).all()


def test_an_mxfp4_checkpoint_runs_its_experts_as_stored(checkpoint, tmp_path):
    """The checkpoint with its experts in MXFP4 (as the released ones are): transformers, given
    the dequantized experts, against tinyllm reading the blocks, dense (exactly the dequantized
    weights, so the logits match to fp32 rounding) and as 8-bit groups on the int8 kernel (the
    other linears on int8's grid too: only the activations' rounding to 8 bits differs)."""
    path = checkpoint[1]
    reference = random_gpt_oss()
    with torch.no_grad():  # the other linears on int8's grid, so that int8 keeps them as they are
        for name, m in reference.named_modules():
            if isinstance(m, torch.nn.Linear) and not name.endswith("router"):
                m.weight.copy_(int8_groups(m.weight).dequantize())
    reference.save_pretrained(tmp_path / "dense")
    tensors = load_file(tmp_path / "dense" / "model.safetensors")
    hidden = reference.config.hidden_size
    for i, layer in enumerate(reference.model.layers):
        experts = layer.mlp.experts
        for j, (proj, rows, cols) in enumerate(
            [("gate_up_proj", 2 * WIDTH, hidden), ("down_proj", hidden, WIDTH)]
        ):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = random_mxfp4((EXPERTS, rows, cols // 32), seed=10 * i + j)
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _write_tokenizer(tmp_path)
    batch = prompts(9, 5)
    dense = load(tmp_path)
    for prompt, ours in zip(batch, prompt_logits(dense, batch), strict=True):
        torch.testing.assert_close(
            ours, transformers_logits(reference, prompt), atol=1e-4, rtol=1e-4
        )
    stored = load(tmp_path, quantization="auto")  # int8: the blocks as stored
    expert = stored.model.layers[1].mlp.experts[2]
    assert expert.gate_up_proj.bits == 8
    gate_up = reference.model.layers[1].mlp.experts.gate_up_proj[2].T  # gate and up interleaved
    assert unpack(expert.gate_up_proj.packed, 8)[: 2 * WIDTH].equal(
        torch.cat([gate_up[0::2], gate_up[1::2]])
    )
    for prompt, ours in zip(batch, prompt_logits(stored, batch), strict=True):
        expected = transformers_logits(reference, prompt)
        torch.testing.assert_close(ours, expected, rtol=0, atol=0.02 * expected.std().item())
        assert ours.argmax(-1).equal(expected.argmax(-1))


# ---- GGUF (llama.cpp's gpt-oss files) ----


def on_grid(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    """`w` rounded to `qtype`'s blocks along its last dim, as a file of that type holds it."""
    blocks = gguf.quants.quantize(w.contiguous().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).reshape(w.shape)


# Hugging Face's names of gpt-oss's tensors and llama.cpp's, but for the experts'.
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{
        f"self_attn.{hf}_proj.{kind}": f"attn_{ours}.{kind}"
        for hf, ours in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
        for kind in ("weight", "bias")
    },
}  # fmt: skip


def _experts(blk: str, kind: str, w: torch.Tensor) -> dict:
    """A layer's stacked experts' tensor `kind` as the converter writes it: gate and up apart
    (gate_up's even and odd columns), each expert (out, in), the weights MXFP4 (rounded in
    place to what the file holds)."""
    bias = kind.endswith("_bias")
    parts = {"down": w} if kind.startswith("down") else {"gate": w[..., 0::2], "up": w[..., 1::2]}
    out = {}
    for part, t in parts.items():
        if bias:
            out[f"{blk}ffn_{part}_exps.bias"] = t.numpy().copy()
            continue
        t.copy_(on_grid(t.transpose(1, 2), Q.MXFP4).transpose(1, 2))
        out[f"{blk}ffn_{part}_exps.weight"] = (t.transpose(1, 2).numpy(), Q.MXFP4)
    return out


def write_gpt_oss_gguf(path: Path, reference: torch.nn.Module) -> Path:
    """`reference` as llama.cpp's converter writes gpt-oss, its weights first rounded in place
    to what the file holds: the experts in MXFP4, the other matrices Q8_0, the embeddings, the
    router, norms, biases and sinks F32."""
    c, tensors = reference.config, {}
    with torch.no_grad():
        for name, w in reference.state_dict().items():
            if not name.startswith("model.layers."):
                gguf_name = GGUF_NAMES[name]
            else:
                _, _, i, rest = name.split(".", 3)
                if rest.startswith("mlp.experts."):
                    tensors |= _experts(f"blk.{i}.", rest.removeprefix("mlp.experts."), w)
                    continue
                gguf_name = f"blk.{i}.{GGUF_NAMES[rest]}"
            if w.ndim == 2 and "embed" not in name and "router" not in name:
                w.copy_(on_grid(w, Q.Q8_0))
                tensors[gguf_name] = (w.numpy(), Q.Q8_0)
            else:
                tensors[gguf_name] = w.numpy().copy()
    rope = c.rope_parameters
    metadata = {
        "gpt-oss.feed_forward_length": WIDTH, "gpt-oss.expert_feed_forward_length": WIDTH,
        "gpt-oss.expert_count": EXPERTS, "gpt-oss.expert_used_count": c.num_experts_per_tok,
        "gpt-oss.attention.key_length": c.head_dim, "gpt-oss.attention.sliding_window": WINDOW,
        "gpt-oss.context_length": c.max_position_embeddings, "gpt-oss.vocab_size": c.vocab_size,
        "gpt-oss.swiglu_clamp_exp": [c.swiglu_limit] * c.num_hidden_layers,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(c.vocab_size)],
        "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": rope["factor"],
        "gpt-oss.rope.scaling.original_context_length": rope["original_max_position_embeddings"],
    }  # fmt: skip
    return write_gguf(path, {}, "gpt-oss", metadata=metadata, extra_tensors=tensors)


def test_a_gguf_file_matches_transformers(tmp_path):
    """A gpt-oss GGUF as llama.cpp's converter writes one (MXFP4 experts): its config as the
    Hugging Face checkpoint's, and its logits as transformers' on the weights the file holds:
    dense within 1e-4, and with quantization auto (int8: the MXFP4 and Q8_0 blocks as stored)
    within 2% of the logits' spread."""
    reference = random_gpt_oss()
    path = write_gpt_oss_gguf(tmp_path / "m.gguf", reference)
    reference.save_pretrained(tmp_path / "hf")
    config, expected = gguf_config(open_gguf(path)), hf_config(tmp_path / "hf")
    fields = (
        "architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "sliding_window", "sliding_window_layers", "attention_bias", "o_proj_bias",
        "attention_sinks", "moe_bias", "softmax_after_topk", "norm_topk_prob", "head_dim",
        "swiglu_limit",
    )  # fmt: skip
    for field in fields:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rope_scaling.items() <= expected.rope_scaling.items()
    batch = prompts(9, 5)
    dense = load(path)
    for prompt, ours in zip(batch, prompt_logits(dense, batch), strict=True):
        torch.testing.assert_close(
            ours, transformers_logits(reference, prompt), atol=1e-4, rtol=1e-4
        )
    stored = load(path, quantization="auto")
    assert stored.model.layers[0].mlp.experts[1].down_proj.bits == 8
    for prompt, ours in zip(batch, prompt_logits(stored, batch), strict=True):
        expected_logits = transformers_logits(reference, prompt)
        atol = 0.02 * expected_logits.std().item()
        torch.testing.assert_close(ours, expected_logits, rtol=0, atol=atol)
        assert ours.argmax(-1).equal(expected_logits.argmax(-1))


# ---- the gpt-oss-20b shape as dummy weights ----


def test_the_gpt_oss_20b_shape_counts_transformers_parameters():
    config = dummy_config("gpt-oss-20b")[2]
    import transformers

    hf = transformers.GptOssConfig.from_json_file(dummy.named_configs()["gpt-oss-20b"])
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(hf)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    assert math.isclose(parameter_count(config) / 1e9, 20.91, abs_tol=0.01)


def test_the_gpt_oss_20b_shape_is_refused_first_where_it_does_not_fit(monkeypatch):
    """At int8 its 20.9B parameters need more than this 23 GB class of machine has."""
    monkeypatch.setattr(dummy, "available_bytes", lambda device: 23 * 2**30)
    with pytest.raises(ModelLoadError, match=r"20\.91B parameters in int8 need about 2\d\.\d GiB"):
        dummy.load_dummy("gpt-oss-20b", "int8", torch.float32)


def test_dummy_weights_of_a_tiny_gpt_oss_run(checkpoint):
    reference, path = checkpoint
    config = dummy_config(str(path / "config.json"))[2]
    assert parameter_count(config) == sum(p.numel() for p in reference.parameters())
    tiny = LLM(str(path / "config.json"), load_format="dummy", dtype="float32", num_blocks=16)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (out,) = tiny.generate([[5, 17, 42, 7]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
