"""N-gram prompt lookup: draft tokens for speculative decoding, found in the request's own context.

When the last few tokens of a request (prompt and output so far) occurred earlier in it, the
tokens that followed that earlier occurrence are a good guess for what comes next: editing,
quoting and extracting copy long runs of the prompt. The proposer finds the longest suffix
n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that occurred earlier and proposes up to k
of the tokens that followed it; the target model then verifies them in one pass.

The search is a few numpy passes over the context: the positions of the last token, then,
one offset further back at a time, the candidates whose preceding tokens still match. The
first pass is the only one over the whole context; the others touch only the survivors.
"""

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    # Which of several earlier occurrences of the longest n-gram to follow: -1 the most recent,
    # 0 the earliest (vLLM's). Measured on `grounded` (benchmarks/ngram_acceptance.py, 16
    # requests): the same tokens per step on the answers that end at EOS (within 2% either
    # way, k 2-8), and more where the output repeats itself (k=4, n-grams of 1-3: 2.88 against
    # 2.57 over all 16): a copy in progress continues from where it last was.
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

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to k (= min(num_speculative_tokens, max_tokens)) draft tokens: the longest suffix
        n-gram of token_ids (prompt_lookup_min <= n <= prompt_lookup_max) that occurred earlier
        in token_ids; the tokens that followed that earlier occurrence. [] when there is no
        match. A numpy array is used as it is; a list is converted, which at a few thousand
        tokens costs more than the search itself (benchmarks/ngram_proposer.py)."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if isinstance(token_ids, np.ndarray):
            t = token_ids
        else:  # fromiter with a count: half the time of asarray on a list of ints
            t = np.fromiter(token_ids, np.int64, len(token_ids))
        n_tokens = len(t)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        # Candidates: the positions before the last that hold the last token, so that at least
        # one token follows them; each ends an earlier occurrence of the last `matched` tokens.
        ends = np.flatnonzero(t[:-1] == t[-1])
        matched = 1
        while ends.size and matched < self.max_n:
            # Keep the candidates whose token `matched` places back equals the suffix's.
            back = ends - matched
            still = ends[(back >= 0) & (t[np.maximum(back, 0)] == t[-1 - matched])]
            if not still.size:
                break
            ends, matched = still, matched + 1
        if not ends.size or matched < self.min_n:
            return []
        start = int(ends[self.occurrence]) + 1
        return t[start : start + k].tolist()
