"""rzero.ops: batch invariance of every kernel, with stock PyTorch as the negative control.

"Invariant" always means bitwise: torch.equal, never allclose. Each negative control shows that the
property is not free on this machine, so the invariant tests are not passing vacuously.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rzero import ops
from rzero.ops import ATTN_BLOCK, INVARIANT, AttentionMeta, SamplingTransform
from rzero.ops import cpu_kernel, invariant
from rzero.ops.invariant import grouping_probe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def embed_row(row: torch.Tensor, rows: int, pos: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """A (rows, ...) batch of random neighbours with `row` at position `pos`."""
    batch = randn(gen, rows, *row.shape, dtype=row.dtype, scale=scale)
    batch[pos] = row
    return batch


@contextlib.contextmanager
def kernel_impl(impl: str):
    """Run the CPU's invariant attention and RMSNorm on the C kernels ("kernel") or on the stock-op
    fallback that a machine without a C compiler uses ("stock"): both must keep every guarantee."""
    if impl == "kernel":
        if cpu_kernel.library() is None:
            pytest.skip(f"the C kernels are not in use: {cpu_kernel.kernel_status()}")
        yield
        return
    saved, cpu_kernel.library = cpu_kernel.library, lambda: None
    try:
        yield
    finally:
        cpu_kernel.library = saved


IMPLS = pytest.mark.parametrize("impl", ["kernel", "stock"])


def row_and_batch(draw_data, max_rows: int):
    rows = draw_data.draw(st.integers(1, max_rows), label="rows")
    pos = draw_data.draw(st.integers(0, rows - 1), label="pos")
    seed = draw_data.draw(st.integers(0, 2**31 - 1), label="seed")
    return rows, pos, torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# 1. linear
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [128, 256, 384])
def test_stock_linear_is_not_batch_invariant(K):
    """Negative control: stock fp32 F.linear gives a row different bits at M=1, M=2..3 and M>=4."""
    gen = torch.Generator().manual_seed(0)
    weight = randn(gen, 256, K)
    x = randn(gen, 8, K)
    by_m = {m: F.linear(x[:m], weight)[0] for m in range(1, 9)}
    distinct = {tuple(v.tolist()) for v in by_m.values()}
    assert len(distinct) >= 2, f"K={K}: F.linear happened to be batch-invariant on this CPU"


@FAST
@given(
    data=st.data(),
    K=st.sampled_from([16, 64, 128, 136, 384]),
    N=st.sampled_from([8, 64, 200, 256]),
    dtype=st.sampled_from(["fp32", "bf16"]),
)
def test_invariant_linear_rows_are_batch_invariant(data, K, N, dtype):
    rows, pos, gen = row_and_batch(data, 300)
    dt = DTYPES[dtype]
    weight = randn(gen, N, K, dtype=dt, scale=0.1)
    row = randn(gen, K, dtype=dt)
    batch = embed_row(row, rows, pos, gen)
    nx = ops.INVARIANT
    alone = nx.linear(row[None], weight)[0]
    in_batch = nx.linear(batch, weight)[pos]
    # Leading dims are flattened: a 3-d input gives the same row.
    as_3d = nx.linear(batch[None], weight)[0, pos]
    assert alone.dtype == dt and alone.shape == (N,)
    diff = (alone.float() - in_batch.float()).abs().max()
    assert torch.equal(alone, in_batch), f"rows={rows} pos={pos}: max diff {diff}"
    assert torch.equal(alone, as_3d)


# Shapes of the tiny presets and of a Qwen3-0.6B layer (hidden 1024, MLP 3072).
PROBE_SHAPES = [(128, 128), (128, 512), (512, 128), (128, 1024), (1024, 3072), (3072, 1024), (1024, 1024)]


def test_stock_bf16_linear_changes_grouping_with_row_count():
    """Negative control: on this CPU the stock bf16 GEMM sums a row's K terms differently for
    different row counts (kernel and K blocking follow M), for at least one shape."""
    changed = []
    for K, N in PROBE_SHAPES:
        x, weight = grouping_probe(512, K, N, seed=K * N)
        first = F.linear(x[:16], weight)
        changed += [(K, N, m) for m in (32, 64, 96, 128, 256, 512) if not torch.equal(F.linear(x[:m], weight)[:16], first)]
    if not changed:
        pytest.skip("this CPU's bf16 GEMM happens to be row-count invariant for these shapes")
    assert changed


@pytest.mark.parametrize("K,N", PROBE_SHAPES)
def test_invariant_linear_grouping_probe_over_row_counts_and_threads(K, N):
    x, weight = grouping_probe(512, K, N, seed=K * N)
    threads = torch.get_num_threads()
    nx = ops.INVARIANT
    first = nx.linear(x[:16], weight)
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for m in (1, 5, 16, 48, 96, 128, 160, 512):
                got = nx.linear(x[:m], weight)[: min(m, 16)]
                assert torch.equal(got, first[: min(m, 16)]), f"{K}x{N}: rows={m} threads={t}"
    finally:
        torch.set_num_threads(threads)


def test_invariant_linear_close_to_stock():
    gen = torch.Generator().manual_seed(1)
    weight, x = randn(gen, 96, 128), randn(gen, 37, 128)
    nx = ops.INVARIANT
    out = nx.linear(x, weight)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 2. row reductions and elementwise ops
# ---------------------------------------------------------------------------------------------

ROW_OPS = {
    "rms_norm": lambda nx, x, w: nx.rms_norm(x, w, 1e-6),
    "log_softmax": lambda nx, x, w: nx.log_softmax(x),
    "softmax": lambda nx, x, w: nx.softmax(x),
}


@IMPLS
@FAST
@given(
    data=st.data(),
    op=st.sampled_from(sorted(ROW_OPS)),
    width=st.sampled_from([1, 7, 32, 128, 1000, 4099]),
    dtype=st.sampled_from(["fp32", "bf16"]),
)
def test_invariant_row_ops_are_batch_invariant(data, op, width, dtype, impl):
    with kernel_impl(impl):
        _row_op_is_batch_invariant(data, op, width, dtype)


def _row_op_is_batch_invariant(data, op, width, dtype):
    rows, pos, gen = row_and_batch(data, 70)
    dt = DTYPES[dtype]
    weight = (1 + randn(gen, width, scale=0.1)).to(dt)
    row = randn(gen, width, dtype=dt, scale=3.0)
    batch = embed_row(row, rows, pos, gen, scale=3.0)
    fn = ROW_OPS[op]
    nx = ops.INVARIANT
    alone = fn(nx, row[None], weight)[0]
    in_batch = fn(nx, batch, weight)[pos]
    assert torch.equal(alone, in_batch), f"{op} rows={rows} pos={pos}"
    if op != "rms_norm":
        assert alone.dtype == torch.float32  # log_softmax / softmax compute and return fp32


@pytest.mark.parametrize(
    "op, width",
    [("rms_norm", 70000), ("rms_norm", 100000), ("rms_norm", 151936), ("log_softmax", 151936), ("softmax", 151936)],
)
def test_invariant_row_ops_long_row(op, width):
    """Rows past the 32768 reduction grain (up to a Qwen vocab, 151936) alone and among many rows."""
    fn = ROW_OPS[op]
    for seed in range(8):  # stock kernels differ only for some rows (see the negative control)
        gen = torch.Generator().manual_seed(seed)
        row = randn(gen, width, scale=4.0)
        weight = 1 + randn(gen, width, scale=0.1)
        nx = ops.INVARIANT
        alone = fn(nx, row[None], weight)[0]
        for rows, pos in [(2, 1), (4, 0)] + ([(17, 9)] if seed == 0 else []):
            batched = fn(nx, embed_row(row, rows, pos, gen, scale=4.0), weight)[pos]
            assert torch.equal(alone, batched), (seed, rows, pos)
    if op != "rms_norm":
        total = alone.exp().sum() if op == "log_softmax" else alone.sum()
        assert abs(total.item() - 1.0) < 1e-3


def test_stock_rms_norm_long_row_is_not_batch_invariant():
    """Negative control: with fewer rows than threads, a long row's mean-of-squares is split across
    threads, so stock rms_norm gives a lone row different bits than the same row in a batch."""
    if torch.get_num_threads() < 2:
        pytest.skip("needs at least 2 intra-op threads")
    differs = []
    for seed in range(8):  # the split sums agree often, but not always
        gen = torch.Generator().manual_seed(seed)
        for width in (70000, 100000):
            row, weight = randn(gen, width, scale=4.0), torch.ones(width)
            nx = ops.STANDARD
            alone = nx.rms_norm(row[None], weight, 1e-6)[0]
            batched = nx.rms_norm(embed_row(row, 3, 0, gen, scale=4.0), weight, 1e-6)[0]
            differs.append(not torch.equal(alone, batched))
        if any(differs):
            break
    assert any(differs), "stock rms_norm happened to be invariant for every long row tried"


@FAST
@given(
    data=st.data(),
    width=st.sampled_from([1, 3, 7, 37, 64, 100, 129, 300, 513]),
    dtype=st.sampled_from(["fp32", "bf16"]),
)
def test_invariant_silu_mul_odd_sizes(data, width, dtype):
    """Which elements fall in the vectorised tail depends on the total size; invariant mode pads it."""
    rows, pos, gen = row_and_batch(data, 70)
    dt = DTYPES[dtype]
    g_row, u_row = randn(gen, width, dtype=dt, scale=3.0), randn(gen, width, dtype=dt)
    gate, up = embed_row(g_row, rows, pos, gen, scale=3.0), embed_row(u_row, rows, pos, gen)
    nx = ops.INVARIANT
    alone = nx.silu_mul(g_row[None], u_row[None])[0]
    in_batch = nx.silu_mul(gate, up)[pos]
    flat = nx.silu_mul(g_row, u_row)  # 1-d input, no row dimension at all
    assert torch.equal(alone, in_batch), f"width={width} rows={rows} pos={pos}"
    assert torch.equal(alone, flat)
    torch.testing.assert_close(alone.float(), (F.silu(g_row.float()) * u_row.float()), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("width", [64, 512, 3072])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_invariant_silu_mul_on_column_slices_of_a_joined_gemm(width, dtype):
    """Training, prefill and decode all hand silu_mul the gate and up as column slices of one
    GEMM's output: each row gets the bits of a flat contiguous copy, alone or among any rows."""
    gen = torch.Generator().manual_seed(width)
    joined = (torch.randn(37, 2 * width, generator=gen) * 3).to(DTYPES[dtype])
    gate, up = joined[:, :width], joined[:, width:]
    assert not gate.is_contiguous()
    out = ops.INVARIANT.silu_mul(gate, up)
    assert torch.equal(out, F.silu(gate.contiguous().reshape(-1)).reshape(gate.shape) * up.contiguous())
    for i in (0, 17, 36):
        assert torch.equal(ops.INVARIANT.silu_mul(gate[i : i + 1], up[i : i + 1])[0], out[i])
        assert torch.equal(ops.INVARIANT.silu_mul(gate[: i + 1], up[: i + 1])[i], out[i])


