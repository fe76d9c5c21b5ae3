"""The int8 K/V cache (kv_cache_dtype="int8"): the quantization's bits in Python and C++, the CPU
kernel against the reference backend on the same int8 caches (fp32 and bf16 queries, windows,
sinks, soft-capping), a token's bits alone or batched through the engine, closeness to the
unquantized cache, the pool's size, and the refusals."""

import math

import pytest
import torch
from hypothesis import given, settings

from tests.engine_runs import engine_on, run_all
from tests.test_attention_cpu import WINDOWS, assert_matches_reference, attend_span, build, steps
from tinyllm.engine.config import EngineConfig
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_sizing import build_kv_cache_manager
from tinyllm.engine.worker.model_runner import ModelRunner
from tinyllm.model.attention import cpu
from tinyllm.model.attention.backend import AttentionBackend
from tinyllm.model.attention.cuda import CudaBackend
from tinyllm.model.attention.int8_cache import dequantize, quantize
from tinyllm.model.attention.reference import ReferenceBackend

REFERENCE = ReferenceBackend()


@pytest.fixture(scope="module")
def backend() -> cpu.CPUBackend:
    b, why = cpu.load_cpu_backend()
    if b is None:
        pytest.fail(why)
    return b


def int8_step(step: dict, dtype=torch.float32):
    """build's step with its caches quantized (garbage slots included: codes of random values)."""
    (q, k, v, k_cache, v_cache, meta), unused = build(**step, dtype=dtype)
    return (q, k, v, quantize(k_cache), quantize(v_cache), meta), unused


@pytest.mark.parametrize("D", [6, 64, 80])
def test_each_group_keeps_its_largest_value_and_the_rest_within_half_a_step(D):
    """Groups of 32 values, the last one shorter where D is not a multiple (6, 80)."""
    x = torch.randn(50, 3, D) * torch.logspace(-3, 3, 50)[:, None, None]
    x[7, 1] = 0  # a row of zeros: scales 0, codes 0
    x[8, 2, -1] = 1e4  # one large value coarsens its own group only
    rows = quantize(x)
    assert rows.shape == (50, 3, D + 4 * math.ceil(D / 32)) and rows.dtype == torch.int8
    back = dequantize(rows, torch.float32)
    assert torch.equal(back[7, 1], torch.zeros(D))
    for g in range(0, D, 32):
        xg, bg = x[..., g : g + 32], back[..., g : g + 32]
        amax = xg.abs().amax(-1, keepdim=True)
        assert ((bg - xg).abs() <= amax / 254 * 1.0001).all()
    if D > 32:
        first = back[8, 2, :32] - x[8, 2, :32]
        assert first.abs().max() <= x[8, 2, :32].abs().max() / 254 * 1.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_write_is_the_python_write_bit_for_bit(backend, dtype):
    """The fused layer's C++ write and the modules' Python write (attention/backend.py) store the
    same codes and scales, so either executor fills the cache with the same bits."""
    rows = [(30, 1), (20, 20), (45, 9)]
    (q, k, v, _, _, meta), _ = build(rows, bs=4, Hq=4, Hkv=2, D=64, seed=1, dtype=dtype)
    shape = (meta.block_tables.max() + 1, 4, 2, 72)
    caches = [torch.zeros(shape, dtype=torch.int8) for _ in range(4)]
    AttentionBackend.write(k, v, caches[0], caches[1], meta)
    out = q.new_empty(q.shape)
    backend.kernel(out, q, caches[2], caches[3], k, v, meta.slot_mapping, meta.block_tables,
                   meta.seq_lens, meta.query_start_loc, meta.num_rows, 0.125, None)  # fmt: skip
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].any()


@settings(max_examples=40, deadline=None)
@given(step=steps(), window=WINDOWS)
def test_the_kernel_matches_the_reference_on_int8_caches(backend, step, window):
    """fp32 queries: the reference's output within fp32 rounding, and whatever the slots no
    query sees hold (NaN scales, any codes), the same bits."""
    args, unused = int8_step(step)
    # Garbage: codes -1 and scales of NaN (0xFFFFFFFF); codes 127 and scales of 3.4e38.
    assert_matches_reference(backend, args, unused, step, window, -1, 127)


