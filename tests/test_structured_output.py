"""Structured output on the default model: every output under a JSON schema, a regex, a choice or
a grammar matches it, greedy and sampled, among free rows, chunked and preempted; bad ones are
refused before they run; the free rows' tokens do not change."""

import datetime
import json
import re
import uuid
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.engine_runs import engine_on, run_all
from tinyllm.engine.engine import LLMEngine
from tinyllm.engine.outputs import RequestOutput
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.grammar import (
    GrammarMasks,
    StructuredOutputCompiler,
    apply_bitmask,
    forced_rows,
)
from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.engine.worker.sampler import Sampler

pytestmark = pytest.mark.slow

_SHORT = {"type": "string", "maxLength": 16}
_SCORE = {"type": "integer", "minimum": 0, "maximum": 100}


def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _object(optional: tuple[str, ...] = (), **properties: dict) -> dict:
    """An object of these properties and no others, all required but the `optional` ones."""
    required = [name for name in properties if name not in optional]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _array(items: dict, low: int, high: int) -> dict:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


# (what the prompt asks for, the schema): every string, array and fraction bounded (a number's
# multipleOf limits its decimals), so that every output, sampled ones too, ends within max_tokens.
SCHEMAS = [
    ("a person", _object(name=_SHORT, age=_int(0, 120))),
    (
        "a person and their address",
        _object(
            name=_SHORT,
            address=_object(city=_SHORT, zip={"type": "string", "pattern": "^[0-9]{5}$"}),
        ),
    ),
    ("two to four fruits", _array(_SHORT, 2, 4)),
    ("one to three lucky numbers", _array(_int(1, 99), 1, 3)),
    ("a color", _object(color={"enum": ["red", "green", "blue"]})),
    ("a rating from 1 to 10", _int(1, 10)),
    (
        "a probability",
        _object(p={"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.25}),
    ),
    ("a product code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
    ("a date", {"type": "string", "format": "date"}),
    ("an email address", {"type": "string", "format": "email", "maxLength": 40}),
    ("a timestamp", {"type": "string", "format": "date-time"}),
    ("an id", {"type": "string", "format": "uuid"}),
    ("an IP address", {"type": "string", "format": "ipv4"}),
    ("a book, the year optional", _object(("year",), title=_SHORT, year=_int(1000, 2100))),
    ("a name or a number", {"anyOf": [_SHORT, _int(0, 999)]}),
    (
        "a cat or a dog",
        {"anyOf": [_object(meow={"type": "boolean"}), _object(bark=_SCORE)]},
    ),
    ("whether it rains", _object(rain={"type": "boolean"})),
    ("a nickname, or null", _object(nick={"type": ["string", "null"], "maxLength": 12})),
    ("one or two players", _array(_object(name=_SHORT, score=_SCORE), 1, 2)),
    ("a 2x2 matrix", _array(_array(_int(-9, 9), 2, 2), 2, 2)),
    ("the version", _object(version={"const": "1.0"}, ok={"type": "boolean"})),
    ("a short word", {"type": "string", "minLength": 3, "maxLength": 8}),
    (
        "a point",
        {
            "$defs": {"coord": _int(-100, 100)},
            **_object(x={"$ref": "#/$defs/coord"}, y={"$ref": "#/$defs/coord"}),
        },
    ),
    (
        "a tuple of a name and an age",
        {"type": "array", "prefixItems": [_SHORT, _SCORE], "items": False, "minItems": 2},
    ),
    ("a small odd number", {"enum": [1, 3, 5, 7, 9]}),
    ("a multiple of five", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}),
    (
        "a company with a team",
        _object(company=_object(name=_SHORT, team=_object(lead=_SHORT, size=_int(1, 50)))),
    ),
    ("a yes, a no or nothing", {"enum": ["yes", "no", None]}),
]

# jsonschema checks these formats only with optional packages; the test checks them itself.
_FORMATS = {
    "date": datetime.date.fromisoformat,
    "date-time": datetime.datetime.fromisoformat,
    "uuid": uuid.UUID,
}
FREE = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def _engine(llm, **kw) -> LLMEngine:
    return engine_on(llm, **{"num_blocks": 512, "max_model_len": 1024} | kw)


def _chat(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])[1]


def _json(schema: dict | str, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


def _assert_valid(out: RequestOutput, schema: dict, label: str) -> None:
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", f"{label}: {completion.text!r} did not finish"
    value = json.loads(completion.text)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.validate(value, schema, format_checker=checker)
    if "format" in schema:
        _FORMATS.get(schema["format"], str)(value)


def test_every_schema_validates_greedy_and_sampled_beside_free_rows(default_config_llm):
    """28 schemas, each greedy and sampled, in one batch with two free rows: every output
    finishes because its grammar ended, parses and validates; the free rows' tokens and
    logprobs are those they get alone."""
    llm = default_config_llm
    prompts, params = [], []
    for i, (what, schema) in enumerate(SCHEMAS):
        prompt = _chat(llm, f"Answer in JSON: {what}.")
        prompts += [prompt, prompt]
        params += [_json(schema, temperature=0), _json(schema, temperature=0.8, seed=i)]
    free = [_chat(llm, "Tell me a story."), _chat(llm, "What is 2 + 2?")]
    outs = run_all(_engine(llm), prompts + free, params + [FREE, FREE])
    for i, (what, schema) in enumerate(SCHEMAS):
        _assert_valid(outs[2 * i], schema, f"{what}, greedy")
        _assert_valid(outs[2 * i + 1], schema, f"{what}, sampled")
    alone = run_all(_engine(llm), free, [FREE, FREE])
    for a, o in zip(alone, outs[-2:], strict=True):
        assert o.token_ids == a.token_ids
        assert o.outputs[0].logprobs == a.outputs[0].logprobs


def test_chunked_and_preempted_requests_keep_their_grammar(default_config_llm):
    """A pool of 10 blocks and a budget of 16 tokens: prompts are chunked, requests preempted
    mid-output and recomputed. Each matcher keeps the tokens it accepted, so every output is
    the one the request makes in a roomy engine, and valid."""
    llm = default_config_llm
    cases = [SCHEMAS[i] for i in (1, 18, 26)]
    prompts = [_chat(llm, f"Answer in JSON: {what}.") for what, _ in cases]
    params = [_json(schema, temperature=0) for _, schema in cases]
    roomy = run_all(_engine(llm), prompts, params)
    tight = _engine(llm, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=16)
    outs = run_all(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    for (what, schema), r, o in zip(cases, roomy, outs, strict=True):
        _assert_valid(o, schema, what)
        assert o.token_ids == r.token_ids


def test_regex_choice_json_object_and_a_fixed_grammar(default_config_llm):
    """n = 3 sampled completions each match the regex (each has its own matcher); a choice gives
    one of its strings; json_object some JSON object, a schema given as text one it validates;
    a grammar that accepts one string gives exactly it."""
    llm = default_config_llm
    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    regex = StructuredOutputsParams(regex=date)
    choice = StructuredOutputsParams(choice=["positive", "negative", "neutral"])
    fixed = StructuredOutputsParams(grammar='start: "The answer is 42."')
    any_object = StructuredOutputsParams(json_object=True)
    prompts = [
        _chat(llm, "When did the Berlin wall fall? Give the date."),
        _chat(llm, "Is 'I love this film' positive, negative or neutral?"),
        _chat(llm, "What is the answer?"),
        _chat(llm, "Describe a cat in JSON."),
        _chat(llm, "How old is the universe, in billions of years?"),
    ]
    age = _object(billions=_int(1, 20))
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=3, structured_outputs=regex),
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=choice),
        SamplingParams(max_tokens=30, temperature=0.7, structured_outputs=fixed),
        SamplingParams(max_tokens=100, temperature=0, structured_outputs=any_object),
        _json(json.dumps(age), temperature=0),
    ]
    outs = run_all(_engine(llm), prompts, params)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        assert re.fullmatch(date, c.text) and c.finish_reason == "stop", c.text
    assert outs[1].outputs[0].text in choice.choice
    assert outs[1].outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].text == "The answer is 42."
    assert outs[2].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(outs[3].outputs[0].text), dict)
    assert outs[3].outputs[0].finish_reason == "stop"
    _assert_valid(outs[4], age, "a schema as text")