def test_apply_rotary_is_rotate_half():
    gen = torch.Generator().manual_seed(3)
    x, angle = randn(gen, 5, 2, 8), randn(gen, 5, 1, 4)
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    out = ops.INVARIANT.apply_rotary(x, cos, sin)
    x1, x2 = x[..., :4], x[..., 4:]
    expected = torch.cat((x1 * cos[..., :4] - x2 * sin[..., :4], x2 * cos[..., 4:] + x1 * sin[..., 4:]), -1)
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------------------------------------
# 3. attention over the paged KV cache
# ---------------------------------------------------------------------------------------------


class Seq:
    """Random per-token q/k/v of one sequence."""

    def __init__(self, gen: torch.Generator, length: int, heads: int, kv_heads: int, head_dim: int, dtype):
        self.length = length
        self.q = randn(gen, length, heads, head_dim, dtype=dtype)
        self.k = randn(gen, length, kv_heads, head_dim, dtype=dtype)
        self.v = randn(gen, length, kv_heads, head_dim, dtype=dtype)


def blocks_for(n: int) -> int:
    return -(-n // ATTN_BLOCK)


class PagedRun:
    """Drives ops.attention like an engine: a paged cache full of stale garbage, per-sequence block
    tables, and steps made of (sequence, start, length) chunks. Collects each token's output."""

    def __init__(
        self, seqs: list[Seq], tables: list[list[int]] | None, gen: torch.Generator, num_blocks=None, nx=ops.INVARIANT
    ):
        self.seqs, self.nx = seqs, nx
        if tables is None:  # consecutive private blocks, like AttentionMeta.for_sequences
            tables, nxt = [], 0
            for s in seqs:
                tables.append(list(range(nxt, nxt + blocks_for(s.length))))
                nxt += blocks_for(s.length)
        self.tables = tables
        num_blocks = num_blocks or (max(b for t in tables for b in t) + 1)
        _, kv_heads, head_dim = seqs[0].k.shape
        dtype = seqs[0].k.dtype
        # Stale, finite garbage everywhere: masking must make it irrelevant.
        self.k_cache = randn(gen, num_blocks, ATTN_BLOCK, kv_heads, head_dim, dtype=dtype, scale=5.0)
        self.v_cache = randn(gen, num_blocks, ATTN_BLOCK, kv_heads, head_dim, dtype=dtype, scale=5.0)
        self.out = [torch.full_like(s.q, float("nan")) for s in seqs]
        self.scale = head_dim**-0.5

    def step(self, chunks: list[tuple[int, int, int]]) -> None:
        # A growing sequence's table only holds the blocks it needs so far (as an engine allocates).
        tables = [self.tables[i][: blocks_for(start + n)] for i, start, n in chunks]
        meta = AttentionMeta.build(
            [n for _, _, n in chunks], [start for _, start, _ in chunks], tables, row_tile=self.nx.row_tile
        )
        q = torch.cat([self.seqs[i].q[s : s + n] for i, s, n in chunks])
        k = torch.cat([self.seqs[i].k[s : s + n] for i, s, n in chunks])
        v = torch.cat([self.seqs[i].v[s : s + n] for i, s, n in chunks])
        kv_heads, head_dim = k.shape[1:]
        # The caller writes the query tokens' own keys and values first (model/qwen3.py Attention).
        self.k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = k
        self.v_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping] = v
        out = self.nx.attention(q, self.k_cache, self.v_cache, meta, self.scale)
        assert out.shape[0] == meta.padded_tokens and out.dtype == q.dtype
        row = 0
        for i, s, n in chunks:
            self.out[i][s : s + n] = out[row : row + n]
            row += n

    def prefill_all(self) -> PagedRun:
        self.step([(i, 0, s.length) for i, s in enumerate(self.seqs)])
        return self


