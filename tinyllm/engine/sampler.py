"""Turn a batch of logits into one token per request, each with its own SamplingParams.

Per-row settings become tensors on the logits' device, so the same code runs on CPU and CUDA.
The only CPU tensors are each request's random draws, moved to the device before use."""

from collections.abc import Sequence
from typing import Protocol

import torch
from llguidance import LLMatcher
from torch import Tensor

from tinyllm.engine.grammar import GrammarMasks
from tinyllm.engine.logprobs import token_logprobs
from tinyllm.engine.outputs import TokenLogprob
from tinyllm.engine.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class SamplerRequest(Protocol):
    """What the sampler reads from a request (the engine's Request has these attributes).
    Read-only properties, so that a class computing one (output_token_ids) also fits."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator: ...  # CPU, seeded per request
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...  # generated so far
    @property
    def matcher(self) -> LLMatcher | None: ...  # structured output: where it is in the grammar


class Sampler:
    def __init__(self) -> None:
        self.grammar = GrammarMasks()

    def __call__(
        self, logits: Tensor, requests: Sequence[SamplerRequest]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits (R, V) float32, one row per request -> chosen tokens and their logprobs.

        A constrained row (structured output) can only choose what its grammar allows: its mask
        comes first, before penalties, temperature and the filters, and its matcher then
        advances with the token. Logprobs are those of the model's own distribution (before
        masks, penalties and temperature), as vLLM and OpenAI report them."""
        constrained = [r for r, req in enumerate(requests) if req.matcher is not None]
        matchers = [requests[r].matcher for r in constrained]
        allowed = self.grammar.apply(logits, constrained, matchers) if constrained else logits
        penalized = apply_penalties(allowed, requests)
        tokens = penalized.argmax(-1)
        sampled = [r for r, req in enumerate(requests) if not req.params.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            tokens[rows] = _draw(penalized[rows], [requests[r] for r in sampled])
        chosen = tokens.tolist()
        if constrained:
            self.grammar.advance(matchers, [chosen[r] for r in constrained])
        return chosen, _logprobs(logits, tokens, requests)


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


def _draw(logits: Tensor, requests: Sequence[SamplerRequest]) -> Tensor:
    """One draw per row after temperature, min-p, top-k and top-p (vLLM's order)."""
    params = [req.params for req in requests]
    dev, V = logits.device, logits.shape[1]
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
    probs = x.softmax(-1)
    # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) is a draw from p, and each
    # row's noise comes from its own generator, so the batch never changes a draw.
    noise = torch.stack([torch.empty(V).exponential_(generator=req.generator) for req in requests])
    return (probs / noise.to(dev)).argmax(-1)


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
    logits: Tensor, tokens: Tensor, requests: Sequence[SamplerRequest]
) -> list[TokenLogprob | None]:
    """The chosen token's logprob and the top-n, for the rows that asked, under the raw logits."""
    out: list[TokenLogprob | None] = [None] * len(requests)
    wanted = [r for r, req in enumerate(requests) if req.params.logprobs is not None]
    if not wanted:
        return out
    rows = torch.tensor(wanted, device=logits.device)
    top_n = [requests[r].params.logprobs for r in wanted]
    for r, lp in zip(wanted, token_logprobs(logits[rows], tokens[rows], top_n), strict=True):
        out[r] = lp
    return out