@settings(max_examples=15, deadline=None)
@given(step=steps(), window=WINDOWS)
def test_bf16_queries_on_int8_caches_accumulate_in_fp32(backend, step, window):
    (q, k, v, k_cache, v_cache, meta), _ = int8_step(step, torch.bfloat16)
    scale = step["D"] ** -0.5
    out = backend.attend(q, k, v, k_cache, v_cache, meta, scale, window)
    assert out.dtype == torch.bfloat16
    expected = REFERENCE.attend(q.float(), None, None, k_cache, v_cache, meta, scale, window)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_and_softcap_on_int8_caches(backend, dtype, window):
    """gpt-oss's sinks and Gemma 2's soft-capping: the kernel against the reference, and each
    token of a 37-token chunk the same bits as its own step."""
    L, n = 101, 37
    step = dict(rows=[(40, 1), (L, n)], bs=16, Hq=6, Hkv=2, D=64, seed=7)
    (q, k, v, k_cache, v_cache, meta), _ = int8_step(step, dtype)
    q = q * 3  # scores of several units, where a cap of 2 bites
    sinks = (torch.randn(6, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: against the fp32 reference
    for softcap, sink in ((2.0, None), (None, sinks), (2.0, sinks)):
        out = backend.attend(q, k, v, k_cache, v_cache, meta, 0.125, window, softcap, sink)
        fp32 = None if sink is None else sink.float()
        expected = REFERENCE.attend(
            q.float(), None, None, k_cache, v_cache, meta, 0.125, window, softcap, fp32
        )
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    # The second row alone, then token by token: the same bits as in the batch above.
    one = (q[1:], None, None, k_cache, v_cache)
    args = (*one, type(meta)(meta.slot_mapping[1:], meta.block_tables[1:], meta.seq_lens[1:],
                             torch.tensor([0, n]), 0, [L], [n]))  # fmt: skip
    whole = backend.attend(*args, 0.125, window, 2.0, sinks)
    assert torch.equal(whole, out[1:])
    for first in range(L - n, L, 11):
        end = min(first + 11, L)
        part = attend_span_capped(backend, args, first, end, window, sinks)
        assert torch.equal(part, whole[first - (L - n) : end - (L - n)]), first


def attend_span_capped(backend, args, first, end, window, sinks):
    q, _, _, k_cache, v_cache, meta = args
    at, m = meta.seq_lens_cpu[0] - meta.query_lens_cpu[0], end - first
    slots = meta.slot_mapping[first - at : end - at]
    span = type(meta)(slots, meta.block_tables, torch.tensor([end]), torch.tensor([0, m]),
                      int(m == 1), [end], [m])  # fmt: skip
    return backend.attend(q[first - at : end - at], None, None, k_cache, v_cache, span, 0.125,
                          window, 2.0, sinks)  # fmt: skip


@pytest.mark.parametrize("D", [8, 64, 128])
def test_a_tokens_bits_do_not_depend_on_its_chunk_on_int8_caches(backend, D):
    L, n = 101, 37
    args, _ = int8_step(dict(rows=[(L, n)], bs=16, Hq=9, Hkv=3, D=D, seed=D), torch.bfloat16)
    whole = attend_span(backend, args, L - n, L, D**-0.5, 5)
    for size in (1, 3, 16, 17):
        for first in range(L - n, L, size):
            end = min(first + size, L)
            part = attend_span(backend, args, first, end, D**-0.5, 5)
            assert torch.equal(part, whole[first - (L - n) : end - (L - n)]), (size, first)


# ---- through the engine, on the default model as `LLM()` runs it ----

PROMPTS = [[100 + (i * 7919 + j * 31) % 40000 for j in range(40 + 23 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def test_int8_tokens_are_the_same_bits_alone_or_batched(default_config_llm):
    """Each request alone on an int8 engine, then all four together: with the fused layers
    (the C++ write), with the modules (the Python write), and in prompt chunks of 16 tokens."""
    int8 = {"kv_cache_dtype": "int8"}
    alone = [run_all(engine_on(default_config_llm, **int8), [p], GREEDY)[0] for p in PROMPTS]
    for setting in (
        {},
        {"layer_executor": "modules"},
        {"max_num_batched_tokens": 16, "enable_prefix_caching": False},
    ):
        engine = engine_on(default_config_llm, kv_cache_dtype="int8", **setting)
        together = run_all(engine, PROMPTS, GREEDY)
        for a, b in zip(alone, together, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, setting
            assert b.outputs[0].logprobs == a.outputs[0].logprobs, setting


def prompt_nll(llm, kv_cache_dtype: str, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = run_all(engine_on(llm, kv_cache_dtype=kv_cache_dtype), [prompt], params)[0]
    return -sum(lp.logprob for lp in out.prompt_logprobs[1:]) / (len(prompt) - 1)


def test_int8_perplexity_is_within_a_tenth_of_a_percent_of_the_full_cache(default_config_llm):
    """Perplexity of an English text of ~600 tokens, the int8 cache against the cache in the
    model's dtype (bf16 where the CPU has it): the issue's bound, 0.1%, on the default model."""
    text = (
        "The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "those used to make wine. Before him, books in Europe were copied by hand, mostly in "
        "monasteries, and a single Bible could take a scribe years. "
    ) * 8
    prompt = default_config_llm.tokenizer.encode(text)
    full, int8 = (prompt_nll(default_config_llm, d, prompt) for d in ("auto", "int8"))
    assert full != int8  # the cache is quantized: the logprobs move
    print(f"perplexity: {math.exp(full):.5f} cache of the model's dtype, {math.exp(int8):.5f} int8")
    assert abs(math.exp(int8 - full) - 1) < 1e-3, (math.exp(full), math.exp(int8))


# ---- the pool and the refusals ----


def test_the_same_memory_holds_about_twice_the_tokens_of_a_bf16_cache(default_gguf_path):
    """The default model in bf16: 64-dim heads of 128 bytes, or 72 as int8 (codes, 2 scales)."""
    from tinyllm import LLM

    llm = LLM(str(default_gguf_path), dtype="bfloat16", num_blocks=8, max_model_len=4096)
    model, memory = llm.engine.model, 64 << 20
    blocks = {
        d: build_kv_cache_manager(
            model, EngineConfig(kv_cache_dtype=d, kv_cache_memory=memory, max_num_seqs=999), 4096
        ).num_blocks
        for d in ("auto", "int8")
    }
    assert 1.75 < blocks["int8"] / blocks["auto"] < 1.8
    runner = ModelRunner(model, 4, 16, REFERENCE, "modules", kv_cache_dtype="int8")
    k_cache, v_cache = runner.kv_caches[0]
    c = model.config
    assert k_cache.dtype == torch.int8 and k_cache.shape == (5, 16, c.num_kv_heads, 72)


def test_the_kernel_refuses_an_int8_cache_of_another_width(backend):
    """A 64-dim head's int8 row is 72 bytes (64 codes, 2 fp32 scales): 68 is refused, named."""
    (q, k, v, k_cache, v_cache, meta), _ = int8_step(dict(rows=[(5, 5)], bs=4, Hq=2, Hkv=1, D=64,
                                                           seed=0))  # fmt: skip
    narrow = k_cache[..., :68].contiguous()
    with pytest.raises(RuntimeError, match=r"must be .*72: q's head_dim 64 plus its int8 scales"):
        backend.attend(q, k, v, narrow, narrow, meta, 0.125)


def test_an_unknown_dtype_and_the_cuda_backend_are_refused(tiny):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': choose one of auto, int8"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="the cuda attention backend reads caches of the model"):
        ModelRunner(tiny[0], 4, 16, CudaBackend(None), "modules", kv_cache_dtype="int8")


@pytest.mark.parametrize("command", [["serve"], ["generate", "Hi"], ["bench", "single"]])
def test_the_flag_reaches_the_engine_and_a_bad_value_is_a_usage_error(monkeypatch, capsys, command):
    from tinyllm.entrypoints import args as args_module
    from tinyllm.entrypoints import cli
    from tinyllm.entrypoints import llm as llm_module

    seen = {}
    monkeypatch.setattr(llm_module, "LLM", lambda **kwargs: seen.update(kwargs))
    parser = cli.build_parser()
    args_module.build_llm(parser.parse_args(command))
    assert seen["kv_cache_dtype"] == "auto"
    args_module.build_llm(parser.parse_args([*command, "--kv-cache-dtype", "int8"]))
    assert seen["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--kv-cache-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