def solo_prefill(seq: Seq, gen: torch.Generator, nx=ops.INVARIANT) -> torch.Tensor:
    return PagedRun([seq], None, gen, nx=nx).prefill_all().out[0]


def decode_token_by_token(seq: Seq, gen: torch.Generator, tables=None, nx=ops.INVARIANT) -> torch.Tensor:
    run = PagedRun([seq], tables, gen, nx=nx)
    for t in range(seq.length):
        run.step([(0, t, 1)])
    return run.out[0]


def chunked(seq: Seq, sizes: list[int], gen: torch.Generator) -> torch.Tensor:
    run = PagedRun([seq], None, gen)
    start = 0
    while start < seq.length:
        n = min(sizes[0], seq.length - start)
        run.step([(0, start, n)])
        start += n
        sizes = sizes[1:] + sizes[:1]
    return run.out[0]


def reference_attention(seq: Seq) -> torch.Tensor:
    """Plain causal softmax attention in fp64, for a sanity check of the values."""
    heads, kv_heads = seq.q.shape[1], seq.k.shape[1]
    q = seq.q.double().transpose(0, 1)
    k = seq.k.double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    v = seq.v.double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(seq.length, seq.length, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


attn_shapes = st.tuples(
    st.sampled_from([1, 2, 4]),  # GQA group
    st.sampled_from([1, 2]),  # kv heads
    st.sampled_from([16, 32, 64, 128]),  # head_dim (128: Qwen3's)
    st.sampled_from(["fp32", "bf16"]),
)


def draw_seq(data, shape, max_len: int, label: str) -> Seq:
    group, kv_heads, head_dim, dtype = shape
    length = data.draw(st.integers(1, max_len), label=f"{label} length")
    seed = data.draw(st.integers(0, 2**31 - 1), label=f"{label} seed")
    return Seq(torch.Generator().manual_seed(seed), length, group * kv_heads, kv_heads, head_dim, DTYPES[dtype])


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert not torch.isnan(a).any() and not torch.isnan(b).any(), f"{what}: output not fully written"
    assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max().item()}"


@IMPLS
@SLOW
@given(data=st.data(), shape=attn_shapes)
def test_invariant_attention_prefill_decode_chunked(data, shape, impl):
    with kernel_impl(impl):
        _invariant_attention_prefill_decode_chunked(data, shape)


def _invariant_attention_prefill_decode_chunked(data, shape):
    """(a) full prefill == (b) token-by-token decode == (c) chunked prefill, bit for bit."""
    seq = draw_seq(data, shape, 56, "seq")
    gen = torch.Generator().manual_seed(0)
    full = solo_prefill(seq, gen)
    assert_same(full, decode_token_by_token(seq, gen), "decode vs prefill")
    for sizes in ([3], [ATTN_BLOCK], [5, 16, 7], [ATTN_BLOCK + 1]):
        assert_same(full, chunked(seq, sizes, gen), f"chunks {sizes} vs prefill")
    drawn = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4), label="chunk sizes")
    assert_same(full, chunked(seq, drawn, gen), f"chunks {drawn} vs prefill")
    expected = reference_attention(seq)
    tol = 1e-5 if seq.q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.double(), expected, rtol=tol, atol=tol)


@IMPLS
@SLOW
@given(data=st.data(), shape=attn_shapes)
def test_invariant_attention_batch_composition(data, shape, impl):
    with kernel_impl(impl):
        _invariant_attention_batch_composition(data, shape)


