"""Rebuild the `tokenizers.Tokenizer` a GGUF file describes in its `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json, only llama.cpp's pieces of one: the vocabulary, the merges (or
SentencePiece scores), a type per token and, for byte-level BPE, the *name* of the pre-tokenizer
(`tokenizer.ggml.pre`). The name stands for a split regex hard-coded in llama.cpp
(llama-vocab.cpp), so the regexes below are the ones it uses, which are also the ones in the
models' own tokenizer.json files.
"""

import logging
from collections import Counter
from typing import Any

import gguf
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
)

from tinyllm.model.config import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SINGLE_DIGITS = r"\p{N}"

# Each regex splits the pieces the previous one produced, as llama.cpp applies its list.
# "default" is what files written before `tokenizer.ggml.pre` existed say; llama.cpp of that time
# (and transformers today) split those with GPT-2's regex, so that is what they get here too.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "smollm": (_SINGLE_DIGITS, _GPT2),
    "starcoder": (_SINGLE_DIGITS, _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}
# Llama 3's tokenizer.json sets BPE "ignore_merges": a piece that is itself a token is not merged
# again from bytes (llama.cpp does the same for these names); it can give a different split.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as plain Python (str, int, list...), or `default` when absent."""
    value = reader.get_field(key)
    return default if value is None else value.contents()


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """The tokenizer a GGUF file describes: byte-level BPE ("gpt2") or SentencePiece ("llama")."""
    model = field(reader, "tokenizer.ggml.model")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ModelLoadError("GGUF file has no tokenizer (no tokenizer.ggml.model or .tokens)")
    normal = [gguf.TokenType.NORMAL] * len(tokens)
    types: list[int] = field(reader, "tokenizer.ggml.token_type", normal)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(reader, tokens)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(reader, tokens, types)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {model!r} is not supported; tinyllm reads "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
        )

    # Added tokens are matched whole in the text before any splitting, so they are never cut up.
    # Control tokens (<|im_start|>) are special: decode(skip_special_tokens=True) drops them.
    # User-defined ones (Qwen3's <think>) are plain text the model reads and writes, so they stay.
    special = [t for t, kind in zip(tokens, types, strict=True) if kind in _SPECIAL_TYPES]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == gguf.TokenType.USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        # Two ids for one string cannot both live in a tokenizers vocabulary.
        twice = [token for token, count in Counter(tokens).items() if count > 1]
        raise ModelLoadError(f"GGUF tokenizer vocabulary lists {twice[:5]} more than once")
    return tokenizer


_SPECIAL_TYPES = (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN)


def _byte_level_bpe(reader: gguf.GGUFReader, tokens: list[str]) -> Tokenizer:
    merges: list[str] = field(reader, "tokenizer.ggml.merges", [])
    pre = field(reader, "tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text like GPT-2", pre)
        splits = PRE_TOKENIZER_SPLITS["gpt2"]

    # Tokens are kept exactly as stored: normal ones are spelled in the byte-level alphabet, added
    # ones (like "<|im_end|>") as their raw text, which is what the added-token matcher looks up.
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(tokens)},
            merges=[tuple(merge.split(" ", 1)) for merge in merges],
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral 7B), as its "legacy" tokenizer.json spells it.

    SentencePiece has no merge list: it repeatedly joins the adjacent pair whose union is the
    best-scoring token. That is BPE whose merges are every way to cut a token in two, ranked by
    the token's score. Characters with no token fall back to their bytes (<0xE6> tokens).
    """
    scores: list[float] = field(reader, "tokenizer.ggml.scores") or [-i for i in range(len(tokens))]
    vocab = {token: index for index, token in enumerate(tokens)}
    cuts = [
        (score, token[:cut], token[cut:])
        for token, score, kind in zip(tokens, scores, types, strict=True)
        if kind == gguf.TokenType.NORMAL
        for cut in range(1, len(token))
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    cuts.sort(key=lambda cut: -cut[0])  # stable: equal scores keep vocabulary order
    unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, left, right in cuts],
            unk_token=None if unk_id is None else tokens[unk_id],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    # Spaces are "▁"; with add_space_prefix every run of text, the first one and each one after
    # a special token, starts with one, as in llama.cpp and SentencePiece itself.
    space_prefix = field(reader, "tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if space_prefix else replace
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(
        steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps
    )
    return tokenizer
