"""Mixture-of-experts families (model/moe.py): Qwen3-MoE, Mixtral and OLMoE from a Hugging Face
directory and from GGUF against transformers, dense fp32 and on the int4 kernels, on both
attention backends and layer executors; greedy tokens through the engine with chunked prefill,
the prefix cache, preemption and speculative decoding; tensor parallelism over two processes;
a token's bits alone and in a batch; the server with the official client; and Qwen2-MoE, still
refused, naming what it needs (gpt-oss: tests/test_gpt_oss.py)."""

import socket
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.engine_runs import assert_settings_give_the_bits_alone
from tests.http_server import openai_client
from tests.model_runs import load, prompt_logits, transformers_logits
from tests.test_gguf_loader import VOCAB, llama_cpp_permute, write_gguf
from tests.test_hf_loader import _random_hf_model, _write_tokenizer
from tinyllm import LLM, SamplingParams
from tinyllm.loaders import dummy
from tinyllm.loaders.dummy import dummy_config, dummy_weights, parameter_count
from tinyllm.loaders.gguf import GGUFTensor, gguf_config, open_gguf
from tinyllm.loaders.hf import hf_config
from tinyllm.loaders.model_loader import LoadConfig, load_model
from tinyllm.loaders.source import open_checkpoint
from tinyllm.loaders.stored import ALL
from tinyllm.model.attention import get_backend
from tinyllm.model.config import ModelLoadError, UnsupportedModelError
from tinyllm.model.cpu_library import library_error
from tinyllm.model.layer_executor import choose_layer_executor
from tinyllm.model.layer_ops import has_op, moe_experts_torch
from tinyllm.model.llama import Transformer
from tinyllm.model.moe import MoEArgs, SparseMoE
from tinyllm.model.quant import QuantLinear, unpack
from tinyllm.model.tensor_parallel import apply_tp

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
# Tiny shapes in whole groups of 32 (the int4 kernels'), also at TP=2: the experts' width 64.
FAMILIES = {
    # Qwen3-MoE with its middle layer dense (mlp_only_layers), renormalised top-k.
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
            num_hidden_layers=3, mlp_only_layers=[1], head_dim=16,
        ),
    ),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    # OLMoE: q/k norms over all heads' width; top-k not renormalised.
    "olmoe": (
        "Olmoe",
        dict(
            num_experts=8, num_experts_per_tok=2, intermediate_size=64, pad_token_id=None,
            eos_token_id=2,
        ),
    ),
}  # fmt: skip
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
MOE_FIELDS = (
    "architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "dense_mlp_layers", "qk_norm", "qk_norm_all_heads",
)  # fmt: skip
EXECUTORS = ("modules", "fused") if has_op("decoder_moe") else ("modules",)


def prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(transformers_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """A tinyllm model's weights, dense (int4 ones dequantized), in transformers 5's in-memory
    layout: q/k/v and the dense MLP's gate/up apart, each MoE layer's experts stacked in 3-D."""
    c = model.config
    weights = {name: p.detach() for name, p in model.named_parameters()}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            weights[f"{name}.weight"] = unpack(m.packed, m.bits)[: m.out_features, : m.in_features]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = weights.pop(f"{p}self_attn.qkv_proj.weight").split([q, kv, kv])
        for part, w in zip(("q_proj", "k_proj", "v_proj"), qkv, strict=True):
            weights[f"{p}self_attn.{part}.weight"] = w
        if not isinstance(layer.mlp, SparseMoE):
            gate, up = weights.pop(f"{p}mlp.gate_up_proj.weight").chunk(2)
            weights[f"{p}mlp.gate_proj.weight"], weights[f"{p}mlp.up_proj.weight"] = gate, up
            continue
        for kind in ("gate_up_proj", "down_proj"):
            experts = range(c.num_experts)
            stacked = [weights.pop(f"{p}mlp.experts.{e}.{kind}.weight") for e in experts]
            weights[f"{p}mlp.experts.{kind}"] = torch.stack(stacked)
    return weights


def reference_with(model: Transformer, family: str) -> torch.nn.Module:
    """transformers' model of `family` running `model`'s weights as it holds them."""
    reference = _random_hf_model(*FAMILIES[family][0:1], **FAMILIES[family][1])
    missing, unexpected = reference.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return reference


def write_moe_gguf(
    path: Path, reference: torch.nn.Module, family: str, qtype: Q, per_expert: bool = False
) -> Path:
    """`reference`'s weights as llama.cpp's converter writes the family: each layer's experts
    stacked in ffn_{gate,up,down}_exps (`per_expert`: as ffn_{gate,up,down}.E, Mixtral's files
    of 2023), its router as ffn_gate_inp; llama's q/k permuted. 2-D and 3-D weights as `qtype`,
    norms and the router in F32."""
    arch, c = GGUF_ARCH[family], reference.config
    writer = gguf.GGUFWriter(path, arch)
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    for key, value in {
        "block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads, "expert_count": experts,
        "expert_used_count": c.num_experts_per_tok, "vocab_size": c.vocab_size,
    }.items():  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    if family == "qwen3_moe":
        writer.add_uint32(f"{arch}.expert_feed_forward_length", width)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(c.vocab_size)])
    names = {
        "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
        "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
        "mlp.gate.weight": "ffn_gate_inp", "mlp.down_proj.weight": "ffn_down",
        "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
        "mlp.experts.down_proj": "ffn_down_exps",
    }  # fmt: skip
    sd = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    tensors = {
        "token_embd.weight": sd.pop("model.embed_tokens.weight"),
        "output_norm.weight": sd.pop("model.norm.weight"),
        "output.weight": sd.pop("lm_head.weight"),
    }
    for name, w in sd.items():
        _, _, i, suffix = name.split(".", 3)
        if suffix == "mlp.experts.gate_up_proj":
            tensors[f"blk.{i}.ffn_gate_exps.weight"] = w[:, :width]
            tensors[f"blk.{i}.ffn_up_exps.weight"] = w[:, width:]
            continue
        if arch == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = c.num_attention_heads if "q_proj" in suffix else c.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        tensors[f"blk.{i}.{names[suffix]}.weight"] = w
    for name in [n for n in tensors if per_expert and "_exps." in n]:
        kind = name.split(".")[2].removesuffix("_exps")  # ffn_gate, ffn_up, ffn_down
        for e, w in enumerate(tensors.pop(name)):
            tensors[name.replace(f"{kind}_exps.", f"{kind}.{e}.")] = w
    for name, w in tensors.items():
        if w.ndim == 1 or qtype == Q.F32 or "ffn_gate_inp" in name:
            writer.add_tensor(name, np.ascontiguousarray(w))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family: str, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """The family's random transformers model, saved with a tokenizer."""
    reference = _random_hf_model(*FAMILIES[family][0:1], **FAMILIES[family][1])
    path = tmp_path_factory.mktemp(family)
    reference.save_pretrained(path)
    _write_tokenizer(path)
    return reference, path


def test_config_reads_the_experts(family, checkpoint):
    config = hf_config(checkpoint[1])
    assert config.architecture == family and config.num_experts_per_tok == 2
    assert config.num_experts == (4 if family == "mixtral" else 8)
    assert config.moe_intermediate_size == 64
    assert config.norm_topk_prob == (family != "olmoe")
    moe = [config.is_moe_layer(i) for i in range(config.num_layers)]
    assert moe == ([True, False, True] if family == "qwen3_moe" else [True, True])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_checkpoint_matches_transformers(family, checkpoint, backend):
    reference, path = checkpoint
    model = load(path)
    batch = prompts(7, 12, 3)
    for executor in EXECUTORS:
        if backend == "reference" and executor == "fused":
            continue
        model.set_layer_executor(executor)
        for prompt, ours in zip(batch, prompt_logits(model, batch, backend=backend), strict=True):
            expected = transformers_logits(reference, prompt)
            assert expected.std() > 0.3
            torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def assert_int4_close(model: Transformer, family: str) -> None:
    """`model` (int4) against transformers running its dequantized weights: only the int4
    kernel's rounding of activations to 8 bits differs."""
    reference = reference_with(model, family)
    batch = prompts(9, 14)
    for executor in EXECUTORS:
        model.set_layer_executor(executor)
        for prompt, ours in zip(batch, prompt_logits(model, batch), strict=True):
            expected = transformers_logits(reference, prompt)
            torch.testing.assert_close(ours, expected, rtol=0, atol=0.02 * expected.std().item())
            assert ours.argmax(-1).equal(expected.argmax(-1))


