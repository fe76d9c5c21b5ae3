"""Property tests of the engine's bookkeeping: random workloads, random aborts, tiny pools.

A tiny random model keeps each example fast; what is checked is accounting, not text: no block
owned twice, none leaked, every request ends, and everything is given back."""

import pytest
import tokenizers
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tinyllm.engine.engine import EngineConfig, LLMEngine
from tinyllm.engine.paged_kv_cache import PagedKVCache
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.model.config import ModelConfig
from tinyllm.model.llama import Transformer
from tinyllm.text.tokenizer import Tokenizer

VOCAB = 64
MAX_LEN = 48


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig("llama", VOCAB, 16, 32, 1, 2, 1, 8, MAX_LEN)
    model = Transformer(cfg)
    model.load_weights(dict(model.state_dict()))
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return model.eval(), Tokenizer(backend, bos_token_id=None, eos_token_ids=[1])


def _check(engine: LLMEngine) -> None:
    cache, sched = engine.cache, engine.scheduler
    assert sorted(sched.running) == cache.active_slots()
    assert all(seq.slot == slot for slot, seq in sched.running.items())
    if isinstance(cache, PagedKVCache):
        owned = [b for s in cache.active_slots() for b in cache.tables[s]]
        assert len(owned) == len(set(owned)), "a block is owned by two live sequences"
        assert len(owned) == cache.alloc.num_used, "a block leaked"
        for s in cache.active_slots():  # every block a sequence can read is one it owns
            readable = cache._table_dev[s].tolist()[: len(cache.tables[s])]
            assert readable == cache.tables[s]
            assert len(cache.tables[s]) * cache.bs >= cache.lens[s]


request = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 20),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 30)),  # abort at this step (None: never)
    st.booleans(),  # ignore_eos
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=10),
    kv_cache=st.sampled_from(["paged", "slot"]),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 4),
    temperature=st.sampled_from([0.0, 1.0]),
)
def test_random_workload_accounts_for_everything(
    tiny, requests, kv_cache, num_blocks, block_size, max_num_seqs, temperature
):
    model, tok = tiny
    engine = LLMEngine(
        model,
        tok,
        EngineConfig(
            kv_cache=kv_cache,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            kv_cache_memory=MAX_LEN * 64 * max_num_seqs,
            seed=1,
        ),
    )
    finished: dict[str, object] = {}
    for step in range(400):
        for i, (n, max_tokens, arrive, _, ignore_eos) in enumerate(requests):
            if arrive == step:
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
                )
                engine.add_request(
                    None,
                    params,
                    request_id=str(i),
                    prompt_token_ids=[(i * 7 + j) % VOCAB for j in range(n)],
                )
        for i, (*_, abort_at, _) in enumerate(requests):
            if abort_at == step and str(i) not in finished:
                out = engine.abort(str(i))
                if out is not None:
                    finished[str(i)] = out
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out
        _check(engine)
        if step > 6 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the engine stopped making progress"
    assert sorted(finished, key=int) == [str(i) for i in range(len(requests))]
    assert engine.cache.used_tokens() == 0 and not engine.cache.active_slots()
    if kv_cache == "paged":
        assert engine.cache.alloc.num_used == 0
    for i, (n, max_tokens, *_, ignore_eos) in enumerate(requests):
        out = finished[str(i)]
        if out.finish_reason == "error":  # the prompt, or a lone sequence, outgrew the pool
            assert not engine.cache.fits_ever(n + len(out.token_ids)), out.error
        elif out.finish_reason == "length":
            assert len(out.token_ids) == max_tokens or n + len(out.token_ids) == MAX_LEN
        elif out.finish_reason == "stop":
            assert out.token_ids[-1] == 1 and not ignore_eos
        else:
            assert out.finish_reason == "abort"


@pytest.mark.parametrize(
    ("kv_cache", "what"), [("slot", "one slot of 48 tokens"), ("paged", "one block")]
)
def test_a_budget_too_small_for_one_sequence_is_refused(tiny, kv_cache, what):
    model, tok = tiny
    with pytest.raises(ValueError, match=f"kv_cache_memory=100 bytes cannot hold {what}"):
        LLMEngine(model, tok, EngineConfig(kv_cache=kv_cache, kv_cache_memory=100, block_size=4))