def _invariant_attention_batch_composition(data, shape):
    """(d) a sequence prefilled inside batches of other sequences (any lengths, any position) and
    (e) through a shuffled, non-contiguous block table gives the same bits as prefilled alone."""
    target = draw_seq(data, shape, 60, "target")
    n_others = data.draw(st.integers(1, 5), label="others")
    others = [draw_seq(data, shape, 60, f"other{i}") for i in range(n_others)]
    pos = data.draw(st.integers(0, n_others), label="position")
    seqs = others[:pos] + [target] + others[pos:]
    gen = torch.Generator().manual_seed(1)
    alone = solo_prefill(target, gen)
    solos = [solo_prefill(s, gen) for s in seqs]
    packed = PagedRun(seqs, None, gen).prefill_all()
    # Shuffled blocks drawn from a larger pool (free blocks in between, block ids out of order).
    need = sum(blocks_for(s.length) for s in seqs)
    pool = list(range(2 * need + 3))
    random.Random(data.draw(st.integers(0, 10**6), label="shuffle")).shuffle(pool)
    tables, used = [], 0
    for s in seqs:
        tables.append(pool[used : used + blocks_for(s.length)])
        used += blocks_for(s.length)
    shuffled = PagedRun(seqs, tables, gen, num_blocks=len(pool)).prefill_all()
    shuffled_decode = decode_token_by_token(target, gen, tables=[pool[: blocks_for(target.length)]])
    assert_same(alone, packed.out[pos], "packed vs alone")
    assert_same(alone, shuffled.out[pos], "shuffled blocks vs alone")
    assert_same(alone, shuffled_decode, "decode through shuffled blocks vs alone")
    for i, s in enumerate(seqs):
        assert_same(solos[i], packed.out[i], f"neighbour {i}")


@IMPLS
@SLOW
@given(data=st.data(), shape=attn_shapes)
def test_invariant_attention_continuous_batching(data, shape, impl):
    with kernel_impl(impl):
        _invariant_attention_continuous_batching(data, shape)


def _invariant_attention_continuous_batching(data, shape):
    """An engine-like random schedule: each step mixes decode tokens and prefill chunks of several
    sequences in random order, through shuffled blocks. Every sequence matches its solo prefill."""
    n = data.draw(st.integers(1, 5), label="sequences")
    seqs = [draw_seq(data, shape, 50, f"seq{i}") for i in range(n)]
    rng = random.Random(data.draw(st.integers(0, 10**6), label="schedule seed"))
    pool = list(range(sum(blocks_for(s.length) for s in seqs) + 4))
    rng.shuffle(pool)
    tables, used = [], 0
    for s in seqs:
        tables.append(pool[used : used + blocks_for(s.length)])
        used += blocks_for(s.length)
    gen = torch.Generator().manual_seed(2)
    solos = [solo_prefill(s, gen) for s in seqs]
    run = PagedRun(seqs, tables, gen, num_blocks=len(pool))
    done = [0] * n
    while any(d < s.length for d, s in zip(done, seqs)):
        active = [i for i in range(n) if done[i] < seqs[i].length and rng.random() < 0.8]
        if not active:
            continue
        rng.shuffle(active)
        chunks = []
        for i in active:
            size = 1 if rng.random() < 0.5 else rng.randint(1, 20)
            size = min(size, seqs[i].length - done[i])
            chunks.append((i, done[i], size))
            done[i] += size
        run.step(chunks)
    for i in range(n):
        assert_same(solos[i], run.out[i], f"sequence {i}")


def test_score_rows_follow_the_head_dim():
    """The attention-score GEMM's row tile is probed per head_dim (`invariant_attention.score_rows`). Negative
    control: where it is above 4, a 4-row fp32 GEMM really gives some score other bits than the
    same rows among more, which is what broke decode vs prefill at head_dim 128 with 4-row tiles."""
    from rzero.ops.invariant_attention import score_rows

    threads = torch.get_num_threads()
    tiles = {d: score_rows(d, threads) for d in (16, 32, 64, 128)}
    assert set(tiles.values()) <= {4, 8, 16}, tiles
    for d, tile in tiles.items():
        if tile > 4:
            gen = torch.Generator().manual_seed(d)
            q, k = torch.randn(tile, d, generator=gen), torch.randn(16, d, generator=gen)
            assert not torch.equal(q[:4] @ k.t(), (q @ k.t())[:4]), d


def test_standard_attention_prefill_vs_decode_differs():
    """Negative control: stock SDPA prefill and the matmul-softmax decode path disagree (fp32)."""
    diffs = []
    for seed, (group, kv_heads, head_dim, length) in enumerate([(2, 2, 64, 40), (4, 1, 32, 33), (1, 2, 16, 50)]):
        gen = torch.Generator().manual_seed(seed)
        seq = Seq(gen, length, group * kv_heads, kv_heads, head_dim, torch.float32)
        nx = ops.STANDARD
        full, dec = solo_prefill(seq, gen, nx=nx), decode_token_by_token(seq, gen, nx=nx)
        torch.testing.assert_close(full, dec, rtol=1e-4, atol=1e-5)  # same math, different bits
        diffs.append((full - dec).abs().max().item())
    assert max(diffs) > 0, f"stock attention happened to be prefill/decode invariant: {diffs}"