def test_a_schema_that_does_not_close_its_objects_gets_no_invented_keys(default_config_llm):
    """Without `additionalProperties`, JSON Schema allows any other key; left that room, the
    default model once wrote "population_density_by_city" records until max_tokens. Objects
    are closed unless the schema opens them (vLLM's default), so the answer is the declared
    keys and ends with stop."""
    llm = default_config_llm
    city = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    prompt = _chat(llm, "Give the largest city of Japan as JSON.")
    out = run_all(_engine(llm), [prompt], [_json(city, temperature=0)])[0].outputs[0]
    assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"city", "population"}


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            {"json": {"type": "object", "properties": {"a": {"type": "foo"}}}},
            r"^structured_outputs\.json: .*Invalid type: foo",
        ),
        ({"json": '{"type": "object"'}, r"^structured_outputs\.json: "),
        ({"json": {"not": {"type": "string"}}}, r"^structured_outputs\.json: .*not"),
        ({"json": {"type": "string", "format": "color"}}, r"Unknown format: color"),
        ({"regex": "(["}, r"^structured_outputs\.regex: .*unclosed"),
        ({"regex": "(?=lookahead)"}, r"^structured_outputs\.regex: .*look-around"),
        ({"grammar": "start: %unknown"}, r"^structured_outputs\.grammar: .*lexer error"),
        ({"grammar": "start: undefined_rule"}, r"^structured_outputs\.grammar: .*unknown name"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_it_runs(
    default_config_llm, constraint, message
):
    """ValueError naming the field and the problem, from add_request and the request validator,
    with nothing queued; the engine then serves the next request, n > 1 included."""
    engine = default_config_llm.engine
    bad = SamplingParams(n=2, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=message):
        engine.request_validator().validate([1, 2, 3], bad)
    with pytest.raises(ValueError, match=message):
        engine.add_request(None, bad, prompt_token_ids=[1, 2, 3])
    assert not engine.has_unfinished() and not engine.requests and not engine.parents
    good = SamplingParams(
        max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(choice=["ok"])
    )
    out = default_config_llm.generate([[1, 2, 3]], good, use_tqdm=False)[0]
    assert out.outputs[0].text == "ok" and out.outputs[0].finish_reason == "stop"


def test_abort_and_finish_free_the_matcher(default_config_llm):
    engine = _engine(default_config_llm)
    params = _json({"type": "object"})
    engine.add_request(None, params, request_id="a", prompt_token_ids=[1, 2, 3])
    request = engine.requests["a"]
    assert request.matcher is not None
    engine.abort("a")
    assert request.matcher is None and request.finish_reason == "abort"


def _masked(tokenizer, vocab_size: int, constraint: StructuredOutputsParams, logits: torch.Tensor):
    compiler = StructuredOutputCompiler(tokenizer, vocab_size)
    masks = GrammarMasks()
    return masks, apply_bitmask(logits, [1], masks.fill([compiler.matcher(constraint)], vocab_size))


def test_a_mask_forbids_padding_ids_and_leaves_allowed_logits_alone(default_config_llm):
    """Logits wider than the tokenizer's vocabulary (a model's padded LM head): the ids past it
    are -inf even under a regex that allows any text; the allowed logits are unchanged, bit
    for bit, and the unconstrained row is untouched."""
    tok = default_config_llm.tokenizer
    V = tok.vocab_size + 40
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    _, out = _masked(tok, V, StructuredOutputsParams(regex="(.|\n)*"), logits)
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1, tok.vocab_size :]).all()
    allowed = ~torch.isinf(out[1])
    assert allowed.sum() > tok.vocab_size // 2
    assert torch.equal(out[1][allowed], logits[1][allowed])
    # A choice of one string allows its first tokens only: "hello" and its prefixes.
    masks, out = _masked(tok, V, StructuredOutputsParams(choice=["hello"]), logits)
    texts = {tok.decode([t]) for t in (~torch.isinf(out[1])).nonzero()[:, 0].tolist()}
    assert texts and all("hello".startswith(t) for t in texts)
    assert masks.stats.rows == 1 and masks.stats.forced == (len(texts) == 1)


