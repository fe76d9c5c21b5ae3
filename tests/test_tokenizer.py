"""The tokenizer layer against transformers' tokenizers, which are the reference."""

import json
import logging
import shutil
from pathlib import Path

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers, processors
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tinyllm.model.config import UnsupportedModelError
from tinyllm.text.chat_template import ChatTemplateError, render_chat_template
from tinyllm.text.detokenizer import IncrementalDetokenizer
from tinyllm.text.gguf_tokenizer import tokenizer_from_gguf
from tinyllm.text.tokenizer import Tokenizer

CORPUS = [
    "Hello, world!",
    "héllo wörld, ça va? Ñandú",
    "日本語のテキストと中文文本",
    "👋🏽 family: 👨‍👩‍👧‍👦 flag: 🇫🇷",
    "   leading, inner    and trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "digits 0 12 345 6789 3.14159 1,000,000",
    "def f(x):\n    return {'a': x ** 2}  # comment\n",
    "I'm sure you'll see they've gone",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text then <|endoftext|> special",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 🎨"},
    ],
]
# Emoji and CJK are 3-4 UTF-8 bytes each, which byte-level BPE often spreads over several tokens.
MULTIBYTE = "Hi 👋🏽! 👨‍👩‍👧‍👦 日本語 ok 🇫🇷 ẞ 🦜🦜"