def test_standard_attention_matches_invariant_values():
    gen = torch.Generator().manual_seed(5)
    seqs = [Seq(gen, n, 4, 2, 32, torch.float32) for n in (7, 23, 40)]
    std = PagedRun(seqs, None, gen, nx=ops.STANDARD).prefill_all().out
    inv = PagedRun(seqs, None, gen, nx=ops.INVARIANT).prefill_all().out
    for a, b in zip(std, inv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_meta_rejects_bad_input():
    with pytest.raises(ValueError, match="same sequences"):
        AttentionMeta.build([1, 2], [0], [[0]], row_tile=1)
    with pytest.raises(ValueError, match="no query tokens"):
        AttentionMeta.build([0], [0], [[0]], row_tile=1)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMeta.build([ATTN_BLOCK + 1], [0], [[0]], row_tile=1)


def test_attention_meta_for_sequences_layout():
    nx = ops.INVARIANT
    meta, blocks = AttentionMeta.for_sequences([3, ATTN_BLOCK, ATTN_BLOCK + 1], row_tile=nx.row_tile)
    assert blocks == meta.num_blocks == 4
    assert meta.num_tokens == 3 + 2 * ATTN_BLOCK + 1
    assert meta.padded_tokens % nx.row_tile == 0 and meta.padded_tokens >= meta.num_tokens
    expected_positions = list(range(3)) + list(range(ATTN_BLOCK)) + list(range(ATTN_BLOCK + 1))
    assert meta.positions[: meta.num_tokens].tolist() == expected_positions
    assert meta.slot_mapping.tolist() == [0, 1, 2] + [ATTN_BLOCK + i for i in range(2 * ATTN_BLOCK + 1)]
    assert not meta.is_decode
    meta, _ = AttentionMeta.for_sequences([3, 5], row_tile=ops.STANDARD.row_tile)
    assert meta.padded_tokens == 8


def test_attention_meta_for_shared_prompts_layout():
    """A prompt of ATTN_BLOCK + 2 tokens with completions of 3, 0 and 2 tokens: the prompt and the
    first completion are one sequence; the empty completion adds none; the third shares the whole
    prompt block and gets a copy of the partial one."""
    P = ATTN_BLOCK + 2
    meta = AttentionMeta.for_shared_prompts([(P, [3, 0, 2]), (1, [1])], row_tile=1)
    assert meta.q_lens == [P + 3, 2, 2] and meta.ctx_lens == [0, P, 0]
    assert meta.block_tables.tolist() == [[0, 1], [0, 2], [3, 0]]
    assert meta.positions.tolist() == list(range(P + 3)) + [P, P + 1] + [0, 1]
    assert meta.copy_slots.tolist() == [2 * ATTN_BLOCK, 2 * ATTN_BLOCK + 1]
    assert meta.copy_rows.tolist() == [ATTN_BLOCK, ATTN_BLOCK + 1]  # the prompt's last two tokens
    assert meta.slot_mapping[P + 3 :].tolist() == [2 * ATTN_BLOCK + 2, 2 * ATTN_BLOCK + 3, 3 * ATTN_BLOCK, 3 * ATTN_BLOCK + 1]
    # One sample per prompt: exactly the whole-sequence layout, no copies.
    alone = AttentionMeta.for_shared_prompts([(3, [2]), (5, [ATTN_BLOCK])], row_tile=1)
    whole, _ = AttentionMeta.for_sequences([5, 5 + ATTN_BLOCK], row_tile=1)
    assert alone.copy_slots is None and alone.block_tables.tolist() == whole.block_tables.tolist()
    assert torch.equal(alone.slot_mapping, whole.slot_mapping)
    with pytest.raises(ValueError, match="at least one token"):
        AttentionMeta.for_shared_prompts([(0, [3])], row_tile=1)


# ---------------------------------------------------------------------------------------------
# 4. MoE routing and combine
# ---------------------------------------------------------------------------------------------


def test_moe_route_ties_break_toward_lower_expert():
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],  # three-way tie for first
            [2.0, 2.0, 2.0, 2.0, 2.0],  # all equal
            [0.5, 0.0, 4.0, 0.5, 0.5],  # tie for second place
            [-1.0, 7.0, -1.0, 7.0, -1.0],
        ]
    )
    nx = ops.INVARIANT
    weights, experts = nx.moe_route(logits, 2, normalize=True)
    raw_w, raw_e = nx.moe_route(logits, 3, normalize=False)
    assert experts.tolist() == [[1, 2], [0, 1], [2, 0], [1, 3]]
    assert raw_e.tolist() == [[1, 2, 4], [0, 1, 2], [2, 0, 3], [1, 3, 0]]
    assert weights.dtype == torch.float32
    assert torch.allclose(weights.sum(-1), torch.ones(4))
    assert weights[0].tolist() == [0.5, 0.5] and weights[1].tolist() == [0.5, 0.5]
    # Unnormalised weights are the softmax probabilities of the chosen experts.
    torch.testing.assert_close(raw_w, torch.softmax(logits, -1).gather(-1, raw_e))
    # A tie row keeps its choice whatever else is in the batch.
    nx = ops.INVARIANT
    for rows in (1, 3, 17, 40):
        gen = torch.Generator().manual_seed(rows)
        batch = embed_row(logits[0], rows, rows - 1, gen)
        assert nx.moe_route(batch, 2, True)[1][rows - 1].tolist() == [1, 2]


@FAST
@given(
    data=st.data(),
    num_experts=st.sampled_from([4, 8, 16, 64]),
    top_k=st.sampled_from([1, 2, 4]),
    normalize=st.booleans(),
    dtype=st.sampled_from(["fp32", "bf16"]),
)
def test_moe_route_is_batch_invariant(data, num_experts, top_k, normalize, dtype):
    rows, pos, gen = row_and_batch(data, 200)
    dt = DTYPES[dtype]
    # Coarse logits (multiples of 1/4) make exact ties common.
    row = (torch.randint(-8, 8, (num_experts,), generator=gen) / 4).to(dt)
    batch = (torch.randint(-8, 8, (rows, num_experts), generator=gen) / 4).to(dt)
    batch[pos] = row
    nx = ops.INVARIANT
    w1, e1 = nx.moe_route(row[None], top_k, normalize)
    wb, eb = nx.moe_route(batch, top_k, normalize)
    assert torch.equal(e1[0], eb[pos]) and torch.equal(w1[0], wb[pos])
    assert w1.dtype == torch.float32 and e1.shape == (1, top_k)
    assert len(set(e1[0].tolist())) == top_k
    # Chosen experts are the top-k by logit, ties to the lower id.
    order = sorted(range(num_experts), key=lambda e: (-float(row[e]), e))
    assert e1[0].tolist() == order[:top_k]
    assert (w1[0][:-1] >= w1[0][1:]).all()
    if normalize:
        assert abs(w1.sum().item() - 1.0) < 1e-6


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_combine_fixed_left_to_right_order(dtype):
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(7)
    outputs = randn(gen, 33, 4, 24, dtype=dt)
    weights = torch.softmax(randn(gen, 33, 4), -1)
    nx = ops.INVARIANT
    combined = nx.moe_combine(outputs, weights)
    alone = nx.moe_combine(outputs[5:6], weights[5:6])
    w = weights.to(dt)
    expected = outputs[:, 0] * w[:, :1]
    for slot in (1, 2, 3):
        expected = expected + outputs[:, slot] * w[:, slot : slot + 1]
    assert combined.dtype == dt and torch.equal(combined, expected)
    assert torch.equal(alone[0], combined[5])
    nx = ops.STANDARD
    torch.testing.assert_close(nx.moe_combine(outputs, weights).float(), combined.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# 5. the sampling transform and the sampler
# ---------------------------------------------------------------------------------------------

NEG_INF = float("-inf")


def kept(logprobs: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(logprobs)).flatten().tolist()


def test_transformed_logprobs_hand_example():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    plain = torch.log_softmax(logits, -1)
    # Identity transform and greedy (temperature 0 is scored under temperature 1).
    torch.testing.assert_close(INVARIANT.transformed_logprobs(logits, SamplingTransform()), plain)
    torch.testing.assert_close(INVARIANT.transformed_logprobs(logits, SamplingTransform(temperature=0.0)), plain)
    # Temperature divides the logits.
    torch.testing.assert_close(
        INVARIANT.transformed_logprobs(logits, SamplingTransform(temperature=2.0)), torch.log_softmax(logits / 2, -1)
    )
    # top-k keeps the k largest and renormalises.
    lp = INVARIANT.transformed_logprobs(logits, SamplingTransform(top_k=2))[0]
    assert kept(lp) == [0, 1]
    torch.testing.assert_close(lp[:2], torch.log_softmax(torch.tensor([2.0, 1.0]), -1))
    assert INVARIANT.transformed_logprobs(logits, SamplingTransform(top_k=5)).isfinite().all()  # k == V: no-op
    assert INVARIANT.transformed_logprobs(logits, SamplingTransform(top_k=50)).isfinite().all()  # k > V: no-op
    # top-k ties at the k-th value are all kept.
    assert kept(INVARIANT.transformed_logprobs(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), SamplingTransform(top_k=2))[0]) == [0, 1, 2]