def test_the_last_grammars_compiled_are_kept_and_each_request_gets_a_copy(
    default_config_llm, compiles, monkeypatch
):
    tok = default_config_llm.tokenizer
    compiler = StructuredOutputCompiler(tok, tok.vocab_size)
    monkeypatch.setattr(compiler, "CACHED", 2)
    a, b, c = (StructuredOutputsParams(choice=[word]) for word in ("alpha", "beta", "gamma"))
    alpha = tok.encode("alpha", add_special_tokens=False)
    first = compiler.matcher(a)
    assert first.consume_tokens(alpha) and first.is_stopped()
    again = compiler.matcher(a)  # at the start, not where the first request's matcher got to
    assert not again.is_stopped() and again.consume_tokens(alpha) and again.is_stopped()
    compiler.matcher(b)
    compiler.matcher(a)
    assert compiles.count == 2
    compiler.matcher(c)  # over the limit: b, the least recently used, goes
    compiler.matcher(a)
    compiler.matcher(c)
    assert compiles.count == 3
    compiler.matcher(b)
    assert compiles.count == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.integers(0, 32 * 3 - 1), max_size=4), min_size=1, max_size=8))
@example([set(), {31}, {31, 5}, {0, 32}, {95}])
def test_forced_rows_are_the_rows_that_allow_one_token(allowed):
    bitmask = torch.zeros(len(allowed), 3, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:  # bit 31 is the int32's sign
            bitmask[row, t // 32] |= torch.tensor(1 << t % 32).to(torch.int32)
    assert forced_rows(bitmask) == sum(len(tokens) == 1 for tokens in allowed)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1.5, "top_k": 50, "repetition_penalty": 1.3, "seed": 2}],
)
def test_the_mask_comes_first_and_logprobs_are_the_models(default_config_llm, sampling):
    """A +100 logit_bias on the raw argmax, a token the grammar forbids, cannot bring it back,
    greedy or sampled: the mask comes before penalties, bias, temperature and top-k. The
    logprobs are those of the raw logits, as for any row, and the token chosen is one the
    matcher takes."""
    tok = default_config_llm.tokenizer
    compiler = StructuredOutputCompiler(tok, tok.vocab_size)
    matcher = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    logits = torch.randn(1, tok.vocab_size, generator=torch.Generator().manual_seed(1))
    favourite = int(logits[0].argmax())
    assert not any(w.startswith(tok.decode([favourite])) for w in ("yes", "no"))
    params = SamplingParams(logprobs=3, logit_bias={favourite: 100}, **sampling)
    req = SimpleNamespace(
        params=params,
        generator=torch.Generator().manual_seed(params.seed or 0),
        prompt_token_ids=[favourite],
        output_token_ids=[],
    )
    bitmask = GrammarMasks().fill([matcher], tok.vocab_size)
    ((token,),), ((lp,),) = Sampler().verify(logits, [req], [[]], [0], bitmask)
    text = tok.decode([token])
    word = next(w for w in ("yes", "no") if w.startswith(text))
    raw = logits[0].log_softmax(-1)
    assert lp.logprob == raw[token].item()
    assert [t for t, _ in lp.top] == raw.topk(3).indices.tolist()
    # The matcher takes the token, and the rest of the word completes the grammar.
    rest = tok.encode(word[len(text) :], add_special_tokens=False)
    assert matcher.consume_tokens([token, *rest]) and matcher.is_stopped()


