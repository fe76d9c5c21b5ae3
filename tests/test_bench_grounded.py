"""The `grounded` workload: chat requests over the standard library's text, run to EOS."""

import argparse
import inspect
import json
import random
import re
import textwrap

import gguf
import pytest

from tests.test_bench import _tiny_llm
from tests.test_cli import _tinyllm
from tinyllm.entrypoints.bench.args import add_bench_args
from tinyllm.entrypoints.bench.offline import run_bench, run_tinyllm
from tinyllm.entrypoints.grounded import (
    DOCSTRINGS,
    FUNCTIONS,
    KINDS,
    _extract,
    _quote,
    _rename,
    _sentences,
    grounded_conversations,
    resolve,
)
from tinyllm.entrypoints.workloads import WORKLOADS, Request, make_requests
from tinyllm.loaders.source import default_model_path
from tinyllm.text.tokenizer import Tokenizer

GROUNDED = WORKLOADS["grounded"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(default_model_path()))


def _stdlib_text(content: str) -> str:
    """The function source or docstring a task's message quotes, whichever it is."""
    for name in FUNCTIONS:
        source = textwrap.dedent(inspect.getsource(resolve(name))).rstrip()
        if source in content:
            return source
    for name in DOCSTRINGS:
        doc = inspect.getdoc(resolve(name))
        if doc in content:
            return doc
    raise AssertionError(f"no standard library text in {content[:200]!r}")


def test_requests_are_chat_prompts_over_stdlib_text_and_reproducible(tokenizer):
    a = make_requests("grounded", 49152, seed=3, tokenizer=tokenizer)
    assert a == make_requests("grounded", 49152, seed=3, tokenizer=tokenizer)
    assert a != make_requests("grounded", 49152, seed=4, tokenizer=tokenizer)
    assert len(a) == GROUNDED.num_requests
    # More requests: the first ones are the default run's.
    assert make_requests("grounded", 49152, 3, 12, tokenizer)[:8] == a
    conversations = grounded_conversations(3, len(a))
    for r, conversation in zip(a, conversations, strict=True):
        assert (r.max_tokens, r.ignore_eos) == (GROUNDED.max_tokens, False)
        assert r.prompt_token_ids == tokenizer.encode_chat(conversation)[1]
        text = tokenizer.decode(r.prompt_token_ids)
        assert _stdlib_text(conversation[0]["content"]) in text
        assert text.rstrip().endswith("assistant")  # the template's generation prompt
    kinds = [c[0]["content"].split(maxsplit=1)[0] for c in conversations]
    assert kinds == ["Rewrite", "Rewrite", "Here", "Copy"] * 2  # rename, strip, quote, extract


def test_grounded_needs_the_tokenizer():
    with pytest.raises(ValueError, match="grounded workload's prompts are text"):
        make_requests("grounded", 49152)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_every_function_makes_every_edit_task(name):
    source = textwrap.dedent(inspect.getsource(resolve(name)))
    for seed in range(3):
        task = _rename(random.Random(seed), name, source)
        old, new = re.findall(r"`(\w+)`", task)[:2]
        assert old in inspect.signature(resolve(name)).parameters
        assert re.search(rf"\b{old}\b", source) and not re.search(rf"\b{new}\b", source)
        word = re.findall(r"`([^`]+)`", _extract(random.Random(seed), name, source))[0]
        assert f" {word} " in source


@pytest.mark.parametrize("name", DOCSTRINGS)
def test_a_quote_asks_for_a_word_that_one_sentence_has(name):
    for seed in range(3):
        task = _quote(random.Random(seed), name)
        word = re.search(r"mentions `(\w+)`\.$", task)[1]
        sentences = _sentences(inspect.getdoc(resolve(name)))
        assert sum(bool(re.search(rf"\b{word}\b", s)) for s in sentences) == 1


def test_kinds_take_turns():
    contents = [c[0]["content"] for c in grounded_conversations(0, 2 * len(KINDS))]
    assert [c.startswith("Here is the documentation") for c in contents] == [
        False,
        False,
        True,
        False,
    ] * 2


