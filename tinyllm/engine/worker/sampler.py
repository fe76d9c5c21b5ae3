"""Turn a batch of logits into one token per request, each with its own SamplingParams.

Per-row settings become tensors on the logits' device, so the same code runs on CPU and CUDA.
The only CPU tensors are each request's random draws, moved to the device before use."""

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.engine.structured_output.grammar import apply_bitmask
from tinyllm.engine.worker.logprobs import token_logprobs

_NEG_INF = float("-inf")


class SamplerRequest(Protocol):
    """What the sampler reads from a request (the model runner's state of one has these).
    Read-only properties, so that a class computing one (output_token_ids) also fits."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator: ...  # CPU, seeded per request
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...  # generated so far


class Sampler:
    def verify(
        self,
        logits: Tensor,
        requests: Sequence[SamplerRequest],
        drafts: Sequence[list[int]],
        constrained: Sequence[int] = (),
        bitmask: Tensor | None = None,
    ) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
        """Each request's tokens for this step: the draft tokens the model accepts (speculative
        decoding), then one token of the model's own. logits (R, V) float32 hold, per request,
        its last token's row, then one row per draft token: the model's prediction after it.

        Greedy: drafts are accepted while they are the model's argmax, so the tokens are those
        decoding one at a time would give. Sampled: the speculative sampling rule for a draft
        that is a point mass: draft t is accepted with probability p(t) (p after temperature
        and the filters), else one token is drawn from p without t, and when all are accepted
        one more from the last row's p; each request's own generator draws, so a seed fixes
        the output. A request without drafts samples its one row.

        The `constrained` requests (structured output; by index) can only choose what their
        grammar allows: `bitmask` row i is request constrained[i]'s mask (GrammarMasks.fill),
        applied first, before penalties, temperature and the filters. Constrained and penalized
        requests have no drafts (spec_decode/speculator.py). Logprobs are those of the model's own
        distribution (before masks, penalties and temperature), as vLLM and OpenAI report
        them."""
        # Each request's first row: its rows are its last token's, then one per draft.
        first = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        owners = [req for req, d in zip(requests, drafts, strict=True) for _ in range(len(d) + 1)]
        rows = [first[r] for r in constrained]  # no drafts: one row each
        allowed = apply_bitmask(logits, rows, bitmask) if rows else logits
        penalized = apply_penalties(allowed, owners)
        targets = _argmax(penalized)
        plain = [r for r, req in enumerate(requests) if not req.params.greedy and not drafts[r]]
        if plain:
            rows = torch.tensor([first[r] for r in plain], device=logits.device)
            targets[rows] = _draw(penalized[rows], [requests[r] for r in plain])
        best = targets.tolist()
        chosen = []
        for r, (req, draft) in enumerate(zip(requests, drafts, strict=True)):
            at = first[r]
            if not draft:
                chosen.append([best[at]])
            elif req.params.greedy:
                n = 0
                while n < len(draft) and draft[n] == best[at + n]:
                    n += 1
                chosen.append([*draft[:n], best[at + n]])
            else:
                chosen.append(_accept_or_resample(penalized[at : at + len(draft) + 1], draft, req))
        return chosen, _logprobs(logits, first, chosen, requests)


def apply_penalties(logits: Tensor, requests: Sequence[SamplerRequest]) -> Tensor:
    """vLLM's penalties: repetition over prompt and output (positive logits divided, negative
    multiplied), presence and frequency over the output only; then logit_bias.

    Returns `logits` itself when no request asks for any of them, else a penalized copy."""
    params = [req.params for req in requests]
    rep = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    freq = [
        r
        for r, p in enumerate(params)
        if (p.presence_penalty or p.frequency_penalty) and requests[r].output_token_ids
    ]
    bias = [r for r, p in enumerate(params) if p.logit_bias]
    if not (rep or freq or bias):
        return logits
    dev, dtype, V = logits.device, logits.dtype, logits.shape[1]
    logits = logits.clone()
    if rep:
        rows = torch.tensor(rep, device=dev)
        all_ids = [requests[r].prompt_token_ids + requests[r].output_token_ids for r in rep]
        ids = _padded(all_ids, V, dev)
        seen = torch.zeros(len(rep), V + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)
        rp = torch.tensor([params[r].repetition_penalty for r in rep], dtype=dtype, device=dev)
        x = logits[rows]
        scaled = torch.where(x > 0, x / rp[:, None], x * rp[:, None])
        logits[rows] = torch.where(seen[:, :V], scaled, x)
    if freq:
        rows = torch.tensor(freq, device=dev)
        ids = _padded([requests[r].output_token_ids for r in freq], V, dev)
        counts = torch.zeros(len(freq), V + 1, dtype=dtype, device=dev)
        counts = counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=dtype, device=dev))[:, :V]
        f = torch.tensor([params[r].frequency_penalty for r in freq], dtype=dtype, device=dev)
        p = torch.tensor([params[r].presence_penalty for r in freq], dtype=dtype, device=dev)
        logits[rows] -= f[:, None] * counts + p[:, None] * (counts > 0)
    if bias:
        pairs = [(r, t, b) for r in bias for t, b in params[r].logit_bias.items()]
        r_idx, t_idx, values = zip(*pairs, strict=True)
        logits.index_put_(
            (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
            torch.tensor(values, dtype=dtype, device=dev),
            accumulate=True,
        )
    return logits


def _padded(token_lists: list[list[int]], V: int, device: torch.device) -> Tensor:
    """Token lists as one (n, longest) tensor, padded with V: a column past the vocabulary
    that the callers scatter into and then drop."""
    width = max(len(ids) for ids in token_lists)
    return torch.tensor(
        [ids + [V] * (width - len(ids)) for ids in token_lists], dtype=torch.long, device=device
    )


def _probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Each row's distribution after temperature, min-p, top-k and top-p (vLLM's order)."""
    dev = logits.device
    # Greedy rows never get here, so no temperature is below _SAMPLING_EPS.
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    x = logits / temp[:, None]
    if any(p.min_p for p in params):
        # p >= min_p * p_max  <=>  logit >= max logit + log(min_p); log(0) = -inf cuts nothing.
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)
        floor = x.max(-1, keepdim=True).values + min_p.log()[:, None]
        x = x.masked_fill(x < floor, _NEG_INF)
    if any(p.top_k for p in params) or any(p.top_p < 1 for p in params):
        x = _top_k_top_p(x, params)
    return x.softmax(-1)


