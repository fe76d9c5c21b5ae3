"""Comparing greedy runs the way vLLM's check_logprobs_close does.

Two correct implementations (or one, batched differently) round floats differently, so a
near-tie between the top two tokens may flip. Tokens must match exactly until the first
difference; there, each side's token must be in the other side's top-n with a close logprob,
and the comparison stops (after a flip the continuations legitimately diverge). Anything else
fails: this never loosens to "most tokens match".
"""

from tinyllm.engine.outputs import TokenLogprob

NEAR_TIE = 0.05  # nats between the two candidates' logprobs; a real bug is far larger


def assert_greedy_close(
    ref_ids: list[int],
    ref_lps: list[dict[int, float]],
    test_ids: list[int],
    test_lps: list[dict[int, float]],
    label: str = "",
    near_tie: float | None = NEAR_TIE,
) -> None:
    """near_tie=None is vLLM's rule for other weights (bf16, quantized): each side's token in
    the other's top-n, however far apart their logprobs."""
    n = min(len(ref_ids), len(test_ids))
    for i in range(n):
        a, b = ref_ids[i], test_ids[i]
        if a == b:
            continue
        ok = b in ref_lps[i] and a in test_lps[i]
        if near_tie is not None:
            ok = ok and abs(ref_lps[i][a] - ref_lps[i][b]) < near_tie
            ok = ok and abs(test_lps[i][a] - test_lps[i][b]) < near_tie
        assert ok, (
            f"{label} token {i}: reference chose {a}, test chose {b}, not close: "
            f"reference top {ref_lps[i]}, test top {test_lps[i]}"
        )
        return
    assert len(ref_ids) == len(test_ids), f"{label}: lengths {len(ref_ids)} != {len(test_ids)}"


def top_dicts(logprobs: list[TokenLogprob]) -> list[dict[int, float]]:
    return [dict(lp.top) | {lp.token_id: lp.logprob} for lp in logprobs]
