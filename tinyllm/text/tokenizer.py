"""Text <-> token ids, special ids and the chat template, for a GGUF file or a Hugging Face dir."""

import functools
import json
from pathlib import Path
from typing import Any

import gguf
import tokenizers

from tinyllm.model.config import ModelLoadError
from tinyllm.text.chat_template import (
    fold_system_message,
    render_chat_template,
    takes_system_message,
)
from tinyllm.text.gguf_tokenizer import field, tokenizer_from_gguf
from tinyllm.text.tool_formats import GENERIC, ToolFormat
from tinyllm.text.tool_prompt import template_inputs

# Control tokens that end a turn in common chat formats. llama.cpp stops on these whatever the
# file's eos id says, because instruct models often end with a different one than the base model.
_END_OF_GENERATION = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the model says about special tokens and chat."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        post_process: bool = False,
    ) -> None:
        """`bos_token`/`eos_token` are the texts chat templates get; by default those of the ids.
        `post_process`: encode adds the special tokens the tokenizer's post-processor adds
        (BERT's [CLS] ... [SEP], Qwen3-Embedding's closing <|endoftext|>), as
        sentence-transformers tokenizes for a pooling model, instead of BOS alone."""
        self.backend = backend
        self.post_process = post_process
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))  # dedupe, keep the primary first
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        primary_eos = self.eos_token_ids[0] if self.eos_token_ids else None
        self._template_tokens = {
            "bos_token": bos_token or self._text_of(bos_token_id),
            "eos_token": eos_token or self._text_of(primary_eos),
        }

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> "Tokenizer":
        backend = tokenizer_from_gguf(reader)
        eos = [field(reader, "tokenizer.ggml.eos_token_id")]
        eos += [field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
        eos += [backend.token_to_id(token) for token in _END_OF_GENERATION]
        # llama.cpp's defaults when the flag is missing, which older files rely on.
        model, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")
        wants_bos = model == "llama" or pre in ("llama-bpe", "llama3")
        add_bos = field(reader, "tokenizer.ggml.add_bos_token", wants_bos)
        return cls(
            backend,
            bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in eos if i is not None],
            pad_token_id=field(reader, "tokenizer.ggml.padding_token_id"),
            add_bos=add_bos,
            chat_template=field(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, post_process: bool = False) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"no tokenizer.json in {path}")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tok_config = _read_json(path / "tokenizer_config.json")
        configs = [_read_json(path / "generation_config.json"), _read_json(path / "config.json")]

        def token_text(name: str) -> str | None:
            token = tok_config.get(name)
            if isinstance(token, dict):  # older files store an AddedToken as a dict
                token = token.get("content")
            return token if isinstance(token, str) else None

        def token_id(name: str) -> int | None:
            text = token_text(name)
            return None if text is None else backend.token_to_id(text)

        def config_ids(key: str) -> list[int]:
            values = [config.get(key) for config in configs]
            return [i for v in values for i in (v if isinstance(v, list) else [v]) if i is not None]

        bos = token_id("bos_token")
        if bos is None:
            bos = next(iter(config_ids("bos_token_id")), None)
        pad = token_id("pad_token")
        if pad is None:
            pad = next(iter(config_ids("pad_token_id")), None)
        eos = [token_id("eos_token"), *config_ids("eos_token_id")]
        add_bos = tok_config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(backend, bos)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[i for i in eos if i is not None],
            pad_token_id=pad,
            add_bos=add_bos,
            chat_template=_hf_chat_template(path, tok_config),
            bos_token=token_text("bos_token"),
            eos_token=token_text("eos_token"),
            post_process=post_process,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) become their ids.

        BOS is prepended only when the model wants it, and not twice when a chat template already
        wrote it at the start of the text; with `post_process`, the post-processor's tokens.
        """
        _check_text("prompt", text)
        if add_special_tokens and self.post_process:
            return self.backend.encode(text).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @functools.cached_property
    def added_tokens(self) -> frozenset[str]:
        """The texts of the vocabulary's added tokens (`<think>`, `<tool_call>`...), which a
        grammar must name as tokens: llguidance never matches them as text."""
        return frozenset(t.content for t in self.backend.get_added_tokens_decoder().values())

    @property
    def is_chat_model(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (it is not a chat model); send a plain prompt"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**self._template_tokens, **extra},
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_format: ToolFormat = GENERIC,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The chat template's text for `messages` and its token ids: the one place a
        conversation becomes a prompt (the Python API, the CLI and the server all call it).
        `tools` (OpenAI's tool objects) go to a template that reads them, else into the system
        message in tinyllm's generic format (tinyllm.text.tool_prompt), calls written in
        `tool_format`. A template without a system role (Gemma 2's) gets the system message's
        text at the head of the first user message. `template_kwargs`: more
        variables for the template (Qwen3's `enable_thinking`); ValueError naming one that
        would replace what the template is given (messages, tools, the special tokens)."""
        if not messages:
            raise ValueError("the conversation is empty: give at least one message")
        extra: dict[str, Any] = {}
        if self.chat_template is not None:
            messages, extra = template_inputs(messages, tools, self.chat_template, tool_format)
            if not takes_system_message(self.chat_template):
                messages = fold_system_message(messages)
        kwargs = template_kwargs or {}
        self.check_template_kwargs(kwargs)
        text = self.apply_chat_template(messages, add_generation_prompt, **extra, **kwargs)
        _check_text("messages", text)
        # The template writes any BOS itself, so the tokenizer must not add another.
        return text, self.encode(text, add_special_tokens=False)

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """ValueError naming a template variable of `kwargs` that the conversation itself sets
        (messages, tools, add_generation_prompt, the special tokens)."""
        taken = sorted(
            set(kwargs) & {"messages", "tools", "add_generation_prompt", *self._template_tokens}
        )
        if taken:
            raise ValueError(
                f"chat_template_kwargs: {taken[0]!r} is set from the request itself, not a "
                "variable to give"
            )

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""


def _check_text(what: str, text: str) -> None:
    """A str can hold what no text can: a lone surrogate ("\\ud800", which JSON and Python
    escapes can carry). The tokenizer would fail on it with a TypeError that names nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        lone = e.object[e.start : e.end]
        raise ValueError(f"{what}: not valid Unicode text (lone surrogate {lone!r})") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _post_processor_adds(backend: tokenizers.Tokenizer, bos: int | None) -> bool:
    """Whether tokenizer.json's own post-processor puts BOS in front (Llama 3 does it this way)."""
    with_specials = backend.encode("a", add_special_tokens=True).ids
    return bos is not None and with_specials[:1] == [bos]


def _hf_chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    # Newer transformers save it in its own file, older ones inside tokenizer_config.json.
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