def _race(probs: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """One draw per row of `probs` (unnormalized is fine): the exponential race (Gumbel-max),
    argmax(p / E) with E ~ Exp(1), each row's noise from its own generator, so the batch never
    changes a draw."""
    V = probs.shape[1]
    noise = torch.stack([torch.empty(V).exponential_(generator=g) for g in generators])
    return _argmax(probs / noise.to(probs.device))


def _argmax(x: Tensor) -> Tensor:
    """Each row's argmax. max's indices are argmax's (the first of equal values, NaN the
    largest), and torch computes them faster than argmax on the CPU."""
    return x.max(-1).indices


def _draw(logits: Tensor, requests: Sequence[SamplerRequest]) -> Tensor:
    """One draw per row after temperature, min-p, top-k and top-p."""
    probs = _probs(logits, [req.params for req in requests])
    return _race(probs, [req.generator for req in requests])


def _accept_or_resample(logits: Tensor, draft: list[int], req: SamplerRequest) -> list[int]:
    """Speculative sampling with drafts proposed with certainty (q(t) = 1): accept draft t at
    row i with probability min(1, p(t) / q(t)) = p(t); on a rejection draw from the residual
    max(0, p - q), which is p without t; after the last draft draw from the last row."""
    probs = _probs(logits, [req.params] * len(logits))
    p_draft = probs[torch.arange(len(draft)), torch.tensor(draft)].tolist()
    for i, (t, p) in enumerate(zip(draft, p_draft, strict=True)):
        if torch.rand((), generator=req.generator).item() >= p:
            residual = probs[i].clone()
            residual[t] = 0.0
            return [*draft[:i], int(_race(residual[None], [req.generator])[0])]
    return [*draft, int(_race(probs[-1:], [req.generator])[0])]


def _top_k_top_p(x: Tensor, params: list[SamplingParams]) -> Tensor:
    """Keep each row's top_k logits, then the smallest prefix of those whose renormalized mass
    reaches top_p (always at least one token); the rest become -inf."""
    dev, V = x.device, x.shape[1]
    # min() first: a top_k past the vocabulary cuts nothing and would overflow a tensor.
    k = torch.tensor([min(p.top_k, V) or V for p in params], device=dev)
    # top_p = 1 keeps everything, even where rounding lifts the cumulative sum past 1.
    top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in params], device=dev)
    sorted_x, order = x.sort(-1, descending=True)
    sorted_x = sorted_x.masked_fill(torch.arange(V, device=dev) >= k[:, None], _NEG_INF)
    probs = sorted_x.softmax(-1)
    sorted_x = sorted_x.masked_fill(probs.cumsum(-1) - probs >= top_p[:, None], _NEG_INF)
    # `order` is a permutation, so the scatter writes every element.
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _logprobs(
    logits: Tensor,
    first: list[int],
    chosen: list[list[int]],
    requests: Sequence[SamplerRequest],
) -> list[list[TokenLogprob | None]]:
    """Each chosen token's logprob and the top-n, for the requests that asked, under the raw
    logits of the row it was chosen at (request r's k-th token: row first[r] + k)."""
    out: list[list[TokenLogprob | None]] = [[None] * len(c) for c in chosen]
    wanted = [r for r, req in enumerate(requests) if req.params.logprobs is not None]
    if not wanted:
        return out
    rows = [first[r] + k for r in wanted for k in range(len(chosen[r]))]
    tokens = [t for r in wanted for t in chosen[r]]
    top_n = [requests[r].params.logprobs for r in wanted for _ in chosen[r]]
    dev = logits.device
    lps = iter(
        token_logprobs(
            logits[torch.tensor(rows, device=dev)], torch.tensor(tokens, device=dev), top_n
        )
    )
    for r in wanted:
        out[r] = [next(lps) for _ in chosen[r]]
    return out
