"""Constrained decoding with llguidance: a request's StructuredOutputsParams compiled into a
matcher (where its output is in the grammar), and each step's token masks.

Each step the constrained requests' masks are computed and sent with the step (manager.py);
the sampler masks each constrained row's logits to the tokens allowed; the scheduler then
advances each matcher with the chosen token."""

import dataclasses
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer, grammar_from
from torch import Tensor

from tinyllm.engine.structured_output.params import StructuredOutputsParams
from tinyllm.loaders.dummy import IdsOnlyTokenizer
from tinyllm.text.json_schema import closed_objects

if TYPE_CHECKING:
    from tinyllm.text.tokenizer import Tokenizer


# A grammar is over text: without a tokenizer no token's text is known.
_NO_TOKENIZER = (
    "dummy weights (load_format='dummy', --load-format dummy) come without a tokenizer, so "
    "structured output and tools cannot run; load a real model for them"
)
# Compact JSON (no optional whitespace): with whitespace allowed between tokens, a small model
# can pad with newlines until max_tokens. A schema's own "x-guidance" settings override this.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _grammar(params: StructuredOutputsParams) -> tuple[str, str]:
    """The field that is set and its llguidance grammar (compiled later, by the matcher)."""
    if params.json is not None:
        try:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            schema = closed_objects(schema)
            return "json", LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except (TypeError, ValueError) as e:  # not JSON text, or a dict that is not JSON
            raise ValueError(f"structured_outputs.json: not a JSON schema: {e}") from None
    if params.json_object:
        schema = {"type": "object"}
        return "json_object", LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if params.regex is not None:
        return "regex", LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return "choice", grammar_from("choice", params.choice)
    return "grammar", LLMatcher.grammar_from_lark(params.grammar)


def _one_line(error: str) -> str:
    """llguidance's message without the lines that draw where the error is (the offending text
    again, a row of carets, the grammar's source line): those are in its generated grammar
    for a schema or regex, and an error is one line here, as everywhere in tinyllm."""
    drawn = re.compile(r"\s|\^+$|\d+ \| ")
    return " ".join(line for line in error.strip().splitlines() if line and not drawn.match(line))


class StructuredOutputCompiler:
    """Turns a request's StructuredOutputsParams into an llguidance matcher (one per request:
    it holds where that request's output is in the grammar). The llguidance tokenizer (every
    token's bytes, for the masks) is built once, on the first constrained request; `vocab_size`
    is the logits' width, so ids past the tokenizer's vocabulary (padding) are never allowed.

    The last `CACHED` grammars that compiled are kept, by their text, as matchers at their
    start, and a request gets a copy: a copy takes microseconds where compiling took 0.4-1.5
    ms (SmolLM2's vocabulary, a schema, a regex, a tool grammar). The server compiles each
    request's grammar when it checks the request (on a handler thread) and again when the
    engine thread adds it, once per prompt of a request, and clients send the same schema or
    tools request after request. A cache rather than handing the checked matcher on to
    add_request: the engine's API stays as it is, and every caller of it gains."""

    CACHED = 64

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._ll_tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()  # least recently used first
        # The server checks requests on its handler threads while the engine thread adds them.
        self._lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher at the grammar's start; ValueError naming the field and the problem
        if it does not compile (an invalid schema or regex, a feature llguidance lacks)."""
        name, grammar = _grammar(params)
        if isinstance(self._tokenizer, IdsOnlyTokenizer):
            raise ValueError(f"structured_outputs.{name}: {_NO_TOKENIZER}")
        with self._lock:
            if (compiled := self._compiled.get(grammar)) is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            error = _one_line(matcher.get_error())
            if name != "grammar":  # a place in the grammar made from it: no help to the user
                error = re.sub(r"^at \d+\(\d+\): ", "", error)
            raise ValueError(f"structured_outputs.{name}: {error}")
        with self._lock:  # a copy: what is cached never advances
            self._compiled[grammar] = matcher.deep_copy()
            if len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        return matcher

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                eos = self._tokenizer.eos_token_ids or None
                self._ll_tokenizer = LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size, eos_token=eos
                )
            return self._ll_tokenizer


# A mask is a bitmap, token 8k + b at bit b of byte k. Unpacked a byte at a time, through a
# table indexed by the byte: what to add to its 8 tokens' logits (0 allowed, -inf not). A lookup
# and an add are vectorized where masked_fill with a bool mask is not on the CPU.
_BYTE_BIAS = torch.tensor(
    [[0.0 if byte >> bit & 1 else float("-inf") for bit in range(8)] for byte in range(256)]
)


def forced_rows(bitmask: Tensor) -> int:
    """How many rows of a (rows, words) int32 bitmask allow exactly one token: one word set,
    to a power of two. Looking at words, not bits: a row's words are a few thousand, its bits
    a vocabulary's worth (docs/MEASUREMENTS.md, "Structured output: what the masks cost")."""
    words = bitmask.numpy().view(np.uint32)
    one_word = np.count_nonzero(words, axis=1) == 1
    if not one_word.any():
        return 0
    word = words[one_word].max(axis=1)  # the one that is set
    return int(np.count_nonzero(word & (word - 1) == 0))