def test_int4_checkpoint_matches_transformers(family, checkpoint):
    model = load(checkpoint[1], quantization="int4")
    layer = model.model.layers[0]
    assert layer.mlp.experts[1].gate_up_proj.bits == 4 and layer.mlp.experts[0].down_proj.bits == 4
    assert isinstance(layer.mlp.gate, torch.nn.Linear)  # the router stays dense
    assert_int4_close(model, family)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_0])
def test_gguf_matches_transformers(family, checkpoint, qtype, tmp_path):
    reference, hf_path = checkpoint
    path = write_moe_gguf(tmp_path / "m.gguf", reference, family, qtype)
    config, expected = gguf_config(open_gguf(path)), hf_config(hf_path)
    for field in MOE_FIELDS:
        assert getattr(config, field) == getattr(expected, field), field
    if qtype == Q.F32:
        model = load(path)
        for prompt, ours in zip(prompts(8, 5), prompt_logits(model, prompts(8, 5)), strict=True):
            torch.testing.assert_close(
                ours, transformers_logits(reference, prompt), atol=1e-4, rtol=1e-4
            )
        return
    checkpoint = open_checkpoint(str(path), torch.float32, keep_quantized=True)
    expert = checkpoint.tensors["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert expert.shape == (64, 64) and isinstance(expert, GGUFTensor)
    # Each expert's blocks are read from the file's map, not a copy of the stacked tensor.
    blocks = expert._blocks(ALL, ALL)[0]
    assert (
        np.shares_memory(blocks, expert.tensor.data)
        and blocks.nbytes * len(expert.tensor.data) == expert.tensor.n_bytes
    )
    model = load(path, quantization="auto")  # the file's Q4_0 blocks packed as stored
    assert model.model.layers[0].mlp.experts[0].gate_up_proj.bits == 4
    assert_int4_close(model, family)


def test_mixtral_gguf_with_an_expert_per_tensor(checkpoint, family, tmp_path):
    """Mixtral files converted before llama.cpp stacked the experts name each expert's own."""
    if family != "mixtral":
        pytest.skip("only Mixtral's files had this layout")
    reference = checkpoint[0]
    path = write_moe_gguf(tmp_path / "m.gguf", reference, family, Q.F32, per_expert=True)
    assert "blk.1.ffn_down.3.weight" in {t.name for t in open_gguf(path).tensors}
    model = load(path)
    for prompt, ours in zip(prompts(8, 5), prompt_logits(model, prompts(8, 5)), strict=True):
        torch.testing.assert_close(
            ours, transformers_logits(reference, prompt), atol=1e-4, rtol=1e-4
        )


# ---- the engine: greedy tokens, batch invariance, the server ----


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint[1]), "float32", quantization="int4", max_model_len=128)


