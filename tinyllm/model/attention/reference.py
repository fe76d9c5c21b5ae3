"""The reference backend: gather each row's blocks into a contiguous copy, then SDPA.

The simplest read path, kept because it is easy to trust: the other backends are
tested against it. The copy is its cost (docs/MEASUREMENTS.md, "Decode attention")."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata
from tinyllm.model.attention.int8_cache import dequantize


def gather_blocks(cache: Tensor, table: Tensor, dtype: torch.dtype) -> Tensor:
    """(R, B) block ids -> (R, B * block_size, H, D), the rows' tokens in order, in `dtype`
    (an int8 cache's rows dequantized). index_select, not cache[table]: 2-D advanced indexing is
    far slower on CPU."""
    R, B = table.shape
    _, bs, H, D = cache.shape
    rows = cache.index_select(0, table.reshape(-1)).view(R, B * bs, H, D)
    return dequantize(rows, dtype) if cache.dtype == torch.int8 else rows


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """SDPA over (B, Hq, n, D) queries and (B, Hkv, S, D) keys and values, `mask` (None: causal);
    with `softcap` or `sinks`, written out, as SDPA has neither: scores scaled, then softcap *
    tanh(scores / softcap), masked, each head's sink logit a last column of the softmax (in
    fp32) that is dropped after it (transformers' eager order)."""
    if softcap is None and sinks is None:
        is_causal = mask is None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, s = q.shape[2], k.shape[2]
        mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)
    return probs[..., :-1].to(q.dtype) @ v


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def attend(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window=None,
        softcap=None,
        sinks=None,
    ) -> Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, sinks)
        bs = k_cache.shape[1]
        start = nd
        for r in range(nd, meta.num_rows):
            n, L = meta.query_lens_cpu[r], meta.seq_lens_cpu[r]
            qr = q[start : start + n].transpose(0, 1)[None]  # (1, Hq, n, D)
            if n == L and k_cache.dtype == q.dtype:  # all new and stored as is: read k, v
                kr, vr = k[start : start + n], v[start : start + n]
            else:
                table = meta.block_tables[r : r + 1, : math.ceil(L / bs)]
                kr = gather_blocks(k_cache, table, q.dtype)[0, :L]
                vr = gather_blocks(v_cache, table, q.dtype)[0, :L]
            mask = None  # a whole context without a window: SDPA's own causal mask
            if n != L or window is not None:
                # New token i sits at position L - n + i and sees keys up to it, and in a
                # window only the window - 1 before it.
                rows = torch.arange(L - n, L, device=q.device)[:, None]
                keys = torch.arange(L, device=q.device)[None, :]
                mask = (keys <= rows) & (keys > rows - (window or L))
            o = attention(
                qr, kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], mask, scale, softcap, sinks
            )
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out

    @staticmethod
    def _decode(
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: Tensor | None,
    ) -> Tensor:
        """All one-token rows at once: gather, mask each row past its length (and before its
        window), one SDPA. The slots past a row's length (its last block's tail, the scratch
        block) were never written and may hold NaN: masking their scores is not enough, as a
        weight of 0 times a NaN value is NaN, so the gathered copies are zeroed there first."""
        nd, bs = meta.num_decodes, k_cache.shape[1]
        n_blocks = math.ceil(max(meta.seq_lens_cpu[:nd]) / bs)
        table = meta.block_tables[:nd, :n_blocks]
        slots = torch.arange(n_blocks * bs, device=q.device)
        lens = meta.seq_lens[:nd, None]
        visible = slots < lens
        if window is not None:
            visible &= slots >= lens - window
        hidden = ~visible[:, :, None, None]
        keys = gather_blocks(k_cache, table, q.dtype).masked_fill_(hidden, 0).transpose(1, 2)
        values = gather_blocks(v_cache, table, q.dtype).masked_fill_(hidden, 0).transpose(1, 2)
        # q (nd, Hq, 1, D), keys and values (nd, H, S, D)
        mask = visible[:, None, None, :]
        o = attention(q[:, :, None], keys, values, mask, scale, softcap, sinks)
        return o[:, :, 0]