@dataclass
class GrammarStats:
    """What constrained decoding cost, counted since the engine was made."""

    steps: int = 0  # steps with a constrained row
    rows: int = 0  # constrained rows sampled
    forced: int = 0  # of those, rows whose mask allowed exactly one token
    seconds: float = 0.0  # masks computed, matchers advanced

    def __sub__(self, other: "GrammarStats") -> "GrammarStats":
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return GrammarStats(*(a - b for a, b in pairs))


class GrammarMasks:
    """The scheduler's side: before a step, every constrained row's mask in one parallel
    llguidance call (the bitmask the step's message carries: engine/step_message.py); after
    it, each matcher advanced with its row's token. Counts what it costs and how often a mask
    left one token only (a forced token: a brace, a key, a quote)."""

    def __init__(self) -> None:
        self._executor: LLExecutor | None = None
        self.stats = GrammarStats()

    def fill(self, matchers: list[LLMatcher], vocab_size: int) -> Tensor:
        """(len(matchers), ceil(vocab_size / 32)) int32 on the CPU: token 32w + b is allowed
        where bit b of word w is set."""
        start = time.perf_counter()
        if self._executor is None:
            self._executor = LLExecutor()
        n, words = len(matchers), -(-vocab_size // 32)
        bitmask = torch.zeros(n, words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, n
        )
        stats = self.stats
        stats.forced += forced_rows(bitmask)
        stats.steps += 1
        stats.rows += n
        stats.seconds += time.perf_counter() - start
        return bitmask

    def advance(self, matchers: list[LLMatcher], tokens: list[int]) -> None:
        start = time.perf_counter()
        for matcher, token in zip(matchers, tokens, strict=True):
            if not matcher.consume_token(token):  # the mask allowed it: a bug, not bad input
                raise RuntimeError(f"grammar matcher refused token {token}: {matcher.get_error()}")
        self.stats.seconds += time.perf_counter() - start


def apply_bitmask(logits: Tensor, rows: list[int], bitmask: Tensor) -> Tensor:
    """The sampler's side: a copy of `logits` (R, V) whose `rows` are -inf wherever their mask
    (GrammarMasks.fill) forbids the token, padding ids past the tokenizer's vocabulary
    included."""
    V, dev = logits.shape[1], logits.device
    mask_bytes = bitmask.view(torch.uint8).view(-1).to(dev).long()
    bias = _BYTE_BIAS.to(dev, logits.dtype).index_select(0, mask_bytes).view(len(rows), -1)
    return logits.index_add(0, torch.tensor(rows, device=dev), bias[:, :V])
