"""Batch-invariant kernels for the CPU, built from stock PyTorch calls on fixed shapes.

Why each is invariant (tests/test_ops.py checks every claim on this machine):

- matmul: the CPU GEMM's kernel and its K blocking depend on the row count M and the thread
  count (on AMX machines a bf16 row's bits differ between M = 96 and M = 128, and for K = 3072
  between 1 and 2 threads). We cut the rows into tiles of exactly ROW_TILE and run one batched
  GEMM over the tiles with a broadcast weight: every tile is the same (ROW_TILE, K) x (K, N)
  problem, whatever the batch, so a row's bits do not depend on M or on its neighbours.
  tests/test_ops.py probes this with inputs whose fp32 sums expose any change of grouping. bf16
  tiles run on a row-major weight copy, in bmm chunks or one mm per tile: the same problem and
  bits (tests/test_linear_layout.py), much faster. Many rows (prefill, training) go in bigger
  tiles of 64-1024 rows where a grouping probe run once per weight shape, dtype and thread count
  proves they give a 16-row tile's bits (`big_tiles`), or, on small weights, in one GEMM of all
  the rows where that probe at exactly this row count proves it (`whole_rows`). Decode-size
  inputs on bf16 weights with K >= 1024 run on a oneDNN-prepacked weight where a probe proves the
  same bits (`prepack_proven`).
  The backward is plain (F.linear's math). On Intel CPUs without AMX a bf16 linear runs on the
  fp32 GEMM, the bf16 values widened (`bf16_gemm`; AMD CPUs with avx512_bf16 keep the bf16 GEMM):
  below PANEL_MIN weight elements all of the above on the widened weight, from it one bmm over
  512-column panels, whose batched GEMMs run one per thread (every thread count's bits). With
  avx512_bf16 and no AMX, bf16 weights below KERNEL_MAX elements run our own GEMM
  (rzero/ops/cpu_kernel.py, `bf16_kernel`): one fixed order per output, no tiles or probes.
The row and elementwise ops live in rzero/ops/invariant_rows.py (its docstring says why each is
invariant), attention in rzero/ops/invariant_attention.py; this module holds the linear layers
and is the numerics' one namespace (it re-exports them)."""

from __future__ import annotations

import functools

import torch

from rzero.ops import cpu_layer, weight_copies
from rzero.ops.gemm_route import BF16_GEMMS, KERNEL_MAX, bf16_gemm, bf16_kernel, on_kernel  # noqa: F401  (the rules this linear applies)
from rzero.ops.scratch import scratch
from rzero.ops.cpu_layer import decoder_layer  # noqa: F401  (an engine step's dense layer in one C call)
from rzero.ops.cpu_stack import decode_steps, decoder_stack  # noqa: F401  (an engine step's backbone, or several decode steps, in one C call)
from rzero.ops.train_layer import attention_block as train_attention, mlp_block as train_mlp  # noqa: F401  (one node each)
from rzero.ops.invariant_attention import attention, cached_attention  # noqa: F401  (ops of this numerics)
from rzero.ops.invariant_rows import (  # noqa: F401
    ROW_TILE,
    apply_rotary,
    log_softmax,
    moe_combine,
    moe_route,
    rms_norm,
    silu_mul,
    softmax,
)

# From this many weight elements on, a contiguous (bf16) weight is multiplied tile by tile with mm
# rather than by bmm (measured on one thread: bmm wins at 128 x 512, mm from 128 x 1024 on); below
# it, bmm runs at most BMM_CHUNK tiles per call. Every path gives the same bits (tests probe each).
TILE_LOOP_MIN = 1 << 17
BMM_CHUNK = 32
# Row tiles for many rows, each kept only where a probe proves it gives ROW_TILE's bits (big_tiles).
BIG_TILES = (1024, 512, 256, 128, 64)  # largest first
# Up to this many multiply-adds (rows x K x N) a row count gets its own probe (`whole_rows`): 416
# rows on a tiny model's weights in one GEMM, not 256 + 128 + 64 padded rows (~1.3x faster here).
WHOLE_PROBE_MAX = 1 << 27
# A tile padded with zero rows is worth one GEMM call saved while its padding costs at most this
# many multiply-adds (~2 MFLOP: about a call's fixed cost at this CPU's GEMM rate).
PAD_ELEMENTS = 1 << 20
# Decode batches on bf16 weights with K >= PREPACK_MIN_K (a 0.6B model's, not the tiny presets'):
# each 16-row tile's mm repacks the whole weight for AMX, while oneDNN's prepacked linear packs it
# once per weight version and runs the same (16, K) x (K, N) problem about 2x faster. It is used
# for a weight shape only where a grouping probe proves it gives the mm tiles' bits (on this
# machine: K = 1024, not K = 2048 or 3072), and only where no gradient is wanted.
PREPACK_MIN_K = 1024