def test_greedy_tokens_match_transformers(family, checkpoint, llm):
    """Dense fp32: the engine's greedy tokens are transformers' on the same weights."""
    reference, path = checkpoint
    dense = LLM(str(path), "float32", quantization="none", max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = prompts(6, 11)
    outs = dense.generate(batch, greedy, use_tqdm=False)
    for prompt, out in zip(batch, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 8)


ENGINE_SETTINGS = {
    "chunked": dict(max_num_batched_tokens=5),
    "prefix-cache": dict(enable_prefix_caching=True),
    "preemption": dict(num_blocks=9, block_size=4, max_num_batched_tokens=64),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}


def test_engine_settings_give_the_same_tokens_and_logprobs(llm):
    """int4 on the kernels: every engine setting gives each request the bits it gets alone."""
    base = prompts(9, 4, 13, 7)
    # Repeats, so the prefix cache hits and the ngram drafter finds its drafts.
    batch = base + [base[0] + base[2][:5], base[2][:8] * 2]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    assert_settings_give_the_bits_alone(llm, batch, params, ENGINE_SETTINGS)


def test_a_tokens_bits_do_not_depend_on_its_batch(llm):
    """A prompt's logits alone and among others, whose tokens pick other experts (so each
    expert's group of rows differs), are the same bits; the same for the expert op alone."""
    model = llm.engine.model
    target, *others = prompts(10, 17, 5, 23)
    (alone,) = prompt_logits(model, [target])
    for n in range(1, len(others) + 1):
        assert prompt_logits(model, [*others[:n], target])[-1].equal(alone)
    moe = model.model.layers[0].mlp
    x = torch.randn(40, model.config.hidden_size)
    ids, weights = moe.route(x)
    assert len(ids.unique()) > 2  # several experts, each a group of several rows
    full = moe_experts_torch(x, ids, weights, moe.gate_up, moe.down, moe.intermediate)
    for rows in (slice(0, 1), slice(3, 4), slice(5, 19)):
        part = moe_experts_torch(
            x[rows], ids[rows], weights[rows], moe.gate_up, moe.down, moe.intermediate
        )
        assert part.equal(full[rows])


def test_executor_choice_names_the_missing_op(llm):
    model = llm.engine.model
    chosen = choose_layer_executor("auto", model, get_backend("cpu", CPU))
    assert chosen == ("fused" if "fused" in EXECUTORS and model.config.architecture != "olmoe"
                      else "modules")  # fmt: skip
    if chosen == "modules":
        with pytest.raises(ValueError, match="cannot run here: .*(decoder_moe|q/k norms)"):
            choose_layer_executor("fused", model, get_backend("cpu", CPU))


def test_served_with_the_official_client(family, llm):
    if family != "qwen3_moe":
        pytest.skip("one family through the server is enough")
    with openai_client(llm) as client:
        out = client.completions.create(
            model=client.model, prompt="w5 w9 w13", max_tokens=6, temperature=0
        )
        stream = client.completions.create(
            model=client.model, prompt="w5 w9 w13", max_tokens=6, temperature=0, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    (expected,) = llm.generate("w5 w9 w13", greedy, use_tqdm=False)
    assert out.choices[0].text == expected.outputs[0].text and out.usage.completion_tokens
    assert streamed == out.choices[0].text


# ---- tensor parallelism: each rank holds every expert's slice of the FFN width ----

TP_PROMPTS = [[3, 17, 42, 8, 99], [5, 60, 2], [7, 7, 81, 33, 120, 64, 11]]


def _tp_logits(path: Path, rank: int, world_size: int) -> dict:
    out = {}
    for quantization in ("none", "int4"):
        config = LoadConfig(str(path), "float32", quantization, max_model_len=64)
        model = load_model(config, CPU, rank, world_size).model
        if world_size > 1:
            apply_tp(model)
        for executor in EXECUTORS:
            model.set_layer_executor(executor)
            out[quantization, executor] = torch.cat(prompt_logits(model, TP_PROMPTS))
    return out


def _tp_rank(rank: int, world_size: int, port: int, path: Path, out: Path) -> None:
    torch.set_num_threads(1)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
    try:
        torch.save(_tp_logits(path, rank, world_size), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_ranks_give_the_whole_models_logits(family, checkpoint, tmp_path):
    """On Qwen3-MoE (a dense layer among MoE ones; Mixtral's experts split the same way)."""
    path = checkpoint[1]
    if family == "olmoe":
        with pytest.raises(ValueError, match="q/k norms span all heads"):
            hf_config(path).shard(2)
        return
    if family != "qwen3_moe":
        pytest.skip("the experts' split is the same in every family")
    whole = _tp_logits(path, 0, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_rank, args=(2, port, path, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for variant, expected in whole.items():
        assert ranks[0][variant].equal(ranks[1][variant]), variant
        # The ranks add their partial sums in another order than one process, which in int4
        # can move an activation's 8-bit code by a step: measured within 2e-4 of the logits'
        # spread; a missing all-reduce moves them by about the spread itself.
        atol = 1e-3 * expected.std().item()
        torch.testing.assert_close(ranks[0][variant], expected, rtol=0, atol=atol)
        assert ranks[0][variant].argmax(-1).equal(expected.argmax(-1))


def test_gguf_ranks_read_their_slice_of_every_expert(checkpoint, family, tmp_path):
    """From a Q4_0 file, each of two ranks holds its half of every expert's FFN width: its rows
    of gate and of up, its columns of down, read from the file's blocks; the router whole."""
    if family == "olmoe":
        pytest.skip("OLMoE is not split (its q/k norms span all heads)")
    path = write_moe_gguf(tmp_path / "m.gguf", checkpoint[0], family, Q.Q4_0)
    config = LoadConfig(str(path), "float32", "none")
    whole = load_model(config, CPU).model.model.layers[0].mlp
    half = whole.intermediate // 2
    for rank in range(2):
        part = load_model(config, CPU, rank, 2).model.model.layers[0].mlp
        assert part.gate.weight.equal(whole.gate.weight)
        for e, (mine, all_) in enumerate(zip(part.experts, whole.experts, strict=True)):
            gate, up = all_.gate_up_proj.weight.chunk(2)
            rows = slice(rank * half, (rank + 1) * half)
            assert mine.gate_up_proj.weight.equal(torch.cat([gate[rows], up[rows]])), e
            assert mine.down_proj.weight.equal(all_.down_proj.weight[:, rows]), e


# ---- what is still refused ----


@pytest.mark.parametrize("arch,needs", [("qwen2moe", "a shared expert")])
def test_unsupported_moe_gguf_is_refused_naming_what_it_needs(arch, needs, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {}, arch, metadata={f"{arch}.expert_count": 8})
    with pytest.raises(UnsupportedModelError) as error:
        gguf_config(open_gguf(path))
    (line,) = str(error.value).splitlines()
    assert f"GGUF architecture {arch!r} is not supported: it needs {needs}" in line


# ---- dummy weights of MoE shapes ----


def test_dummy_weights_run_and_count_the_experts(family, checkpoint):
    """A MoE config.json as dummy weights: the parameters transformers' model has, experts
    and routers included, and greedy tokens on the int4 kernels with a dense router."""
    reference, path = checkpoint
    config = dummy_config(str(path / "config.json"))[2]
    count = sum(p.numel() for p in reference.parameters())
    assert parameter_count(config) == count
    assert sum(w.numel() for w in dummy_weights(config, "none", torch.float32).values()) == count
    dummy = LLM(str(path / "config.json"), load_format="dummy", dtype="float32", num_blocks=16)
    assert isinstance(dummy.engine.model.model.layers[0].mlp.gate, torch.nn.Linear)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (out,) = dummy.generate([[5, 17, 42, 7]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_a_moe_shape_too_big_for_memory_is_refused_first(monkeypatch):
    """The memory check counts every expert: Mixtral-8x7B's 46.7B parameters, not its 13B
    active ones."""
    monkeypatch.setattr(dummy, "available_bytes", lambda device: 30 * 2**30)
    with pytest.raises(ModelLoadError, match=r"46\.70B parameters in int4 need about 38\.\d GiB"):
        dummy.load_dummy("mixtral-8x7b", "int4", torch.float32)
    with pytest.raises(ModelLoadError, match=r"available; use a smaller config$"):
        dummy.load_dummy("mixtral-8x7b", "int4", torch.float32)


@pytest.mark.skipif(not has_op("decoder_moe"), reason="this build has no decoder_moe op")
def test_moe_args_are_the_ops_schema():
    """MoEArgs names decoder_moe's arguments after the step's (o, residual), in order."""
    schema = torch.ops.tinyllm.decoder_moe.default._schema
    assert [a.name for a in schema.arguments] == ["o", "residual", *MoEArgs._fields]
