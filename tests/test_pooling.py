"""Pooling models on the engine: LLM.embed and LLM.score against transformers' hidden states
and yes/no logits on a tiny random Qwen3; chunked, batched and alone the same; blocks freed;
bad requests refused with the limit named."""

import random
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer

from tests.encoder_runs import write_encoder
from tests.engine_runs import engine_on, run_all
from tinyllm import LLM
from tinyllm.engine.pooling_params import PoolingParams, PoolingSpec
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.sched.kv_cache_manager import KVCacheManager
from tinyllm.engine.sched.request import Request
from tinyllm.engine.sched.scheduler import Scheduler
from tinyllm.engine.step_message import ModelRunnerOutput
from tinyllm.engine.worker.model_runner import kv_bytes_per_token
from tinyllm.entrypoints.cli import main
from tinyllm.entrypoints.pooling import qwen3_reranker_prompt
from tinyllm.model.config import ModelLoadError

from .pooling_models import hf_pool, hf_yes_score, text, write_qwen3, write_qwen3_embedding


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3")
    return path, write_qwen3(path)


def _prompts(*lengths: int) -> list[list[int]]:
    rng = random.Random(sum(lengths))
    return [[rng.randrange(7, 96) for _ in range(n)] for n in lengths]


def _cosines(outputs, reference: list[torch.Tensor]) -> list[float]:
    return [
        torch.cosine_similarity(torch.tensor(o.outputs.embedding), r, dim=0).item()
        for o, r in zip(outputs, reference, strict=True)
    ]


@pytest.mark.parametrize("how", ["last", "mean", "cls"])
def test_embeddings_match_transformers_chunked_batched_and_alone(qwen3, how: str) -> None:
    path, ref = qwen3
    # A budget of 16 tokens a step: the 40- and 23-token prompts run in chunks.
    llm = LLM(str(path), dtype="float32", quantization="none", pooling=how,
              max_num_batched_tokens=16, threads=1)  # fmt: skip
    prompts = _prompts(5, 40, 23, 1)
    batched = llm.embed(prompts, use_tqdm=False)
    assert all(c >= 0.9999 for c in _cosines(batched, [hf_pool(ref, p, how) for p in prompts]))
    for out in batched:
        assert torch.tensor(out.outputs.embedding).norm().item() == pytest.approx(1, abs=1e-5)
    alone = [llm.embed(p, use_tqdm=False)[0] for p in prompts]
    for a, b in zip(batched, alone, strict=True):
        assert torch.allclose(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                              atol=1e-5)  # fmt: skip
    unchunked = LLM(str(path), dtype="float32", quantization="none", pooling=how, threads=1)
    whole = unchunked.embed(prompts, use_tqdm=False)
    assert min(_cosines(whole, [torch.tensor(o.outputs.embedding) for o in batched])) >= 0.99999
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.has_unfinished()
    assert llm.engine.kv.pool.peak_used > 0


def test_default_weights_embed_close_to_fp32(qwen3) -> None:
    """What users run: int4 weights on tinyllm's kernels, the default budget."""
    path, ref = qwen3
    llm = LLM(str(path), pooling="last", threads=1)
    prompts = _prompts(600, 7)  # over the default budget of 512: chunked
    outputs = llm.embed(prompts, use_tqdm=False)
    assert min(_cosines(outputs, [hf_pool(ref, p, "last") for p in prompts])) >= 0.99