# Large bf16 weights on the fp32 route (from PANEL_MIN elements: a 0.6B model's, none of the tiny
# presets') are multiplied in column panels of PANEL_COLUMNS by one bmm over the panels. A batched
# GEMM runs each panel on one thread, so a row gets the bits of a one-thread (rows, K) x (K, 512)
# GEMM whatever the thread count, and up to PANEL_ROWS rows per call give every row the bits of a
# 16-row tile (probed: tests/test_linear_layout.py, over row counts and thread counts). At the
# 0.6B shape's decode (64 rows, 2 threads) this took 0.4-0.6x the oneDNN-prepacked bf16 GEMM's
# time (docs/benchmarks.md, seventh session), where the fp32 (N, K) route's 16-row tiles were slower
# than bf16: on two threads it proves no tile below 256 rows.
PANEL_MIN = 1 << 20
PANEL_COLUMNS = 512
PANEL_ROWS = 128


# (rows, weight shape, strides, dtype, may_prepack, threads, bf16 route) -> one mm holds them?
# From the probes' results: each probe empties it when it runs anew (caches cleared).
_ONE_MM: dict[tuple, bool] = {}


def _fp32_route(weight: torch.Tensor) -> bool:
    """Whether this bf16 weight's linear runs on the fp32 GEMM (the machine's rule, for all)."""
    return weight.dtype == torch.bfloat16 and bf16_gemm() == "fp32"


def gemm_operand(weight: torch.Tensor) -> torch.Tensor:
    """The (K, N) right-hand side `linear` multiplies by. bf16: row-major (K, N), copied if the weight
    is not stored that way (`Qwen3ForCausalLM.pack_weights` stores it so): same bits as the
    transposed (N, K) view (tests/test_ops.py probes it), 5-40x faster. fp32 keeps the transposed
    view: there a row-major operand changes the bits at K = 1024."""
    wt = weight.t()
    return wt.contiguous() if weight.dtype == torch.bfloat16 else wt


