"""Turn a batch of logits into one token per sequence, each with its own SamplingParams."""

import torch
from torch import Tensor

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.sequence import Sequence


def _apply_penalties(logits: Tensor, seqs: list[Sequence]) -> None:
    """vLLM's semantics: repetition over prompt and output, presence/frequency over output."""
    V = logits.shape[1]
    for r, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.all_token_ids)), dtype=torch.long)
            x = logits[r, seen]
            logits[r, seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=V)[:V]
            logits[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[r].index_add_(
                0,
                ids,
                torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device),
            )


def _filter(logits: Tensor, seqs: list[Sequence]) -> Tensor:
    """Temperature, then top-k, top-p and min-p: everything cut is set to -inf."""
    dev = logits.device
    temp = torch.tensor([s.params.temperature for s in seqs], device=dev)[:, None]
    logits = logits / temp
    top_k = [s.params.top_k for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    min_p = [s.params.min_p for s in seqs]
    if any(top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        V = logits.shape[1]
        rank = torch.arange(V, device=dev)
        k = torch.tensor([min(k, V) or V for k in top_k], device=dev)[:, None]
        cut = rank >= k
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cut |= (probs.cumsum(-1) - probs) >= torch.tensor(top_p, device=dev)[:, None]
        sorted_logits[cut] = float("-inf")
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    if any(min_p):
        probs = logits.softmax(-1)
        floor = torch.tensor(min_p, device=dev)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _logprobs(raw_lp: Tensor, tokens: list[int], seqs: list[Sequence]) -> list:
    out: list[TokenLogprob | None] = []
    for r, (tok, seq) in enumerate(zip(tokens, seqs, strict=True)):
        n = seq.params.logprobs
        if n is None:
            out.append(None)
            continue
        top = raw_lp[r].topk(n) if n else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if n else []
        out.append(TokenLogprob(tok, raw_lp[r, tok].item(), pairs))
    return out


def sample(logits: Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits (R, V) float32, one row per sequence -> chosen tokens and their logprobs.

    Logprobs are those of the model's own distribution (before penalties and temperature),
    as vLLM and OpenAI report them."""
    raw_lp = logits.log_softmax(-1) if any(s.params.logprobs is not None for s in seqs) else None
    logits = logits.clone()
    _apply_penalties(logits, seqs)
    tokens = logits.argmax(-1)
    sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        probs = _filter(logits[rows], [seqs[r] for r in sampled]).softmax(-1)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) is a draw from p, and
        # each row's noise comes from its own generator, so the batch never changes a draw.
        noise = torch.stack(
            [torch.empty(probs.shape[1]).exponential_(generator=seqs[r].generator) for r in sampled]
        ).to(probs.device)
        tokens[rows] = (probs / noise).argmax(-1)
    token_list = tokens.tolist()
    lps = _logprobs(raw_lp, token_list, seqs) if raw_lp is not None else [None] * len(seqs)
    return token_list, lps