def test_transformed_logprobs_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    # sorted: 0.5 (1), 0.3 (3), 0.15 (2), 0.05 (0); mass before: 0, 0.5, 0.8, 0.95
    assert kept(INVARIANT.transformed_logprobs(logits, SamplingTransform(top_p=0.4))[0]) == [1]
    assert kept(INVARIANT.transformed_logprobs(logits, SamplingTransform(top_p=0.6))[0]) == [1, 3]
    assert kept(INVARIANT.transformed_logprobs(logits, SamplingTransform(top_p=0.85))[0]) == [1, 2, 3]
    assert kept(INVARIANT.transformed_logprobs(logits, SamplingTransform(top_p=1.0))[0]) == [0, 1, 2, 3]
    assert kept(INVARIANT.transformed_logprobs(logits, SamplingTransform(top_p=1e-6))[0]) == [1]  # at least one
    lp = INVARIANT.transformed_logprobs(logits, SamplingTransform(top_p=0.6))[0]
    torch.testing.assert_close(lp[[1, 3]], torch.tensor([0.5 / 0.8, 0.3 / 0.8]).log())
    # Ties in probability go to the lower token id (stable sort).
    tie = torch.tensor([[0.3, 0.4, 0.3]]).log()
    assert kept(INVARIANT.transformed_logprobs(tie, SamplingTransform(top_p=0.6))[0]) == [0, 1]
    # Temperature first, then top-k, then top-p on the renormalised truncated distribution.
    logits2 = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    t = SamplingTransform(temperature=0.5, top_k=3, top_p=0.9)
    x = logits2 / 0.5
    p = torch.softmax(x[:, :3], -1)[0]  # top-3 of the tempered logits
    assert p[0] < 0.9 <= p[0] + p[1]
    lp = INVARIANT.transformed_logprobs(logits2, t)[0]
    assert kept(lp) == [0, 1]
    torch.testing.assert_close(lp[:2], torch.log_softmax(x[0, :2], -1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_p=-0.1), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be >= 0"),
    ],
)
def test_sampling_transform_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingTransform(**kwargs)


@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([2, 5, 50, 1024]),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.05]),
    dtype=st.sampled_from(["fp32", "bf16"]),
)
def test_transformed_logprobs_is_normalized_distribution(seed, vocab, temperature, top_k, top_p, dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = randn(gen, 6, vocab, dtype=DTYPES[dtype], scale=3.0)
    t = SamplingTransform(temperature=temperature, top_k=top_k, top_p=top_p)
    lp = INVARIANT.transformed_logprobs(logits, t)
    alone = INVARIANT.transformed_logprobs(logits[2:3], t)
    assert lp.dtype == torch.float32 and lp.shape == logits.shape
    assert torch.equal(alone[0], lp[2])  # the transform is per row, bit for bit
    assert not torch.isnan(lp).any() and (lp <= 1e-6).all()
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(6), rtol=0, atol=1e-5)
    n_kept = torch.isfinite(lp).sum(-1)
    assert (n_kept >= 1).all()
    if 0 < top_k < vocab:  # at most the k largest, plus any ties with the k-th value
        x = logits.float() / (temperature or 1.0)
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        assert (n_kept <= (x >= kth).sum(-1)).all()
    argmax = logits.float().argmax(-1)
    assert torch.isfinite(lp.gather(-1, argmax[:, None])).all()  # the mode is never truncated


def test_sample_tokens_depend_only_on_row_seed():
    gen = torch.Generator().manual_seed(11)
    vocab = 64
    target = torch.log_softmax(randn(gen, vocab), -1)
    tokens = []
    for rows, pos in [(1, 0), (2, 1), (5, 2), (9, 8)]:
        batch = torch.log_softmax(randn(gen, rows, vocab), -1)
        batch[pos] = target
        gens = [torch.Generator().manual_seed(1000 + r) for r in range(rows)]
        gens[pos] = torch.Generator().manual_seed(42)
        greedy = [r % 3 == 1 and r != pos for r in range(rows)]
        out = INVARIANT.sample_tokens(batch, greedy, gens)
        tokens.append(int(out[pos]))
        for r in range(rows):
            if greedy[r]:
                assert out[r] == batch[r].argmax()
    assert len(set(tokens)) == 1, tokens
    # A stream of draws from one seed is also reproducible.
    a = [int(INVARIANT.sample_tokens(target[None], [False], [g])[0]) for g in [torch.Generator().manual_seed(3)] * 20]
    b = [int(INVARIANT.sample_tokens(target[None], [False], [g])[0]) for g in [torch.Generator().manual_seed(3)] * 20]
    assert a == b and len(set(a)) > 1
    assert int(INVARIANT.sample_tokens(target[None], [True], [None])[0]) == int(target.argmax())