def grouping_probe(rows: int, K: int, N: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (rows, K), weight (N, K)), bf16, whose products are 0, ±1 or ±2^24: an fp32 sum of them
    depends on how the GEMM groups its K terms ((2^24 + 1) - 2^24 = 0 but (2^24 - 2^24) + 1 = 1),
    so a change of kernel or K blocking shows in the output instead of hiding below the rounding."""
    gen = torch.Generator().manual_seed(seed)

    def side(n: int) -> torch.Tensor:
        big = torch.rand(n, K, generator=gen) < 0.05
        sign = torch.where(torch.rand(n, K, generator=gen) < 0.5, 1.0, -1.0)
        ones = (torch.rand(n, K, generator=gen) < 0.5).float()
        return torch.where(big, 4096.0 * sign, ones).bfloat16()

    return side(rows), side(N)


def _small_tiles(x2: torch.Tensor, wt: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x2 @ wt in ROW_TILE-row tiles (x2's rows: a multiple of ROW_TILE), into `out` if given."""
    n_tiles, n = x2.shape[0] // ROW_TILE, wt.shape[1]
    if wt.is_contiguous() and n_tiles == 1:  # bf16 decode: mm is a bmm tile's problem, a little faster
        return torch.mm(x2, wt, out=out)
    if wt.is_contiguous() and wt.numel() >= TILE_LOOP_MIN:
        # Large bf16 weights: one mm per 16-row tile is the same (16, K) x (K, N) problem as a bmm
        # tile (same bits, probed), and the bmm's bf16 path is far slower at these sizes.
        out = x2.new_empty(x2.shape[0], n) if out is None else out
        for tile, dest in zip(x2.split(ROW_TILE), out.split(ROW_TILE)):
            torch.mm(tile, wt, out=dest)
        return out
    if n_tiles == 1 and torch.get_num_threads() > 1:
        # One fp32 tile on several threads: MKL splits that one GEMM across the threads and (from
        # K = 1024 on) gets other bits than for the same tile among others, which it runs on one
        # thread each. A zero tile beside it makes it one among two: the bits of every batch and
        # of one thread (tests/test_linear_layout.py), for twice the work of a <= 16-row input.
        pair = torch.cat((x2, torch.zeros_like(x2)))
        result = _small_tiles(pair, wt)[:ROW_TILE]
        return result if out is None else out.copy_(result)
    tiles = x2.view(n_tiles, ROW_TILE, -1)
    if wt.is_contiguous() and n_tiles > BMM_CHUNK:
        # Many bf16 tiles: bmm's cost per tile grows past a few dozen tiles; chunks keep it flat.
        # (Not fp32: on 2 threads a one-tile fp32 bmm gets other bits at K >= 1024.)
        out = x2.new_empty(x2.shape[0], n) if out is None else out
        for chunk, dest in zip(tiles.split(BMM_CHUNK), out.split(BMM_CHUNK * ROW_TILE)):
            torch.bmm(chunk, wt.expand(chunk.shape[0], *wt.shape), out=dest.view(chunk.shape[0], ROW_TILE, n))
        return out
    dest = None if out is None else out.view(n_tiles, ROW_TILE, n)
    return torch.bmm(tiles, wt.expand(n_tiles, *wt.shape), out=dest).view(-1, n)


def _big_tile_mm(x: torch.Tensor, wt: torch.Tensor, out: torch.Tensor) -> None:
    """The big-tile GEMM, one name for the probe and the forward (a test swaps it for another grouping)."""
    torch.mm(x, wt, out=out)


def _proven_sizes(sizes: tuple[int, ...], K: int, N: int, dtype: torch.dtype, row_major: bool, seed: int) -> tuple[int, ...]:
    """The row counts among `sizes` for which one GEMM (`_big_tile_mm`) gives every row exactly a
    ROW_TILE tile's bits on a grouping probe, for a (K, N) weight in this dtype and layout."""
    _ONE_MM.clear()
    x, weight = grouping_probe(max(sizes), K, N, seed=seed)
    x, weight = x.to(dtype), weight.to(dtype)
    wt = weight.t().contiguous() if row_major else weight.t()
    reference = _small_tiles(x, wt)
    kept = []
    for size in sizes:
        got = x.new_empty(size, N)
        _big_tile_mm(x[:size], wt, got)
        if torch.equal(got, reference[:size]):
            kept.append(size)
    return tuple(kept)


@functools.lru_cache(maxsize=None)
def big_tiles(K: int, N: int, dtype: torch.dtype, row_major: bool, threads: int) -> tuple[int, ...]:
    """The tile sizes of BIG_TILES that this machine's GEMM proves, for a (K, N) weight in this
    dtype and layout on this many threads, to give every row exactly a ROW_TILE tile's bits.

    The GEMM's kernel and K blocking follow the row count, so most sizes are not safe, but some
    are, and at 64-1024 rows per call a prefill or a training batch runs at up to the stock GEMM's
    speed instead of paying a weight repack per 16 rows. The proof is a grouping probe: inputs
    whose every fp32 sum changes if the K terms are grouped differently. A size is kept only if
    all its rows (every position in the tile) match the ROW_TILE tiles bit for bit."""
    return _proven_sizes(BIG_TILES, K, N, dtype, row_major, seed=K * 7919 + N)