def test_generate_flags_constrain_the_answer(default_config_llm, monkeypatch, capsys, tmp_path):
    """`tinyllm generate --json-schema FILE | --regex R | --choice a,b,c`: the streamed answer
    matches; a regex that does not compile is one line naming it, exit status 1."""
    from tinyllm.entrypoints import cli

    monkeypatch.setattr(cli, "build_llm", lambda args: default_config_llm)
    schema = SCHEMAS[0][1]
    path = tmp_path / "person.json"
    path.write_text(json.dumps(schema))
    flags = {
        "json": ["--json-schema", str(path)],
        "regex": ["--regex", "[0-9]{4}"],
        "choice": ["--choice", "Paris,London,Rome"],
    }
    answers = {}
    for name, args in flags.items():
        question = ["generate", "Where is the Eiffel tower?", "--max-tokens", "60"]
        assert cli.main(question + args) == 0
        answers[name], err = capsys.readouterr()
        assert "finish: stop" in err.strip().splitlines()[-1]
    jsonschema.validate(json.loads(answers["json"]), schema)
    assert re.fullmatch("[0-9]{4}", answers["regex"])
    assert answers["choice"] in ("Paris", "London", "Rome")
    assert cli.main(["generate", "Hi", "--regex", "(["]) == 1
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("tinyllm: error: structured_outputs.regex: ")
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--json-schema", "missing.json"], "argument --json-schema: cannot read missing.json"),
        (["--choice", "a,,b"], "argument --choice: 'a,,b': a choice is empty"),
        (["--regex", "a", "--choice", "a"], "argument --choice: not allowed with argument --regex"),
    ],
)
def test_bad_constraint_flags_are_usage_errors_before_loading(monkeypatch, capsys, flags, named):
    from tinyllm.entrypoints import cli

    monkeypatch.setattr(cli, "build_llm", lambda args: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "Hi", *flags])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(f"tinyllm generate: error: {named}")
    )


def test_a_schema_file_that_is_not_a_schema_is_a_usage_error(monkeypatch, capsys, tmp_path):
    from tinyllm.entrypoints import cli

    monkeypatch.setattr(cli, "build_llm", lambda args: pytest.fail("the model loaded"))
    for text, named in [("{", "is not JSON"), ("[1]", "holds list, not a JSON schema")]:
        path = tmp_path / "schema.json"
        path.write_text(text)
        with pytest.raises(SystemExit):
            cli.main(["generate", "Hi", "--json-schema", str(path)])
        assert named in capsys.readouterr().err