def test_a_uniform_stream_draws_its_generators_own_sequence():
    """UniformStream's blocks (torch.rand(n)) give the values of n successive torch.rand(1) calls,
    across block boundaries, so the engine's streams and replay's plain generators (one draw per
    token) choose the same tokens."""
    from rzero.ops.sampling import UniformStream

    count = 3 * UniformStream.BLOCK + 5
    one_by_one = torch.Generator().manual_seed(77)
    expected = [torch.rand(1, generator=one_by_one).item() for _ in range(count)]
    stream = UniformStream(torch.Generator().manual_seed(77))
    assert [stream.next() for _ in range(count)] == expected
    assert UniformStream(torch.Generator().manual_seed(78)).next() != expected[0]
    gen = torch.Generator().manual_seed(12)
    rows = torch.log_softmax(randn(gen, 4, 50), -1)
    plain = [torch.Generator().manual_seed(s) for s in range(4)]
    streams = [UniformStream(torch.Generator().manual_seed(s)) for s in range(4)]
    for _ in range(2 * UniformStream.BLOCK):
        assert torch.equal(INVARIANT.sample_tokens(rows, [False] * 4, plain), INVARIANT.sample_tokens(rows, [False] * 4, streams))


def test_the_samplers_kept_buffer_serves_inference_mode_and_plain_no_grad_alike():
    """The engine samples in inference mode and a replay outside it, on one thread: the kept
    buffers (rzero/ops/scratch.py) must take in-place writes in both, in either order."""
    from rzero.ops.scratch import scratch

    gen = torch.Generator().manual_seed(4)
    rows = torch.log_softmax(randn(gen, 3, 4096), -1)
    with torch.inference_mode():
        first = INVARIANT.sample_tokens(rows, [False] * 3, [torch.Generator().manual_seed(i) for i in range(3)])
    with torch.no_grad():
        again = INVARIANT.sample_tokens(rows, [False] * 3, [torch.Generator().manual_seed(i) for i in range(3)])
    assert torch.equal(first, again)
    with torch.inference_mode():
        buffer = scratch("test-kept", 8)
    buffer.fill_(1.0)  # outside inference mode: an inference tensor would refuse this
    assert scratch("test-kept", 4).sum().item() == 4.0