@functools.lru_cache(maxsize=None)
def whole_rows(rows: int, K: int, N: int, dtype: torch.dtype, row_major: bool, threads: int) -> bool:
    """Whether one GEMM of exactly `rows` rows (a multiple of ROW_TILE, at most WHOLE_PROBE_MAX
    multiply-adds) gives every row a ROW_TILE tile's bits: `big_tiles`' probe at that row count."""
    return _proven_sizes((rows,), K, N, dtype, row_major, seed=K * 7919 + N + rows) == (rows,)


def _row_plan(total: int, wt: torch.Tensor, prepack: bool) -> tuple[tuple[tuple[int, int], ...], int]:
    """`_tile_plan` for `total` rows (a multiple of ROW_TILE) on the GEMM operand wt: one tile of
    every row where `whole_rows` proves it (not for prepacked decode batches: their own path)."""
    K, N = wt.shape
    threads = torch.get_num_threads()
    if not prepack and 0 < total * K * N <= WHOLE_PROBE_MAX and whole_rows(total, K, N, wt.dtype, wt.is_contiguous(), threads):
        return ((0, total),), total
    return _tile_plan(total, big_tiles(K, N, wt.dtype, wt.is_contiguous(), threads), prepack, K * N)


def _onednn_tile(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@functools.lru_cache(maxsize=None)
def prepack_proven(K: int, N: int, threads: int) -> bool:
    """Whether oneDNN's prepacked bf16 linear gives a (K, N) weight's 16-row tiles exactly the mm
    tiles' bits on this many threads (the grouping probe of `big_tiles`, run once per shape)."""
    _ONE_MM.clear()
    if not torch.backends.mkldnn.is_available():
        return False
    x, weight = grouping_probe(4 * ROW_TILE, K, N, seed=K * 7907 + N)
    reference = _small_tiles(x, weight.t().contiguous())
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, ROW_TILE)
    return torch.equal(torch.cat([_onednn_tile(t, packed) for t in x.split(ROW_TILE)]), reference)


def _prepack_pays(wt: torch.Tensor) -> bool:
    """A large bf16 GEMM operand whose shape the probe proved for the prepacked linear."""
    return wt.dtype == torch.bfloat16 and wt.shape[0] >= PREPACK_MIN_K and prepack_proven(*wt.shape, torch.get_num_threads())


