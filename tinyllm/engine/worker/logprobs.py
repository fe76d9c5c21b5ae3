"""Logprobs of given tokens under the model's own distribution, with each row's top-n: the
sampled tokens' (SamplingParams.logprobs) and the prompt's (prompt_logprobs)."""

from torch import Tensor

from tinyllm.engine.outputs import TokenLogprob


def token_logprobs(logits: Tensor, tokens: Tensor, top_n: list[int]) -> list[TokenLogprob]:
    """Row r: the logprob of tokens[r] under logits[r] (R, V), and its top_n[r] alternatives."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    # One top-k for all rows (the largest n asked), each row then keeps its own n.
    top = lp.topk(min(max(top_n), lp.shape[1]))
    rows_top = zip(top.indices.tolist(), top.values.tolist(), strict=True)
    return [
        TokenLogprob(tok, tok_lp, list(zip(ids[:n], lps[:n], strict=True)))
        for tok, tok_lp, n, (ids, lps) in zip(
            tokens.tolist(), chosen.tolist(), top_n, rows_top, strict=True
        )
    ]