def test_first_max_is_argmax_with_ties_and_nan():
    """The sampler's max(dim).indices picks what torch.argmax picks: the first maximum, and a NaN
    as the maximum; on rows with many ties, large vocabularies and strided rows."""
    from rzero.ops.sampling import _first_max

    gen = torch.Generator().manual_seed(5)
    for vocab in (1, 7, 1024, 151936):
        x = torch.randint(0, 3, (9, vocab), generator=gen).float()  # ties everywhere
        x[2] = -torch.inf
        x[3, vocab // 2 :] = torch.nan
        x[4, torch.rand(vocab, generator=gen) < 0.01] = torch.nan
        for rows in (x, x[:, vocab // 3 :], x[::2]):
            assert torch.equal(_first_max(rows), rows.argmax(-1)), vocab


@pytest.mark.parametrize("vocab", [1000, 1024, 64 * 37, 32768, 151936])
def test_sampler_exp_in_row_chunks_gives_each_row_its_own_bits(vocab):
    """The sampler's exp runs on chunks of whole rows (sampling._row_chunks); every element must
    get the bits it gets when its row is exponentiated alone, at 1 and 2 threads."""
    from rzero.ops import sampling

    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (1, 3, 64, 129):
                x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
                x *= torch.linspace(0.01, 80, vocab)  # many binades, so that any change of exp kernel shows
                alone = x.clone()
                for r in range(rows):
                    alone[r].exp_()
                chunked = torch.empty_like(x)  # as the sampler does it: exp of each chunk into a buffer
                for chunk, out in zip(sampling._row_chunks(x), sampling._row_chunks(chunked)):
                    torch.exp(chunk, out=out)
                assert torch.equal(alone, chunked), f"vocab {vocab}, rows {rows}, threads {t}"
    finally:
        torch.set_num_threads(threads)


def test_inverse_cdf_edges_never_pick_a_truncated_token():
    """u = 0 picks the first token with mass, the largest float below 1 the last one with mass;
    tokens the transform truncated (logprob -inf) before, between and after are never picked; a
    row's token is the same alone and in a batch."""
    from rzero.ops.sampling import _inverse_cdf

    inf = float("-inf")
    lp = torch.log_softmax(torch.tensor([[inf, inf, 0.5, inf, 2.0, 1.0, inf, inf],
                                         [inf, 3.0, inf, inf, inf, inf, inf, inf]]), -1)
    largest_below_one = torch.tensor(1.0).nextafter(torch.tensor(0.0))
    for u, expected in [(0.0, [2, 1]), (float(largest_below_one), [5, 1]), (0.5, [4, 1])]:
        uniform = torch.full((2,), u)
        assert _inverse_cdf(lp, uniform).tolist() == expected, u
        assert [int(_inverse_cdf(lp[i : i + 1], uniform[i : i + 1])) for i in range(2)] == expected
    # Rows in groups (300 rows of 1024: two groups) draw what each row draws alone.
    rows = torch.log_softmax(torch.randn(300, 1024, generator=torch.Generator().manual_seed(1)) * 3, -1)
    uniform = torch.rand(300, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([_inverse_cdf(rows[i : i + 1], uniform[i : i + 1]) for i in range(300)])
    assert torch.equal(_inverse_cdf(rows, uniform), alone) and len(set(alone.tolist())) > 100
    # The cut points: the first token takes u < p0, the next u in [p0, p0 + p1), and so on.
    probs = lp[0].exp()
    first_cut = float(probs[2])
    assert _inverse_cdf(lp[:1], torch.tensor([first_cut * 0.999])).item() == 2
    assert _inverse_cdf(lp[:1], torch.tensor([first_cut * 1.001])).item() == 4


def test_sample_tokens_frequencies_match_distribution():
    """Empirical frequencies of the sampler match exp(logprobs) (chi-square, fixed seed);
    tokens masked by the transform are never drawn."""
    logits = torch.tensor([[1.5, 0.2, -0.3, 1.0, -2.0, 0.7, -5.0, 0.0]])
    lp = INVARIANT.transformed_logprobs(logits, SamplingTransform(temperature=0.9, top_k=6))
    probs = lp.exp()[0]
    n = 20000
    gen = torch.Generator().manual_seed(1234)
    draws = INVARIANT.sample_tokens(lp.expand(n, -1), [False] * n, [gen] * n)
    counts = torch.bincount(draws, minlength=8).double()
    allowed = torch.isfinite(lp[0])
    assert counts[~allowed].sum() == 0
    expected = probs.double()[allowed] * n
    chi2 = (((counts[allowed] - expected) ** 2) / expected).sum().item()
    dof = int(allowed.sum()) - 1
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5.
    assert chi2 < 30, f"chi2={chi2:.1f} dof={dof} counts={counts.tolist()} expected={expected.tolist()}"
    assert math.isclose(probs.sum().item(), 1.0, abs_tol=1e-6)


@SLOW
@given(data=st.data(), shape=attn_shapes, chunk_bytes=st.sampled_from([0, 1, 1 << 14, 1 << 23]))
def test_bucketed_attention_equals_one_padded_matmul(data, shape, chunk_bytes):
    """The no-grad path splits a mixed batch (decodes next to prefill chunks, short and long
    contexts) into buckets, cut further to CHUNK_BYTES of keys (1: one sequence per bucket); its
    bits equal those of one GEMM padded over the whole batch."""
    from rzero.ops import invariant_attention

    invariant_attention.CHUNK_BYTES, saved = chunk_bytes, invariant_attention.CHUNK_BYTES
    try:
        with kernel_impl("stock"):  # buckets are the stock-op path's (the C kernel needs none)
            _bucketed_equals_single(data, shape)
    finally:
        invariant_attention.CHUNK_BYTES = saved


def _bucketed_equals_single(data, shape):
    from rzero.ops import invariant_attention

    seqs = [draw_seq(data, shape, 60, f"seq{i}") for i in range(data.draw(st.integers(2, 6), label="sequences"))]
    chunks = []
    for i, s in enumerate(seqs):
        start = data.draw(st.integers(0, s.length - 1), label=f"start{i}")
        chunks.append((i, start, data.draw(st.integers(1, s.length - start), label=f"len{i}")))
    run = PagedRun(seqs, None, torch.Generator().manual_seed(2))
    tables = [run.tables[i][: blocks_for(start + n)] for i, start, n in chunks]
    meta = AttentionMeta.build(
        [n for _, _, n in chunks], [start for _, start, _ in chunks], tables, row_tile=INVARIANT.row_tile
    )
    q = torch.cat([seqs[i].q[s : s + n] for i, s, n in chunks])
    nx = INVARIANT
    bucketed = nx.attention(q, run.k_cache, run.v_cache, meta, run.scale)
    single = invariant_attention._attention_rows(q, run.k_cache, run.v_cache, meta, run.scale)
    assert torch.equal(bucketed[: meta.num_tokens], single[: meta.num_tokens])


def test_mixed_decode_and_prefill_batch_is_split_into_buckets():
    from rzero.ops import invariant_attention

    gen = torch.Generator().manual_seed(3)
    seqs = [Seq(gen, 60, 4, 2, 32, torch.float32), Seq(gen, 20, 4, 2, 32, torch.float32)]
    run = PagedRun(seqs, None, gen)
    chunks = [(0, 59, 1), (1, 0, 20)]  # a decode at position 59 next to a 20-token prefill
    meta = AttentionMeta.build([1, 20], [59, 0], [run.tables[0], run.tables[1]], row_tile=INVARIANT.row_tile)
    q = torch.cat([seqs[i].q[s : s + n] for i, s, n in chunks])
    nx = INVARIANT
    assert len(invariant_attention._buckets(meta, key_bytes=2 * 32 * 4)) == 2
    with kernel_impl("stock"):
        bucketed = nx.attention(q, run.k_cache, run.v_cache, meta, run.scale)
    single = invariant_attention._attention_rows(q, run.k_cache, run.v_cache, meta, run.scale)
    assert torch.equal(bucketed[:21], single[:21])


def test_big_tiles_only_where_the_probe_proves_the_bits(monkeypatch):
    """A big tile, or one GEMM of a whole row count (`whole_rows`), is used only if it gives every
    row a ROW_TILE tile's bits. Negative control: a big-tile GEMM that sums K in two halves
    (another grouping) is caught and never used, and the linear still gives the 16-row tiles' bits."""
    K, N = 128, 64
    x, weight = grouping_probe(300, K, N, seed=3)
    dtypes = (torch.bfloat16, torch.float32)
    reference = {d: torch.cat([INVARIANT.linear(t, weight.to(d)) for t in x.to(d).split(16)]) for d in dtypes}
    threads = torch.get_num_threads()

    def two_halves(a, wt, out):
        torch.add(a[:, : K // 2] @ wt[: K // 2], a[:, K // 2 :] @ wt[K // 2 :], out=out)

    def clear():
        invariant.big_tiles.cache_clear()
        invariant.whole_rows.cache_clear()

    monkeypatch.setattr(invariant.cpu_layer, "own_gemm", lambda *args: None)  # the tiles, not rzero's GEMMs
    clear()
    try:
        for d in dtypes:
            assert torch.equal(INVARIANT.linear(x.to(d), weight.to(d)), reference[d])
        assert invariant.whole_rows(304, K, N, torch.float32, False, threads)  # 300 rows padded to 304: one GEMM
        monkeypatch.setattr(invariant, "_big_tile_mm", two_halves)
        clear()
        assert invariant.big_tiles(K, N, torch.bfloat16, True, threads) == ()
        assert not invariant.whole_rows(304, K, N, torch.float32, False, threads)
        for d in dtypes:
            assert torch.equal(INVARIANT.linear(x.to(d), weight.to(d)), reference[d])
    finally:
        clear()