def _panel_linear(x2: torch.Tensor, weight: torch.Tensor, may_cache: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2 (rows, K) bf16 times a large bf16 weight on the fp32 GEMM, in column panels (PANEL_MIN):
    (the bf16 result (rows, N), the widened rows, the panels)."""
    panels = weight_copies.panels(weight, may_cache, PANEL_COLUMNS)
    count, k, width = panels.shape
    rows = x2.shape[0]
    total = -(-rows // ROW_TILE) * ROW_TILE
    xp = _operand_rows(x2, total, torch.float32)
    result = torch.empty(total, count * width, dtype=torch.bfloat16)
    part_buffer = scratch("panels", count * min(total, PANEL_ROWS) * width)  # rzero/ops/scratch.py
    for start in range(0, total, PANEL_ROWS):
        tile = xp[start : start + PANEL_ROWS]
        n = tile.shape[0]
        part = part_buffer[: count * n * width].view(count, n, width)
        torch.bmm(tile.expand(count, n, k), panels, out=part)
        result[start : start + n].view(n, count, width).copy_(part.transpose(0, 1))  # rounded, in row order
    return result[:rows, : weight.shape[0]], xp[:rows], panels


@functools.lru_cache(maxsize=4096)  # every decode step asks again for the same row count and weight
def _tile_plan(total: int, proven: tuple[int, ...], keep_whole: bool, row_elements: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """How `total` rows (a multiple of ROW_TILE) are cut: big proven tiles (start, size), largest
    first, and the row from which the rest goes in ROW_TILE tiles. Leftover rows (more than one
    ROW_TILE) go in one proven tile padded with zero rows where the padding costs less than a GEMM
    call's fixed cost (~20 us per bf16 oneDNN call here), which dominates small shapes: at most
    PAD_ELEMENTS multiply-adds (`row_elements` = K * N per row) and at most as many rows as it
    fills. Such a last tile ends past `total`. (Padding 560 training rows to 1024 made the tiny
    model's forward GEMMs 1.8x the work: docs/benchmarks.md, ninth session.) `keep_whole`: an input
    that would be one padded tile stays whole (the prepacked decode path takes it)."""
    tiles, start = [], 0
    most_padding = max(ROW_TILE, PAD_ELEMENTS // max(row_elements, 1))
    for size in proven:
        end = start + (total - start) // size * size
        tiles.extend((s, size) for s in range(start, end, size))
        start, left = end, total - end
        padding = size - left
        if ROW_TILE < left and 0 < padding <= min(left, most_padding) and left not in proven and not (start == 0 and keep_whole):
            tiles.append((start, size))
            return tuple(tiles), start + size
    return tuple(tiles), start


def _operand_rows(x2: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """x2's rows in `dtype`, zero rows appended up to `length`: one copy (none if x2 already is that)."""
    rows = x2.shape[0]
    if rows == length:
        x2 = x2 if x2.dtype == dtype else x2.to(dtype)
        return x2 if x2.is_contiguous() else x2.contiguous()
    if 2 * rows <= length:  # mostly padding (a few rows of an MoE expert): one zero fill is fewer ops
        out = x2.new_zeros(length, x2.shape[1], dtype=dtype)
        out[:rows] = x2
        return out
    out = x2.new_empty(length, x2.shape[1], dtype=dtype)
    out[:rows] = x2
    out[rows:].zero_()  # only the padding: on a prefill a whole-buffer fill costs as much as the copy
    return out


def _linear_forward(
    x: torch.Tensor, weight: torch.Tensor, may_prepack: bool = False, operands: list | None = None
) -> torch.Tensor:
    """`may_prepack`: no gradient is wanted (the engine, scoring), so decode-size inputs may use a
    prepacked copy of the weight, and the fp32 route may keep its widened weight; a weight in
    training changes every step and is never packed. `operands`, if given, receives x's rows and
    the (N, K) weight as multiplied (widened on the fp32 route), for the backward to reuse."""
    flat = x.dim() == 2  # the usual case: no reshapes (each costs about a microsecond)
    x2 = x if flat else x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    out = cpu_layer.own_gemm(x2, weight, may_prepack)  # small weights on rzero's own GEMMs, where they apply
    if out is not None:
        if operands is not None:
            operands.extend((x2, weight))
        return out if flat else out.view(*x.shape[:-1], weight.shape[0])
    if operands is None and rows % ROW_TILE == 0 and x2.dtype == weight.dtype and x2.is_contiguous():
        # The decode steps ask the same question every step: whether one plain mm holds every row.
        key = (rows, weight.shape, weight.stride(), weight.dtype, may_prepack, torch.get_num_threads(), bf16_gemm())
        whole = _ONE_MM.get(key)
        if whole is None:
            whole = _ONE_MM[key] = _one_mm_holds(rows, weight, may_prepack)
        if whole:
            return torch.mm(x2, gemm_operand(weight)).view(*x.shape[:-1], weight.shape[0])
    fp32_route = _fp32_route(weight)
    if x.dtype != weight.dtype and not fp32_route:
        raise TypeError(f"invariant linear: input {x.dtype} and weight {weight.dtype} must be of one dtype")
    if fp32_route and weight.numel() >= PANEL_MIN:
        out, rows, panels = _panel_linear(x.reshape(-1, x.shape[-1]), weight, may_prepack)
        if operands is not None:
            operands.extend((rows, panels))
        return out.reshape(*x.shape[:-1], weight.shape[0])
    # The fp32 route multiplies the bf16 values widened exactly to fp32 (see bf16_gemm).
    gemm_weight = weight_copies.widened(weight, may_prepack) if fp32_route else weight
    total = -(-rows // ROW_TILE) * ROW_TILE
    wt = gemm_operand(gemm_weight)
    prepack = may_prepack and _prepack_pays(wt)
    tiles, start = _row_plan(total, wt, prepack)
    length = max(total, start)
    if x2.dtype == wt.dtype and x2.is_contiguous() and rows == total:
        xp = x2  # used in place; a padded last tile gets its own copy below
    else:
        xp = _operand_rows(x2, length, wt.dtype)  # widened and padded in the one copy needed anyway
    if tiles == ((0, total),) and xp.shape[0] == total and operands is None:
        # One proven tile holds every row (a decode batch, a short prefill): one plain mm.
        result = torch.mm(xp, wt)[:rows].reshape(*x.shape[:-1], weight.shape[0])
        return result.to(torch.bfloat16) if fp32_route else result
    out = xp.new_empty(length, wt.shape[1])
    # Bulk rows in the largest proven tiles (one mm each): every row gets a ROW_TILE tile's bits
    # whichever tile it lands in.
    for s, size in tiles:
        tile = xp[s : s + size]
        if tile.shape[0] < size:  # the last tile reaches past the rows: zero rows after them
            tile = _operand_rows(tile, size, wt.dtype)
        _big_tile_mm(tile, wt, out[s : s + size])
    if start < total:
        packed = weight_copies.prepacked(weight, ROW_TILE) if start == 0 and prepack else None
        if packed is not None:  # decode batches on large bf16 weights (see PREPACK_MIN_K)
            out = torch.cat([_onednn_tile(t, packed) for t in xp.split(ROW_TILE)])
        else:
            _small_tiles(xp[start:total], wt, out[start:total])
    if operands is not None:  # the widened rows on the fp32 route, else x itself (no padded copy kept)
        operands.extend((x2 if not fp32_route else xp if xp.shape[0] == rows else xp[:rows], gemm_weight))
    result = out[:rows].reshape(*x.shape[:-1], weight.shape[0])
    return result.to(torch.bfloat16) if fp32_route else result


def _one_mm_holds(rows: int, weight: torch.Tensor, may_prepack: bool) -> bool:
    """Whether `_linear_forward` of `rows` rows (a multiple of ROW_TILE, contiguous, in the
    weight's dtype) runs as one plain mm on gemm_operand(weight): the full path's decision."""
    if _fp32_route(weight):
        return False
    wt = gemm_operand(weight)
    tiles, _ = _row_plan(rows, wt, may_prepack and _prepack_pays(wt))
    return tiles == ((0, rows),)


class _Linear(torch.autograd.Function):
    """Invariant forward; plain backward (`linear_backward`): only the forward has to match the
    engine bit for bit (as for attention), the gradients just have to be right."""

    @staticmethod
    def forward(ctx, x, weight):
        operands: list[torch.Tensor] = []
        out = _linear_forward(x, weight, operands=operands)
        ctx.save_for_backward(*operands)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x2, w = ctx.saved_tensors
        grad_x, grad_w = linear_backward(x2, w, grad, ctx.x_dtype, ctx.w_dtype, *ctx.needs_input_grad)
        return (None if grad_x is None else grad_x.view(ctx.x_shape)), grad_w


def linear_backward(
    x2: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, x_dtype: torch.dtype, w_dtype: torch.dtype,
    want_x: bool, want_w: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input's (rows, K) and the weight's gradients of a linear whose forward multiplied x2
    (rows, K) by w ((N, K) or its column panels), for the output's gradient `grad` (..., N): two
    whole-batch GEMMs (like F.linear's) on the forward's operands (on the fp32 route the widened
    copies: the faster GEMM here, and no second widening)."""
    out_features = grad.shape[-1]
    if w.dim() == 3:  # panels (C, K, P) back to the (N, K) weight: the plain GEMM's operand
        w = w.transpose(1, 2).reshape(-1, w.shape[1])[:out_features]
    grad2 = grad.reshape(-1, out_features).to(w.dtype)
    grad_x = torch.mm(grad2, w).to(x_dtype) if want_x else None
    grad_w = torch.mm(grad2.t(), x2).to(w_dtype) if want_w else None
    return grad_x, grad_w


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Linear.apply(x, weight)
    return _linear_forward(x, weight, may_prepack=True)
