"""N-gram prompt lookup: draft tokens for speculative decoding, found in the request's own context.

When the last few tokens of a request (prompt and output so far) occurred earlier in it, the
tokens that followed that earlier occurrence are a good guess for what comes next: editing,
quoting and extracting copy long runs of the prompt. The proposer finds the longest suffix
n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that occurred earlier and proposes up to k
of the tokens that followed it; the target model then verifies them in one pass.

Each request keeps an `NgramIndex` of its tokens: where each of its n-grams occurred, added as
its tokens arrive, so a step costs the new tokens' n-grams and a few dict lookups whatever the
context's length, instead of a search through all of it (benchmarks/ngram_proposer.py).
"""

from collections.abc import Sequence
from typing import NamedTuple


class Match(NamedTuple):
    """An earlier occurrence of a sequence's last `length` tokens, ending at position `end`."""

    end: int
    length: int

    def drafts(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The (at most k) tokens that followed the occurrence."""
        return list(token_ids[self.end + 1 : self.end + 1 + max(k, 0)])


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one token sequence occurred: its last or first
    occurrence's end position, over the n-grams that have a token after them. `extend` indexes
    the tokens appended since the last call; the sequence must only grow."""

    def __init__(self, min_n: int, max_n: int, earliest: bool) -> None:
        self.min_n, self.max_n, self.earliest = min_n, max_n, earliest
        # An n-gram (a tuple of n ids; tuples of different lengths never compare equal) -> the
        # position of its last token.
        self.ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in `ends`

    def extend(self, tokens: Sequence[int]) -> None:
        # An n-gram is indexed once a token follows it: the suffix itself never matches. A
        # plain loop: a step adds one token, and zipping slices pays only over many tokens,
        # which only a prompt's first call indexes.
        stop = len(tokens) - 1
        ends, lo, hi, earliest = self.ends, self.min_n, self.max_n, self.earliest
        for end in range(self.num_indexed, stop):
            for n in range(lo, min(hi, end + 1) + 1):
                gram = tuple(tokens[end + 1 - n : end + 1])
                if earliest:
                    ends.setdefault(gram, end)
                else:
                    ends[gram] = end
        self.num_indexed = max(self.num_indexed, stop)

    def longest_match(self, tokens: Sequence[int]) -> Match | None:
        """The longest suffix n-gram of tokens (the sequence indexed so far) that occurred
        earlier: where that occurrence ends and n; None when not even min_n tokens occurred
        earlier."""
        found = None
        # Shortest first: a suffix that never occurred has no longer one that did, so text with
        # nothing to find costs one lookup.
        for n in range(self.min_n, min(self.max_n, len(tokens) - 1) + 1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is None:
                break
            found = Match(end, n)
        return found


class NgramProposer:
    # Which of several earlier occurrences of the longest n-gram to follow: -1 the most recent,
    # 0 the earliest (vLLM's). The most recent: a copy in progress continues from where it last
    # was, so more drafts are accepted where the output repeats itself, and as many elsewhere
    # (benchmarks/ngram_acceptance.py on `grounded`).
    occurrence = -1

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} must be >= 1")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max={prompt_lookup_max} must be >= "
                f"prompt_lookup_min={prompt_lookup_min}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def new_index(self) -> NgramIndex:
        """An empty index of one sequence, for `propose` of this proposer."""
        return NgramIndex(self.min_n, self.max_n, earliest=self.occurrence == 0)

    def match(self, token_ids: Sequence[int], index: NgramIndex | None = None) -> Match | None:
        """The longest suffix n-gram of token_ids (prompt_lookup_min <= n <= prompt_lookup_max)
        that occurred earlier in token_ids: where that occurrence ends and n; None when there
        is none. `index` (from `new_index`) is token_ids' index so far, kept between calls while
        token_ids grows, so that a call indexes only the new tokens; without it every call
        indexes the whole sequence."""
        if index is None:
            index = self.new_index()
        index.extend(token_ids)
        return index.longest_match(token_ids)

    def propose(
        self,
        token_ids: Sequence[int],
        max_tokens: int | None = None,
        index: NgramIndex | None = None,
    ) -> list[int]:
        """Up to k (= min(num_speculative_tokens, max_tokens)) draft tokens: the tokens that
        followed the earlier occurrence of token_ids' longest suffix n-gram (`match`); [] when
        there is none."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        found = self.match(token_ids, index)
        return [] if found is None else found.drafts(token_ids, k)
