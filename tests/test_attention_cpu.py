"""The CPU attention backend (a C++ kernel reading the paged blocks in place) against the
reference backend (gather + SDPA) on random steps, with and without a sliding window, and its
fallbacks; both against garbage in the slots no row may read."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyllm.model import cpu_library
from tinyllm.model.attention import cpu
from tinyllm.model.attention.backend import AttentionMetadata
from tinyllm.model.attention.reference import ReferenceBackend
from tinyllm.model.attention.select import get_backend

REFERENCE = ReferenceBackend()
SPARE_BLOCKS = 3  # in the pool but in no row's table
# A sliding window (keys a query sees, itself included), or none: windows within a tile of 32
# keys, across tiles, and longer than every context drawn.
WINDOWS = st.none() | st.integers(1, 80)


@pytest.fixture(scope="module")
def backend() -> cpu.CPUBackend:
    """The real kernel, built once (tens of seconds the first time on a machine). g++ and
    ninja are dependencies, so a failed build is an error, not a skip."""
    b, why = cpu.load_cpu_backend()
    if b is None:
        pytest.fail(why)
    return b


@st.composite
def steps(draw) -> dict:
    """A step's shapes: decode rows first, then prefill rows (a chunk of new tokens after
    `earlier` tokens already in the cache, none for a first chunk); lengths anywhere in a block
    or exactly on a block boundary."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))

    def tokens(lo: int, hi: int) -> st.SearchStrategy[int]:
        """A count in [lo, hi]: any, or a whole number of blocks."""
        return st.integers(lo, hi) | st.integers(math.ceil(lo / bs), hi // bs).map(lambda b: b * bs)

    decodes = draw(st.lists(tokens(1, 70), max_size=4))
    prefills = []
    for earlier in draw(st.lists(tokens(0, 50), max_size=3)):
        end = draw(tokens(earlier + 2, earlier + 40))
        prefills.append((end, end - earlier))
    rows = [(L, 1) for L in decodes] + prefills
    if not rows:
        rows = [(draw(tokens(1, 70)), 1)]
    Hq, Hkv = draw(st.sampled_from([(1, 1), (4, 2), (9, 3)]))
    D = draw(st.sampled_from([6, 8, 64, 128]))  # 64 and 128 take the unrolled paths
    return dict(rows=rows, bs=bs, Hq=Hq, Hkv=Hkv, D=D, seed=draw(st.integers(0, 2**31)))


def build(rows, bs, Hq, Hkv, D, seed, dtype=torch.float32):
    """q, k, v, the caches and the metadata of a step whose rows are (context length, new
    tokens); the new tokens' K/V are already in the caches, as `forward` leaves them. Each row
    gets shuffled distinct blocks; tables are padded with the scratch block. Also returns a
    mask of the cache slots that hold no row's context."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(L / bs) for L, _ in rows]
    pool = sum(counts) + SPARE_BLOCKS
    scratch = pool  # the last block
    tables = torch.full((len(rows), max(counts) + 1), scratch)
    unused = torch.ones(pool + 1, bs, dtype=torch.bool)
    slots = []
    for r, ids in enumerate(torch.randperm(pool, generator=gen)[: sum(counts)].split(counts)):
        L, n = rows[r]
        tables[r, : len(ids)] = ids
        pos = torch.arange(L)
        unused[ids[pos // bs], pos % bs] = False
        slots.append(ids[pos[L - n :] // bs] * bs + pos[L - n :] % bs)
    slot_mapping = torch.cat(slots)
    # K and V drawn independently: reading one in place of the other changes the output.
    k_cache = torch.randn(pool + 1, bs, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(pool + 1, bs, Hkv, D, generator=gen).to(dtype)
    q = torch.randn(len(slot_mapping), Hq, D, generator=gen).to(dtype)
    k = k_cache.view(-1, Hkv, D)[slot_mapping]
    v = v_cache.view(-1, Hkv, D)[slot_mapping]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=torch.tensor([L for L, _ in rows]),
        query_start_loc=torch.tensor([0] + [n for _, n in rows]).cumsum(0),
        num_decodes=sum(n == 1 for _, n in rows),
        seq_lens_cpu=[L for L, _ in rows],
        query_lens_cpu=[n for _, n in rows],
    )
    return (q, k, v, k_cache, v_cache, meta), unused


def before_windows(meta: AttentionMetadata, bs: int, window: int | None) -> torch.Tensor:
    """The cache slots (a mask like build's `unused`) of each row's positions before the window
    of its first new token: no query of the step may see them."""
    hidden = torch.zeros(meta.block_tables.max() + 1, bs, dtype=torch.bool)
    for r, (L, n) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu, strict=True)):
        pos = torch.arange(max(0, L - n - window + 1) if window else 0)
        hidden[meta.block_tables[r, pos // bs], pos % bs] = True
    return hidden


@settings(max_examples=80, deadline=None)
@given(step=steps(), window=WINDOWS, garbage=st.sampled_from([float("nan"), float("inf"), 1e30]))
def test_matches_reference_and_ignores_unused_slots(backend, step, window, garbage):
    args, unused = build(**step)
    assert_matches_reference(backend, args, unused, step, window, garbage, -garbage)


def assert_matches_reference(backend, args, unused, step, window, k_garbage, v_garbage):
    """The kernel's output is the reference's within fp32 rounding; and whatever the scratch
    block, spare blocks, slots past each row's length and slots before every query's window
    hold (set to the garbage values), the same, bit for bit: the kernel skips what no query
    sees, and masks it inside a tile it reads."""
    scale = step["D"] ** -0.5
    out = backend.attend(*args, scale=scale, window=window)
    expected = REFERENCE.attend(*args, scale=scale, window=window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    q, k, v, k_cache, v_cache, meta = args
    unused |= before_windows(meta, step["bs"], window)
    k_cache[unused] = k_garbage
    v_cache[unused] = v_garbage
    assert torch.equal(backend.attend(q, k, v, k_cache, v_cache, meta, scale, window), out)


@settings(max_examples=30, deadline=None)
@given(step=steps(), window=st.integers(1, 80))
def test_a_window_changes_what_the_reference_sees(step, window):
    """The window cases above would pass if both backends ignored it: the reference's output
    is its own over only the window's keys. A row's output with window W is the output of the
    same queries over a context cut to its last W keys, computed as a row of its own (the
    window's first key then at position 0), one query at a time."""
    args, _ = build(**step)
    q, _, _, k_cache, v_cache, meta = args
    scale = step["D"] ** -0.5
    out = REFERENCE.attend(*args, scale=scale, window=window)
    bs, i = step["bs"], 0
    for r, (L, n) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu, strict=True)):
        for pos in range(L - n, L):
            keys = torch.arange(max(0, pos - window + 1), pos + 1)
            slots = meta.block_tables[r, keys // bs] * bs + keys % bs
            ks = k_cache.flatten(0, 1)[slots].transpose(0, 1)
            vs = v_cache.flatten(0, 1)[slots].transpose(0, 1)
            alone = torch.nn.functional.scaled_dot_product_attention(
                q[i][:, None], ks, vs, scale=scale, enable_gqa=True
            )[:, 0]
            torch.testing.assert_close(out[i], alone, rtol=1e-5, atol=1e-5)
            i += 1


@settings(max_examples=40, deadline=None)
@given(step=steps(), garbage=st.sampled_from([float("nan"), float("inf")]))
def test_the_reference_ignores_unused_slots_too(step, garbage):
    """The pool is never zeroed: the reference's decode gathers whole blocks and masks the
    slots past each row's length, and a masked weight of 0 times a NaN or inf value would
    still be NaN."""
    args, unused = build(**step)
    scale = step["D"] ** -0.5
    out = REFERENCE.attend(*args, scale=scale)
    assert not out.isnan().any()
    q, k, v, k_cache, v_cache, meta = args
    k_cache[unused] = garbage
    v_cache[unused] = -garbage
    assert torch.equal(REFERENCE.attend(q, k, v, k_cache, v_cache, meta, scale), out)


@settings(max_examples=15, deadline=None)
@given(step=steps(), window=WINDOWS)
def test_bf16_accumulates_in_fp32(backend, step, window):
    """bf16 in and out: within bf16's rounding of the fp32 answer on the same values."""
    args, _ = build(**step, dtype=torch.bfloat16)
    scale = step["D"] ** -0.5
    out = backend.attend(*args, scale=scale, window=window)
    assert out.dtype == torch.bfloat16
    as_fp32 = [a.float() for a in args[:5]]
    expected = REFERENCE.attend(*as_fp32, args[5], scale=scale, window=window)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def attend_span(backend, args, first: int, end: int, scale: float, window=None) -> torch.Tensor:
    """The outputs of a one-row step's tokens [first, end) computed as a step of their own: the
    row's context ends at `end` and those are its new tokens; same caches and table."""
    q, _, _, k_cache, v_cache, meta = args
    at = meta.seq_lens_cpu[0] - meta.query_lens_cpu[0]  # q[0]'s position
    n = end - first
    span = AttentionMetadata(
        slot_mapping=meta.slot_mapping[first - at : end - at],
        block_tables=meta.block_tables,
        seq_lens=torch.tensor([end]),
        query_start_loc=torch.tensor([0, n]),
        num_decodes=int(n == 1),
        seq_lens_cpu=[end],
        query_lens_cpu=[n],
    )
    return backend.attend(
        q[first - at : end - at], None, None, k_cache, v_cache, span, scale, window
    )


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [8, 64, 128])
def test_a_tokens_bits_do_not_depend_on_what_shares_its_step(backend, dtype, D, window):
    """A token's output is the same bits as a decode (alone), in a chunk of 3, 11, 16, 17 or 37
    new tokens wherever the chunk starts, at one thread and at two. The kernel gives up to 16
    of a row's tokens one work item, sharing each tile of keys, and fewer when a step has too
    few items for its threads (at two threads a row of 3 KV heads splits its tokens in two); a
    query's arithmetic must still depend only on its position and keys. 101 tokens: tiles of 32
    and blocks of 16 end mid-chunk. Under a sliding window each query starts at its own first
    key: a window of 5 starts inside a tile, one of 40 spans two, and the item's queries start
    in different tiles."""
    L, n = 101, 37
    args, _ = build([(L, n)], bs=16, Hq=9, Hkv=3, D=D, seed=D, dtype=dtype)
    whole = attend_span(backend, args, L - n, L, D**-0.5, window)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(attend_span(backend, args, L - n, L, D**-0.5, window), whole)
            for size in (1, 3, 11, 16, 17):
                for first in range(L - n, L, size):
                    end = min(first + size, L)
                    part = attend_span(backend, args, first, end, D**-0.5, window)
                    expected = whole[first - (L - n) : end - (L - n)]
                    assert torch.equal(part, expected), (count, size, first)
    finally:
        torch.set_num_threads(threads)
    # A window that covers the whole context is full attention, bit for bit.
    if window is None:
        assert torch.equal(attend_span(backend, args, L - n, L, D**-0.5, L), whole)


def test_denormals_read_as_zero_in_the_kernel_and_only_there(backend):
    """The kernel runs with denormals flushed to zero (the CPU's FTZ and DAZ modes): a key far
    below its row's maximum gets a weight near 1e-38, and that weight times its V row is a
    denormal, a microcode assist each (heads whose scores spread past ~80 ran 3 to 10x slower).
    So V rows of denormals attend to exactly zero, where they would give ~1e-39; and the
    caller's own mode is back after the call: a denormal is still one outside the kernel."""
    args, _ = build([(40, 1), (37, 5)], bs=16, Hq=4, Hkv=2, D=64, seed=0)
    q, _, _, k_cache, v_cache, meta = args
    v_cache.fill_(1e-39)
    out = backend.attend(q, None, None, k_cache, v_cache, meta, 64**-0.5)
    assert torch.equal(out, torch.zeros_like(out))
    assert (torch.tensor([1e-37]) / 100).item() > 0


def write_and_attend(backend, q, k, v, k_cache, v_cache, meta, scale, window=None):
    """The kernel as model/decoder_layer.cpp calls it: it writes the new K/V itself."""
    out = q.new_empty(q.shape)
    backend.kernel(out, q, k_cache, v_cache, k, v, meta.slot_mapping, meta.block_tables,
                   meta.seq_lens, meta.query_start_loc, meta.num_rows, scale, window)  # fmt: skip
    return out


@settings(max_examples=25, deadline=None)
@given(step=steps(), window=WINDOWS)
def test_the_kernel_writes_the_new_kv_from_the_fused_rows(backend, step, window):
    """As the whole-layer op calls the kernel: q, k and v are views into one fused qkv row per
    token (strided), written into the caches by the kernel itself; the caches and the output
    are the reference backend's (index_copy_, then attention)."""
    (q, k, v, k_cache, v_cache, meta), _ = build(**step)
    qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
    Hq, Hkv, D = step["Hq"], step["Hkv"], step["D"]
    views = qkv[:, : Hq * D].view(-1, Hq, D), qkv[:, Hq * D : (Hq + Hkv) * D].view(-1, Hkv, D)
    views += (qkv[:, (Hq + Hkv) * D :].view(-1, Hkv, D),)
    ours_k, ours_v = k_cache.clone(), v_cache.clone()
    for cache in (ours_k, ours_v):
        cache.view(-1, Hkv, D)[meta.slot_mapping] = float("nan")  # the kernel must write these
    out = write_and_attend(backend, *views, ours_k, ours_v, meta, D**-0.5, window)
    expected = REFERENCE.forward(q, k, v, k_cache, v_cache, meta, D**-0.5, window)
    assert torch.equal(ours_k, k_cache) and torch.equal(ours_v, v_cache)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_a_slot_outside_the_cache(backend):
    (q, k, v, k_cache, v_cache, meta), _ = build([(5, 5)], 4, 4, 2, 8, seed=1)
    meta.slot_mapping[2] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises(RuntimeError, match=f"slot {meta.slot_mapping[2]} outside the cache's"):
        write_and_attend(backend, q, k, v, k_cache, v_cache, meta, 0.3)


@pytest.mark.parametrize("window", [0, -3])
def test_the_kernel_refuses_a_window_without_the_query(backend, window):
    (q, k, v, k_cache, v_cache, meta), _ = build([(5, 5)], 4, 4, 2, 8, seed=1)
    with pytest.raises(RuntimeError, match=f"window {window} must be >= 1"):
        write_and_attend(backend, q, k, v, k_cache, v_cache, meta, 0.3, window)


def test_other_dtypes_use_the_reference(backend):
    args, _ = build([(20, 1), (30, 12)], 4, 4, 2, 8, seed=0, dtype=torch.float16)
    assert torch.equal(backend.attend(*args, scale=0.3), REFERENCE.attend(*args, scale=0.3))


def test_a_failed_build_is_reported_not_raised(monkeypatch):
    def fail():
        raise RuntimeError(
            "Error building extension 'x': [1/2] c++ -O3 -c cpu_kernel.cpp\n"
            "cpu_kernel.cpp:1:1: error: expected declaration\n"
        )

    monkeypatch.setattr(cpu, "_kernel", fail)
    backend, why = cpu.load_cpu_backend()
    assert backend is None
    assert why.endswith("cpu_kernel.cpp:1:1: error: expected declaration")
    assert isinstance(get_backend("auto", torch.device("cpu")), ReferenceBackend)
    with pytest.raises(ValueError, match="error: expected declaration"):
        get_backend("cpu", torch.device("cpu"))


def test_a_missing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    """An install without a library for this CPU's level (its folder empty) builds one; with no
    compiler it says so."""
    monkeypatch.setattr(cpu_library, "KERNELS", tmp_path)
    monkeypatch.setattr(cpu_library, "_build_directory", lambda: tmp_path)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_library.library_error.cache_clear()  # really try to build, then forget the outcome
    try:
        backend, why = cpu.load_cpu_backend()
    finally:
        cpu_library.library_error.cache_clear()
    assert backend is None
    assert "no C++ compiler" in why and "/nonexistent/c++" in why
