"""The CUDA backend: a Triton kernel that reads the paged K/V blocks in place.

The reference gathers each row's blocks into a contiguous copy, then attends; this kernel follows
the row's block table instead, so every K and V byte is read once, straight from the pool.

One program takes a tile of one row's new tokens and one KV head, together with the `group` query
heads that share it (grouped-query attention): the tile's rows are (token, query head) pairs, row
m being token m // group and head m % group, so the K/V chunk loaded serves all of them. It walks
the context in chunks of keys, each key's block looked up in the block table, keeping a running
softmax (flash attention), so no copy of the context is ever made. Decode rows and prefill rows
are two launches of the same kernel: decode tiles hold one token, padded to the 16 rows of a
tensor-core MMA; prefill tiles hold 64 rows, as many tokens as fit.
"""

import functools

import torch
from torch import Tensor

from tinyllm.model.attention.backend import AttentionBackend, AttentionMetadata

DECODE_ROWS = 16  # a tensor-core MMA is 16 rows high; a decode tile fills `group` of them
PREFILL_ROWS = 64


def load_cuda_backend() -> tuple[AttentionBackend | None, str]:
    """The Triton backend, or None and the reason it cannot run here. Never raises."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            return None, "torch has no CUDA (a CPU-only build)"
        return None, "torch sees no CUDA device"
    try:
        kernel = _define_kernel()
    except ImportError:
        return None, "triton is not installed"
    except Exception as e:  # a broken install fails in its own ways: fall back, not crash
        return None, f"triton failed to load: {e!r}"
    return CudaBackend(kernel), "ok"


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class CudaBackend(AttentionBackend):
    name = "cuda"
    # The kernel attends to the whole context; a window needs a lower bound on each row's keys
    # (and a first chunk that is not wholly masked for some row), untested without a GPU here.
    supports_sliding_window = False

    supports_int8_cache = False  # its kernel reads K/V rows of q's dtype

    def __init__(self, kernel):
        self.kernel = kernel

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
        assert window is None  # get_backend does not pick this backend for a model with one
        if softcap is not None:  # Gemma 2, which also slides: get_backend picks the reference
            raise ValueError(
                "the cuda attention backend has no attention-logit soft-capping (Gemma 2's); "
                "use attention_backend='reference'"
            )
        if sinks is not None:  # gpt-oss, which also slides: get_backend picks the reference
            raise ValueError(
                "the cuda attention backend has no attention sinks (gpt-oss's); "
                "use attention_backend='reference'"
            )
        # The kernel steps through head_dim with unit stride and shares one set of cache strides.
        assert q.stride(-1) == k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            self._launch(q, k_cache, v_cache, out, meta, scale, 0, nd, 1, DECODE_ROWS)
        if meta.num_rows > nd:
            longest = max(meta.query_lens_cpu[nd:])  # the CPU copy: sizing the grid needs no sync
            rows = meta.num_rows - nd
            self._launch(q, k_cache, v_cache, out, meta, scale, nd, rows, longest, PREFILL_ROWS)
        return out

    def _launch(self, q, k_cache, v_cache, out, meta, scale, first_row, num_rows, longest, rows):
        """Rows [first_row, first_row + num_rows), whose longest has `longest` new tokens."""
        _, block_size, kv_heads, head_dim = k_cache.shape
        group = q.shape[1] // kv_heads
        rows = max(rows, _pow2(group))
        tile_tokens = rows // group
        fp32 = q.dtype == torch.float32
        self.kernel[(num_rows, -(-longest // tile_tokens), kv_heads)](
            q,
            k_cache,
            v_cache,
            out,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            first_row,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *k_cache.stride()[:3],
            meta.block_tables.stride(0),
            GROUP=group,
            TILE_TOKENS=tile_tokens,
            ROWS=rows,
            HEAD_DIM=head_dim,
            D_PAD=max(16, _pow2(head_dim)),  # tl.dot's inner size is at least 16
            BLOCK_SIZE=block_size,
            # fp32 tiles are twice the bytes, and its exact ("ieee") dots run on the CUDA cores,
            # not the tensor cores: half the keys per step and twice the warps keep its tiles in
            # shared memory and registers (no spills on sm_90). tf32 would round fp32 to 10 bits;
            # "tf32" is the default, which 16-bit inputs ignore.
            KEYS=32 if fp32 else 64,
            PRECISION="ieee" if fp32 else "tf32",
            num_warps=8 if fp32 else 4,
        )


@functools.cache  # one kernel, and one cache of compiled variants, however many backends load
def _define_kernel():
    """Import triton and define the kernel: here, not at the top, so that the module imports
    where triton is absent (CPU machines)."""
    import triton
    import triton.language as tl

    # first_row and the table's width change step to step: specializing on their values
    # (== 1, multiples of 16) would compile new variants mid-serving.
    @triton.jit(do_not_specialize=["first_row", "stride_table"])
    def paged_attention(
        Q,  # (N, Hq, D)
        K,  # (num_blocks + 1, block_size, Hkv, D), as V
        V,
        Out,  # (N, Hq, D)
        block_tables,  # (R, max_blocks)
        seq_lens,  # (R,)
        query_start,  # (R + 1,)
        scale,
        first_row,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_table,
        GROUP: tl.constexpr,  # query heads per KV head
        TILE_TOKENS: tl.constexpr,  # new tokens per tile: ROWS // GROUP
        ROWS: tl.constexpr,  # tile rows, the first TILE_TOKENS * GROUP of them real
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
        BLOCK_SIZE: tl.constexpr,
        KEYS: tl.constexpr,  # keys per step of the context loop
        PRECISION: tl.constexpr,
    ):
        row = first_row + tl.program_id(0)
        tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        start = tl.load(query_start + row)
        n = tl.load(query_start + row + 1) - start
        if tile * TILE_TOKENS >= n:  # the grid is sized for the longest row
            return
        seq_len = tl.load(seq_lens + row)

        m = tl.arange(0, ROWS)
        tok = tile * TILE_TOKENS + m // GROUP  # which of the row's new tokens
        head = kv_head * GROUP + m % GROUP
        real = (m < TILE_TOKENS * GROUP) & (tok < n)
        pos = seq_len - n + tok  # the new tokens are the last n of the context
        d = tl.arange(0, D_PAD)
        d_real = d < HEAD_DIM
        q_at = (start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(Q + q_at, mask=real[:, None] & d_real[None, :], other=0.0)

        # Keys past the tile's last token are never seen: stop there. Every row, padding included,
        # sees key 0 (pos >= 0), so the first chunk makes each running max finite: no NaN.
        end = seq_len - n + tl.minimum(n, (tile + 1) * TILE_TOKENS)
        qk_scale = scale * 1.4426950408889634  # log2(e): exp2 is the cheap exponential
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        for k0 in range(0, end, KEYS):
            key = k0 + tl.arange(0, KEYS)
            in_ctx = key < end
            # Each key's block, so that a chunk may span blocks or lie inside one. Masked loads
            # keep the table's next row and the pool's unwritten slots (maybe NaN) out.
            table_at = block_tables + row * stride_table + key // BLOCK_SIZE
            block = tl.load(table_at, mask=in_ctx, other=0).to(tl.int64)  # big pools pass 2**31
            slot = block * stride_kb + (key % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            kt = tl.load(
                K + slot[None, :] + d[:, None], mask=d_real[:, None] & in_ctx[None, :], other=0.0
            )  # (D_PAD, KEYS): K transposed, ready for the dot
            vv = tl.load(
                V + slot[:, None] + d[None, :], mask=in_ctx[:, None] & d_real[None, :], other=0.0
            )
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
            s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))  # causal
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = tl.dot(p.to(vv.dtype), vv, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        o_at = (start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        o = acc / l_i[:, None]
        tl.store(Out + o_at, o.to(Out.dtype.element_ty), mask=real[:, None] & d_real[None, :])

    return paged_attention