def test_dimensions_normalize_and_truncation(qwen3) -> None:
    path, ref = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", pooling="mean", threads=1)
    prompt = _prompts(30)[0]
    full = torch.tensor(llm.embed(prompt, use_tqdm=False)[0].outputs.embedding)
    cut = llm.embed(prompt, PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 8
    assert torch.allclose(torch.tensor(cut), torch.nn.functional.normalize(full[:8], dim=0),
                          atol=1e-6)  # fmt: skip
    raw = llm.embed(prompt, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert torch.allclose(torch.tensor(raw), ref.model(torch.tensor([prompt]))[0][0].mean(0),
                          atol=1e-4)  # fmt: skip
    kept = llm.embed(prompt, truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert kept.prompt_token_ids == prompt[-10:]
    assert _cosines([kept], [hf_pool(ref, prompt[-10:], "mean")])[0] >= 0.9999


def test_bad_requests_name_the_limit(qwen3) -> None:
    path, _ = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", pooling="last", threads=1,
              max_model_len=64)  # fmt: skip
    with pytest.raises(ValueError, match="context is 64 tokens"):
        llm.embed([7] * 65, use_tqdm=False)
    assert len(llm.embed([7] * 64, use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="embeddings have 64"):
        llm.embed([7, 8], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([7, 8], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([7, 96], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=0 must be >= 1"):
        PoolingParams(dimensions=0)
    assert not llm.engine.has_unfinished()
    generator = LLM(str(path), dtype="float32", quantization="none", threads=1)
    with pytest.raises(ValueError, match="--pooling"):
        generator.embed([7, 8], use_tqdm=False)


def test_reranker_scores_match_transformers_yes_no(qwen3) -> None:
    path, ref = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", classifier_from_token="no,yes",
              threads=1)  # fmt: skip
    query = "w10 w11 w12"
    documents = ["w10 w11", "w40 w41 w42 w43", "w12", "w90 w10 w70"]
    outputs = llm.score(query, documents, use_tqdm=False)
    expected = [
        hf_yes_score(ref, llm.tokenizer.encode(qwen3_reranker_prompt(query, d))) for d in documents
    ]
    scores = [o.outputs.score for o in outputs]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert sorted(range(4), key=lambda i: -scores[i]) == sorted(
        range(4), key=lambda i: -expected[i]
    )
    assert len(set(round(s, 4) for s in scores)) == 4  # the order is not a tie
    with pytest.raises(ValueError, match="reranker"):
        llm.embed("w10", use_tqdm=False)


def test_embedding_model_scores_by_cosine(qwen3) -> None:
    path, ref = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", pooling="mean", threads=1)
    tok = llm.tokenizer
    outputs = llm.score(["w10 w11", "w20"], ["w12 w13", "w21 w22"], use_tqdm=False)
    for out, (a, b) in zip(outputs, [("w10 w11", "w12 w13"), ("w20", "w21 w22")], strict=True):
        va, vb = (hf_pool(ref, tok.encode(t), "mean") for t in (a, b))
        assert out.outputs.score == pytest.approx(torch.dot(va, vb).item(), abs=1e-5)
    with pytest.raises(ValueError, match="same length"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


def test_cli_embed_prints_norm_and_first_values(qwen3, capsys) -> None:
    path, ref = qwen3
    flags = ["--model", str(path), "--pooling", "mean", "--dtype", "float32"]
    flags += ["--quantization", "none", "--threads", "1", "--show", "3"]
    prompts = _prompts(6, 9)
    assert main(["embed", *flags, *(text(p) for p in prompts)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for i, (line, p) in enumerate(zip(lines, prompts, strict=True)):
        first = ", ".join(f"{x:.4f}" for x in hf_pool(ref, p, "mean")[:3].tolist())
        assert line == f"[{i}] {len(p)} tokens, 64 dims, norm 1.0000: [{first}, ...]"


def test_non_causal_prompts_run_whole_and_finish_with_their_vector() -> None:
    """An encoder's prompt is never chunked: one that does not fit what is left of a step's
    budget waits for the next step; it finishes with its pooled vector, its blocks freed."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16, whole_prompts=True)
    params = PoolingParams()
    for rid, n in [("a", 10), ("b", 10), ("c", 6)]:
        sched.add(Request(rid, list(range(7, 7 + n)), SamplingParams(), 1, [], 0, pooling=params))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 10}  # b waits (6 left); c waits behind b
    result = ModelRunnerOutput(pooled={"a": torch.ones(2)})
    (update,) = sched.update_from_output(first, result)
    assert update.request_id == "a" and torch.equal(update.pooled, torch.ones(2))
    assert kv.pool.num_used == 0 and "a" not in sched.requests
    assert sched.schedule().num_scheduled_tokens == {"b": 10, "c": 6}


def test_encoder_input_over_the_step_budget_names_it() -> None:
    spec = PoolingSpec("cls", 96, 64, None, max_model_len=512, whole_prompt_tokens=128)
    with pytest.raises(ValueError, match="at most 128 tokens \\(max_num_batched_tokens\\)"):
        spec.check([7] * 129, PoolingParams())
    spec.check([7] * 128, PoolingParams())


def test_bench_embed_agrees_with_sentence_transformers(qwen3, capsys) -> None:
    """`tinyllm bench embed` on the same checkpoint: sentence-transformers (Transformer,
    Pooling, Normalize) embeds the same texts to the same vectors."""
    path, _ = qwen3
    flags = ["--model", str(path), "--pooling", "mean", "--dtype", "float32"]
    flags += ["--quantization", "none", "--threads", "1", "--num-texts", "6"]
    assert main(["bench", "embed", *flags]) == 0
    out = capsys.readouterr().out
    assert "tinyllm: " in out and "sentence-transformers: " in out and "ratio: " in out
    cosine = float(out.split("cosine to sentence-transformers: min ")[1].split(",")[0])
    assert cosine >= 0.9999


def _kv_bytes(llm: LLM) -> int:
    return sum(t.numel() * t.element_size() for pair in llm.engine.runner.kv_caches for t in pair)


def test_an_encoder_holds_no_kv_memory_and_a_decoder_does(qwen3, tmp_path) -> None:
    """An encoder's prompts run whole and keep no K/V: its runner allocates none, and its pool
    is bookkeeping as large as max_num_seqs prompts of its context need; a decoder embedding
    model keeps K/V between its prompt's chunks."""
    write_encoder(tmp_path / "bert", "bert")
    encoder = LLM(str(tmp_path / "bert"), dtype="float32", quantization="none", threads=1)
    assert _kv_bytes(encoder) == 0
    engine = encoder.engine
    assert engine.kv.num_blocks * engine.kv.block_size >= engine.config.max_num_seqs * 512
    texts = ["w4 w5 w6", "w10 w11"]
    want = SentenceTransformer(str(tmp_path / "bert"), device="cpu").encode(texts)
    got = torch.tensor([o.outputs.embedding for o in encoder.embed(texts, use_tqdm=False)])
    assert torch.cosine_similarity(got, torch.tensor(want), dim=1).min().item() >= 0.9999
    decoder = LLM(str(qwen3[0]), dtype="float32", quantization="none", pooling="mean",
                  threads=1)  # fmt: skip
    per_block = kv_bytes_per_token(decoder.engine.model) * decoder.engine.kv.block_size
    assert per_block > 0 and _kv_bytes(decoder) >= decoder.engine.kv.num_blocks * per_block


@pytest.mark.parametrize("how", ["mean", "last", "cls"])
def test_a_prompt_preempted_mid_prefill_pools_as_alone(qwen3, how: str) -> None:
    """A pooling prompt preempted after some of its chunks ran is recomputed from its start in
    other chunks, and pools what it pools alone: its shares before the preemption are dropped,
    none counted twice. Pooling prompts alone never run out of blocks (admission keeps room
    for the next chunk, and a prompt ends in the step it reaches its end), so each prompt is
    refused blocks once when 12 of its tokens are computed, as a pool shared with other work
    would: the second prompt ran 0-4 and 4-12 and is recomputed in chunks 0-8, 8-16, 16-22."""
    path, ref = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", pooling=how, threads=1)
    prompts = _prompts(20, 22, 18)
    alone = [run_all(engine_on(llm), [p], PoolingParams())[0].pooled for p in prompts]
    engine = engine_on(llm, num_blocks=8, block_size=4, max_num_batched_tokens=8)
    allocate, refused = engine.kv.allocate, set()

    def refuse_once(request, n: int) -> bool:
        if request.num_computed_tokens >= 12 and request.request_id not in refused:
            refused.add(request.request_id)
            return False
        return allocate(request, n)

    engine.kv.allocate = refuse_once
    outputs = run_all(engine, prompts, PoolingParams())
    stats = engine.stats()
    assert stats.num_preemptions == len(refused) >= 2 and stats.recomputed_tokens > 0
    for out, want, p in zip(outputs, alone, prompts, strict=True):
        assert torch.allclose(out.pooled, want, atol=1e-5)
        cosine = torch.cosine_similarity(out.pooled, hf_pool(ref, p, how), dim=0).item()
        assert cosine >= 0.9999


def test_a_default_prompt_the_prompts_lack_is_refused_at_load(tmp_path) -> None:
    write_qwen3_embedding(tmp_path, {"query": "w30 "}, default_prompt_name="passage")
    with pytest.raises(ModelLoadError, match="default_prompt_name 'passage' is not one of"):
        LLM(str(tmp_path), dtype="float32", quantization="none", threads=1)