@pytest.mark.parametrize("max_concurrency", [1, 2, None])
def test_run_keeps_at_most_max_concurrency_in_flight_and_stops_at_eos(tiny, max_concurrency):
    llm = _tiny_llm(tiny)
    engine = llm.engine
    in_flight = []
    add = engine.add_request

    def counting_add(*args, **kwargs):
        in_flight.append(len(engine.requests) + 1)
        return add(*args, **kwargs)

    engine.add_request = counting_add
    asked = [Request([5 + i, 6, 7, 8], 30, ignore_eos=False) for i in range(5)]
    run, made = run_tinyllm(llm, asked, max_concurrency=max_concurrency)
    assert in_flight[0] == 1  # the warm-up
    assert max(in_flight[1:]) == (max_concurrency or len(asked))
    assert run.requests == 5 and run.output_tokens == sum(m.max_tokens for m in made)
    assert all(m.ignore_eos and 1 <= m.max_tokens <= 30 for m in made)
    # The random model ends some requests at its EOS (t1) before the cap; the made counts
    # replayed with EOS ignored make exactly as many tokens.
    assert any(m.max_tokens < 30 for m in made)
    again, same = run_tinyllm(_tiny_llm(tiny), made, max_concurrency=max_concurrency)
    assert same == made and again.output_tokens == run.output_tokens


def test_a_sampled_run_samples_every_request_and_makes_its_tokens(tiny):
    llm = _tiny_llm(tiny)
    add, temperatures = llm.engine.add_request, []

    def noting_add(prompt, params, *args, **kwargs):
        temperatures.append(params.temperature)
        return add(prompt, params, *args, **kwargs)

    llm.engine.add_request = noting_add
    asked = [Request([5 + i, 6, 7, 8], 12) for i in range(3)]
    run, made = run_tinyllm(llm, asked, temperature=0.7)
    assert temperatures == [0.0, 0.7, 0.7, 0.7]  # the warm-up, then each request
    assert made == asked and run.output_tokens == 36


@pytest.mark.slow
def test_bench_grounded_runs_one_request_at_a_time_against_transformers(tmp_path):
    out = tmp_path / "grounded.json"
    # Seed 6's first two answers end at EOS after a few dozen tokens each: a short run.
    args = ["--seed", "6", "--num-requests", "2", "--threads", "1", "--json", str(out)]
    r = _tinyllm("bench", "grounded", *args)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert (res["workload"], res["requests"], res["max_concurrency"]) == ("grounded", 2, 1)
    t, b = res["tinyllm"], res["baseline"]
    # Both end at EOS (together in fewer tokens than one cap); transformers makes as many.
    assert 2 <= res["output_tokens"] < GROUNDED.max_tokens
    assert b["engine"] == "transformers"
    assert b["output_tokens_per_s"] * b["seconds"] == pytest.approx(res["output_tokens"])
    assert t["output_tokens_per_s"] * t["seconds"] == pytest.approx(res["output_tokens"])
    assert "single stream: tinyllm" in r.stdout
    assert "(at most 1 at once)" in r.stdout.splitlines()[1]


@pytest.mark.slow
def test_bench_grounded_with_speculation_against_itself_without(tmp_path):
    """--speculative-config: the baseline is the same engine with it off, the same tokens."""
    out = tmp_path / "spec.json"
    spec = '{"num_speculative_tokens": 4}'
    args = ["--seed", "6", "--num-requests", "2", "--threads", "1", "--json", str(out)]
    r = _tinyllm("bench", "grounded", *args, "--speculative-config", spec)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    t, b = res["tinyllm"], res["baseline"]
    assert b["engine"] == "no-speculation" and b["spec_decode"] is None
    assert b["output_tokens_per_s"] * b["seconds"] == pytest.approx(res["output_tokens"])
    drafts = t["spec_decode"]
    assert 0 < drafts["num_accepted_tokens"] <= drafts["num_draft_tokens"]
    assert "tinyllm: speculative decoding:" in r.stdout
    assert res["engine_args"]["speculative_config"] == spec


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["grounded", "--max-concurrency", "0"], "--max-concurrency=0 must be >= 1"),
        (["multi-turn", "--max-concurrency", "2"], "--max-concurrency runs single-turn workloads"),
    ],
)
def test_bad_concurrency_is_refused_before_loading(argv, message):
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    with pytest.raises(ValueError, match=message):
        run_bench(parser.parse_args(argv))