@pytest.fixture(scope="module")
def reader(default_gguf_path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(default_gguf_path)


@pytest.fixture(scope="module")
def oracle(default_gguf_path: Path):
    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


@pytest.fixture(scope="module")
def smollm_reference(oracle) -> tokenizers.Tokenizer:
    """The oracle with SmolLM2's own pre-tokenizer: digits one by one, then GPT-2's split.

    transformers does not know the GGUF pre-tokenizer name "smollm", so it splits text like GPT-2
    and keeps "½" or "²" glued to a space. SmolLM2 and llama.cpp put every number character on its
    own, as tinyllm does.
    """
    reference = tokenizers.Tokenizer.from_str(oracle.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return reference


@pytest.fixture(scope="module")
def from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def hf_dir(oracle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_tokenizer")
    oracle.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def from_hf_dir(hf_dir: Path) -> Tokenizer:
    return Tokenizer.from_hf_dir(hf_dir)


@pytest.fixture(params=["gguf", "hf_dir"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(f"from_{request.param}")


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(tok: Tokenizer, oracle, text: str) -> None:
    ids = tok.encode(text)
    assert ids == oracle.encode(text)
    assert tok.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == oracle.decode(ids) == text


def test_special_tokens_stay_whole(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_start|>b<|im_end|>")
    assert ids[1] == tok.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tok.token_to_id("<|im_end|>") == 2
    assert tok.decode(ids) == "ab"
    assert tok.id_to_token(2) == "<|im_end|>"


def test_special_ids(tok: Tokenizer, oracle) -> None:
    assert tok.vocab_size == len(oracle) == 49152
    assert tok.bos_token_id == oracle.bos_token_id == 1
    assert 2 in tok.eos_token_ids and tok.eos_token_ids[0] == oracle.eos_token_id == 2
    assert tok.pad_token_id == oracle.pad_token_id
    assert not tok.add_bos and tok.encode("hi")[0] != tok.bos_token_id


def test_numbers_split_like_smollm(from_gguf: Tokenizer, smollm_reference) -> None:
    text = "½ cup, x² and ٣ 12"
    ids = from_gguf.encode(text)
    assert ids == smollm_reference.encode(text).ids
    assert from_gguf.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=48))
def test_random_text_matches_reference(
    from_gguf: Tokenizer, from_hf_dir: Tokenizer, smollm_reference, oracle, text: str
) -> None:
    ids = from_gguf.encode(text)
    assert ids == smollm_reference.encode(text).ids
    # SmolLM2's vocabulary has no token for a few bytes (0x04, 0xF1...): those are dropped.
    byte_symbols = bytes_to_unicode()
    if all(from_gguf.token_to_id(byte_symbols[b]) is not None for b in text.encode()):
        assert from_gguf.decode(ids, skip_special_tokens=False) == text
    # The saved directory carries transformers' own (GPT-2 split) tokenizer.json.
    assert from_hf_dir.encode(text) == oracle.encode(text)


def _write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **kv) -> None:
    """A GGUF holding only tokenizer metadata; `kv` names GGUFWriter.add_* calls."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for name, value in kv.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_bpe_gguf(path: Path, pre: str) -> gguf.GGUFReader:
    """The 256 byte symbols, a few merges, "OK" that no merge makes, a control token and a
    user-defined one."""
    merges = ["' S", "1 2", "12 3", "Ġ 1", "Ġ1 2", "4 5", "o k", "Ġ ok"]
    tokens = [*bytes_to_unicode().values(), *(m.replace(" ", "") for m in merges), "OK"]
    normal = [gguf.TokenType.NORMAL] * len(tokens)
    tokens, types = [*tokens, "<|ctl|>", "<think>"], [*normal, 3, 4]
    kv = {"tokenizer_pre": pre, "token_merges": merges, "eos_token_id": len(normal)}
    _write_gguf(path, "gpt2", tokens, types, **kv)
    return gguf.GGUFReader(path)


def test_pre_tokenizers_match_transformers(tmp_path: Path) -> None:
    text = "IT'S 12345  ok\n\nx<|ctl|> <think>y"
    seen = set()
    for pre in ["gpt2", "default", "llama-bpe", "qwen2"]:
        ours = tokenizer_from_gguf(_tiny_bpe_gguf(tmp_path / f"{pre}.gguf", pre))
        reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=f"{pre}.gguf")
        assert ours.encode(text).ids == reference.encode(text, add_special_tokens=False), pre
        seen.add(tuple(ours.encode(text).tokens))
    assert len(seen) == 3  # the regexes really differ on this text ("default" is GPT-2's)


def test_llama3_takes_whole_words_from_the_vocabulary(tmp_path: Path) -> None:
    # Llama 3's tokenizer.json (and llama.cpp) use a piece that is a token as is, merges or not.
    llama3 = tokenizer_from_gguf(_tiny_bpe_gguf(tmp_path / "llama3.gguf", "llama-bpe"))
    gpt2 = tokenizer_from_gguf(_tiny_bpe_gguf(tmp_path / "gpt2.gguf", "gpt2"))
    assert (llama3.encode("OK").tokens, gpt2.encode("OK").tokens) == (["OK"], ["O", "K"])


def test_tiny_gguf_added_tokens_and_smollm_digits(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_tiny_bpe_gguf(tmp_path / "smollm.gguf", "smollm"))
    assert tok.backend.encode("x 12345").tokens == ["x", "Ġ", "1", "2", "3", "4", "5"]
    ids = tok.encode("a<|ctl|>b<think>c")
    assert tok.id_to_token(ids[1]) == "<|ctl|>" and tok.id_to_token(ids[3]) == "<think>"
    # Control tokens are special and dropped; user-defined ones are text the model writes.
    assert tok.decode(ids) == "ab<think>c"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|ctl|>b<think>c"
    assert tok.eos_token_ids == [tok.token_to_id("<|ctl|>")]
    assert not tok.is_chat_model
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unknown_pre_tokenizer_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        tok = tokenizer_from_gguf(_tiny_bpe_gguf(tmp_path / "odd.gguf", "made-up"))
    assert "'made-up'" in caplog.text
    assert tok.encode("IT'S").tokens == ["I", "T", "'", "S"]  # GPT-2's split


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "bert.gguf", "bert", ["[CLS]", "a"], [3, 1])
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        tokenizer_from_gguf(gguf.GGUFReader(tmp_path / "bert.gguf"))


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece ("llama") GGUF: <unk> <s> </s>, 256 byte tokens, pieces best-first."""
    pieces = "▁ H e l o w r d t h i s He ll llo Hello ▁Hello ▁w or ld orld ▁world ▁t th ▁th is"
    pieces = [*pieces.split(), "▁this", "▁▁", "▁is", "日"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = tmp_path_factory.mktemp("spm")
    ids = {"bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0}
    _write_gguf(path / "spm.gguf", "llama", tokens, types, token_scores=scores, **ids)
    return path


@pytest.fixture(scope="module")
def spm(spm_dir: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(spm_dir / "spm.gguf"))


@pytest.fixture(scope="module")
def spm_reference(spm_dir: Path):
    return AutoTokenizer.from_pretrained(spm_dir, gguf_file="spm.gguf")


@pytest.mark.parametrize("text", ["Hello world", "Hello  this is\nthe world 日本 ok", "", "🦜"])
def test_sentencepiece_matches_transformers(spm: Tokenizer, spm_reference, text: str) -> None:
    ids = spm.encode(text)
    assert ids == spm_reference.encode(text)
    assert ids[0] == spm.bos_token_id == 1  # SentencePiece models want BOS unless told otherwise
    assert spm.decode(ids) == spm_reference.decode(ids, skip_special_tokens=True) == text


def test_sentencepiece_spaces_like_llama_cpp(spm: Tokenizer) -> None:
    """Every run of text gets one "▁" in front, also after a special token and before a space.

    That is SentencePiece's and llama.cpp's rule (and the legacy Llama 2 tokenizer.json's);
    transformers' GGUF conversion prepends only at the very start, and not before a space.
    """
    tokens = [spm.id_to_token(i) for i in spm.encode(" Hello<s>Hello", add_special_tokens=False)]
    assert tokens == ["▁", "▁Hello", "<s>", "▁Hello"]
    with_bytes = [spm.id_to_token(i) for i in spm.encode("日本", add_special_tokens=False)]
    assert with_bytes == ["▁", "日", "<0xE6>", "<0x9C>", "<0xAC>"]  # 本 has no token
    assert spm.decode(spm.encode(" Hello")) == " Hello"
    assert spm.encode("<s>Hello") == spm.encode("Hello")  # a template's BOS is not doubled


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, oracle, messages: list[dict], add_generation_prompt: bool
) -> None:
    assert tok.is_chat_model
    expected = oracle.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(messages, add_generation_prompt) == expected


# Exercises what the SmolLM template does not: whitespace control, tojson, loop controls, extras.
FANCY_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
[SYS] {{ message['content'] | trim }}
    {% else %}
{{ message['role'] | upper }}: {% generation %}{{ message | tojson }}{% endgeneration %}
    {%- if loop.last %} (last){% endif %}

    {% endif %}
    {% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}tools={{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


def test_template_features_match_transformers(oracle) -> None:
    messages = [{"role": "system", "content": "  sys  "}, *CONVERSATIONS[2]]
    tools = [{"name": "f", "description": "<b>&'x'</b>"}]
    expected = oracle.apply_chat_template(
        messages,
        chat_template=FANCY_TEMPLATE,
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
    )
    rendered = render_chat_template(
        FANCY_TEMPLATE,
        messages,
        True,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        tools=tools,
    )
    assert rendered == expected
    assert "<b>&'x'</b>" in rendered  # tojson must not HTML-escape


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{{ messages.__class__.__base__ }}", "unsafe"),
        ("{{ cycler.__init__.__globals__ }}", "unsafe"),
        ("{{ messages.append({'role': 'x'}) }}", "unsafe"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}", "chat template"),
    ],
)
def test_template_sandbox_and_errors(template: str, error: str) -> None:
    with pytest.raises(ChatTemplateError, match=error):
        render_chat_template(template, [{"role": "user", "content": "hi"}], True, "", "")


def test_hf_dir_chat_template_precedence(hf_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())

    def with_config_template(template: object) -> None:
        (tmp_path / "tokenizer_config.json").write_text(
            json.dumps(config | {"chat_template": template})
        )

    with_config_template("from config")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "from config"
    (tmp_path / "chat_template.jinja").write_text("from jinja file")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "from jinja file"
    (tmp_path / "chat_template.jinja").unlink()
    with_config_template(
        [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    )
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "plain"


def test_hf_dir_special_ids_from_configs(hf_dir: Path, tmp_path: Path) -> None:
    shutil.copy(hf_dir / "tokenizer_config.json", tmp_path)
    # A tokenizer.json whose post-processor puts BOS in front, as Llama 3's does.
    backend = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    (tmp_path / "config.json").write_text('{"eos_token_id": 5, "pad_token_id": 7}')
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_token_ids == [2, 0, 5]  # tokenizer's eos first, then every configured one
    assert tok.pad_token_id == 2  # the tokenizer's own pad token wins over config.json
    assert tok.add_bos and tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]
    assert tok.encode("<|im_start|>hi") == tok.encode("hi")


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize(
    ("name", "prompt"), [("from_gguf", "<|im_start|>assistant\n"), ("from_gguf", ""), ("spm", "")]
)
def test_detokenizer_never_shows_half_a_character(
    request: pytest.FixtureRequest, name: str, prompt: str
) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(MULTIBYTE)
    # The test is only worth something if some tokens really hold part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False))
    pieces = _stream(detok, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == detok.text == MULTIBYTE == tok.decode(ids)
    assert detok.flush() == ""


def test_detokenizer_keeps_special_tokens_when_asked(from_gguf: Tokenizer) -> None:
    ids = from_gguf.encode("<|im_start|>user\n日本<|im_end|>")
    detok = IncrementalDetokenizer(from_gguf, [], skip_special_tokens=False)
    assert "".join(_stream(detok, ids)) + detok.flush() == "<|im_start|>user\n日本<|im_end|>"
    detok = IncrementalDetokenizer(from_gguf, [])
    assert "".join(_stream(detok, ids)) + detok.flush() == "user\n日本"


def test_detokenizer_flushes_a_broken_last_character(from_gguf: Tokenizer) -> None:
    ids = from_gguf.encode("ok 🦜")
    cut = ids[:-1]  # the parrot's last byte(s) never arrive
    assert from_gguf.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(from_gguf, [])
    pieces = _stream(detok, cut)
    assert "".join(pieces) == "ok"
    assert "".join(pieces) + detok.flush() == from_gguf.decode(cut)
    assert detok.flush() == ""


def test_detokenizer_work_per_token_is_bounded(from_gguf: Tokenizer) -> None:
    """Long output and a run of invalid bytes both decode only a small window per token."""
    lone_continuation_byte = from_gguf.token_to_id(bytes_to_unicode()[0x80])
    ids = from_gguf.encode(MULTIBYTE * 40) + [lone_continuation_byte] * 30 + from_gguf.encode("!")
    windows: list[int] = []

    class Recording(Tokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            windows.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    recording = Recording(from_gguf.backend, bos_token_id=None, eos_token_ids=[])
    detok = IncrementalDetokenizer(recording, from_gguf.encode("prompt " * 100))
    text = "".join(_stream(detok, ids)) + detok.flush()
    assert text == from_gguf.decode(ids)
    assert max(windows) <= 16


@pytest.mark.parametrize("text", ["a\ud800", "\udfff b"])
def test_lone_surrogates_are_refused_naming_the_field(from_gguf: Tokenizer, text: str) -> None:
    """A str can carry a lone surrogate (JSON's "\\ud800" does); it is not text, and the error
    names what held it rather than the tokenizer's "TextInputSequence must be str"."""
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode text \(lone surrogate '\\ud"):
        from_gguf.encode(text)
    with pytest.raises(ValueError, match=r"^messages: not valid Unicode text"):
        from_gguf.encode_chat([{"role": "user", "content": text}])
