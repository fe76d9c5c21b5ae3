"""The n-gram proposer against a brute-force reference, called once and as a growing request
calls it (its index kept between calls), and its edge cases."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyllm.engine.spec_decode.ngram_proposer import NgramProposer


def reference_match(
    tokens: list[int], lo: int, hi: int, occurrence: int = -1
) -> tuple[int, int] | None:
    """The definition, spelled out: for n from hi down to lo, the latest (occurrence -1) or
    earliest (0) start s < len - n with tokens[s:s+n] equal to the last n tokens; the position
    of its last token, and n."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = tokens[size - n :]
        starts = [s for s in range(size - n) if tokens[s : s + n] == suffix]
        if starts:
            return starts[occurrence] + n - 1, n
    return None


def reference(tokens: list[int], k: int, lo: int, hi: int, occurrence: int = -1) -> list[int]:
    """What follows the reference match, at most k tokens."""
    found = reference_match(tokens, lo, hi, occurrence)
    return [] if found is None else tokens[found[0] + 1 : found[0] + 1 + k]


class EarliestNgramProposer(NgramProposer):
    occurrence = 0  # benchmarks/ngram_acceptance.py's comparison


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),  # a tiny alphabet: many partial matches
    k=st.integers(1, 6),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
    cap=st.one_of(st.none(), st.integers(0, 8)),
    cls=st.sampled_from([NgramProposer, EarliestNgramProposer]),
)
def test_proposals_match_the_brute_force_reference(tokens, k, lo, extra, cap, cls):
    hi = lo + extra
    proposer = cls(k, lo, hi)
    expected = reference(tokens, k if cap is None else min(k, cap), lo, hi, cls.occurrence)
    assert proposer.propose(tokens, cap) == expected
    assert proposer.match(tokens) == reference_match(tokens, lo, hi, cls.occurrence)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=80),
    cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40),  # how many tokens each step adds
    caps=st.lists(st.one_of(st.none(), st.integers(0, 8)), min_size=1, max_size=40),
    k=st.integers(1, 6),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
    cls=st.sampled_from([NgramProposer, EarliestNgramProposer]),
)
def test_an_index_kept_between_calls_proposes_what_the_reference_does_at_every_step(
    tokens, cuts, caps, k, lo, extra, cls
):
    """A request's tokens arrive a few at a time (a prompt, then accepted drafts and sampled
    tokens); a step may skip the lookup (a crowded batch, preemption) and catch up at the next."""
    hi = lo + extra
    proposer = cls(k, lo, hi)
    index = proposer.new_index()
    context: list[int] = []  # grown in place, as Request.all_token_ids is
    step = 0
    while len(context) < len(tokens):
        context.extend(tokens[len(context) : len(context) + cuts[step % len(cuts)]])
        cap = caps[step % len(caps)]
        expected = reference(context, k if cap is None else min(k, cap), lo, hi, cls.occurrence)
        assert proposer.propose(context, cap, index) == expected, f"after {len(context)} tokens"
        step += 1


def test_no_earlier_occurrence_proposes_nothing():
    assert NgramProposer(4, 1, 3).propose([1, 2, 3, 4, 5]) == []
    assert NgramProposer(4, 1, 3).propose([]) == []
    assert NgramProposer(4, 1, 3).propose([7]) == []
    # [3, 4] occurred earlier, but the minimum is 3 tokens: [2, 3, 4] did not.
    assert NgramProposer(4, 3, 5).propose([9, 3, 4, 1, 2, 3, 4]) == []
    assert NgramProposer(4, 2, 5).propose([9, 3, 4, 1, 2, 3, 4]) == [1, 2, 3, 4]


def test_a_match_near_the_end_proposes_the_few_tokens_that_follow_it():
    # [5, 6] last occurred one token before the suffix: only [7, 5, 6] follow it.
    assert NgramProposer(4, 2, 2).propose([1, 5, 6, 7, 5, 6]) == [7, 5, 6]
    # A run of one token: the suffix [8, 8] matches one place back, overlapping itself.
    assert NgramProposer(5, 2, 2).propose([1, 8, 8, 8]) == [8]


def test_max_tokens_caps_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    proposer = NgramProposer(4, 1, 3)
    assert proposer.propose(tokens) == [3, 4, 5, 6]
    assert proposer.propose(tokens, max_tokens=2) == [3, 4]
    assert proposer.propose(tokens, max_tokens=9) == [3, 4, 5, 6]
    assert proposer.propose(tokens, max_tokens=0) == []


def test_the_longest_n_gram_in_range_wins_over_a_more_recent_shorter_one():
    #        [1, 2, 3] -> 10     [2, 3] -> 20   suffix [1, 2, 3]
    tokens = [1, 2, 3, 10, 11, 2, 3, 20, 21, 1, 2, 3]
    assert NgramProposer(2, 1, 3).propose(tokens) == [10, 11]
    # Capped at 2 tokens, [2, 3] occurs twice; the most recent is followed by 20.
    assert NgramProposer(2, 1, 2).propose(tokens) == [20, 21]


def test_the_most_recent_of_several_occurrences_is_used():
    tokens = [4, 5, 30, 4, 5, 40, 4, 5]
    assert NgramProposer(1, 2, 2).propose(tokens) == [40]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 3), "num_speculative_tokens=0 must be >= 1"),
        ((4, 0, 3), "prompt_lookup_min=0 must be >= 1"),
        ((4, 3, 2), "prompt_lookup_max=2 must be >= prompt_lookup_min=3"),
    ],
)
def test_bad_settings_are_refused_naming_the_field_and_the_limit(args, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)
