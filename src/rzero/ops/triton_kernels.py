"""Triton kernels with a fixed reduction order: the `invariant` numerics on CUDA.

cuBLAS and the stock CUDA reductions pick their kernel, tiling and split-K from the problem's
shape, so a row's bits depend on how many rows share the call. Each kernel here reduces every
output element in an order that depends only on constants fixed per dtype, never on the row
count, the row's position or its neighbours:

- matmul: fixed BLOCK_M x BLOCK_N x BLOCK_K tiles chosen by dtype alone, each output tile
  accumulated over K left to right in one program (no split-K); a row's dot products are the
  same MMA sequence whatever M is. (A persistent schedule would change only which program
  computes a tile, not how; it is left for tuning on a GPU.)
- rms_norm: one program per row, the whole row in one block of a width fixed by the hidden size.
- softmax / log_softmax: one program per row, the row walked in fixed chunks left to right (a
  vocabulary row does not fit one block); the sum is a lane-wise accumulation then one tree.
- attention: one program per (sequence, query tile of Q_TILE rows, head), KV blocks of
  ATTN_BLOCK visited left to right from position 0 with an online softmax. A block wholly past
  a query's position adds exact zeros (max unchanged, rescale by exp(0) = 1), so a query runs
  the same arithmetic in a decode step, in a prefill and in any chunk of a chunked prefill.

Runs on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (the tests). Imported lazily:
rzero never needs triton on the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rzero.ops.attention_meta import ATTN_BLOCK, AttentionMeta

ATTN_Q_TILE = 16  # query rows per attention program: the smallest tl.dot M on tensor cores
SOFTMAX_CHUNK = 1024  # columns a softmax program reads per step


def _matmul_tiles(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a dtype: never a function of M."""
    if dtype == torch.float32:
        return 64, 64, 32, 4, 3
    return 128, 128, 64, 8, 3


@triton.jit
def _matmul_kernel(
    a_ptr, w_ptr, c_ptr, M, N, K: tl.constexpr,
    stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # C = A @ W.T with A (M, K), W (N, K); fp32 accumulation, IEEE fp32 products (no TF32).
    # One program per output tile, its K loop left to right. K is a compile-time constant (one
    # per weight shape): the interpreter cannot range over a runtime value with numpy >= 2.4.
    # int64 offsets: rows x vocabulary (LM head) passes 2^31 elements at about 14k rows.
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, c,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def matmul(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x @ weight.T over the last dim of x. `tiles`: (BLOCK_M, BLOCK_N, BLOCK_K) for the tests;
    default the dtype's fixed tiles."""
    if x.dtype != weight.dtype:
        raise ValueError(f"matmul: x is {x.dtype} but weight is {weight.dtype}")
    a = x.reshape(-1, x.shape[-1])
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = _matmul_tiles(x.dtype)
    if tiles is not None:
        bm, bn, bk = tiles
    if m:
        _matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            a, weight, out, m, n, k, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1),
            out.stride(0), out.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
        )
    return out.reshape(*x.shape[:-1], n)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    # Round the normalised row to the model dtype before the weight, as the reference does.
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        n = x2.shape[1]
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, n, x2.stride(0), out.stride(0), eps,
                                         BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N: tl.constexpr, stride_x, stride_out, LOG: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows x vocabulary can pass 2^31
    x_row, out_row = x_ptr + row * stride_x, out_ptr + row * stride_out
    offs = tl.arange(0, CHUNK)
    # Max: exact, so only its result matters; lane-wise over the chunks, then across lanes.
    m_lanes = tl.full((CHUNK,), float("-inf"), tl.float32)
    for start in range(0, N, CHUNK):
        x = tl.load(x_row + start + offs, mask=start + offs < N, other=float("-inf")).to(tl.float32)
        m_lanes = tl.maximum(m_lanes, x)
    m = tl.max(m_lanes, axis=0)
    # Sum of exp: each lane adds its chunks left to right, then one fixed tree over the lanes.
    s_lanes = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, N, CHUNK):
        x = tl.load(x_row + start + offs, mask=start + offs < N, other=float("-inf")).to(tl.float32)
        s_lanes += tl.exp(x - m)
    s = tl.sum(s_lanes, axis=0)
    log_s = tl.log(s)
    for start in range(0, N, CHUNK):
        x = tl.load(x_row + start + offs, mask=start + offs < N, other=float("-inf")).to(tl.float32)
        if LOG:
            y = x - m - log_s
        else:
            y = tl.exp(x - m) / s
        tl.store(out_row + start + offs, y, mask=start + offs < N)


def _row_softmax(x: torch.Tensor, log: bool, chunk: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _softmax_kernel[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), out.stride(0), LOG=log, CHUNK=chunk)
    return out.view(x.shape)


def log_softmax(x: torch.Tensor, chunk: int = SOFTMAX_CHUNK) -> torch.Tensor:
    """log_softmax over the last dim, fp32 out."""
    return _row_softmax(x, True, chunk)


def softmax(x: torch.Tensor, chunk: int = SOFTMAX_CHUNK) -> torch.Tensor:
    """softmax over the last dim, fp32 out."""
    return _row_softmax(x, False, chunk)


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, tables_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_table, scale, tiles_per_seq, group,
    HEAD_DIM: tl.constexpr, Q_TILE: tl.constexpr, BLOCK: tl.constexpr,
):
    seq = tl.program_id(0) // tiles_per_seq
    tile = tl.program_id(0) % tiles_per_seq
    head = tl.program_id(1)
    kv_head = head // group
    q_len = tl.load(q_len_ptr + seq)
    ctx = tl.load(ctx_len_ptr + seq)
    rows = tile * Q_TILE + tl.arange(0, Q_TILE)  # query index within the sequence's chunk
    row_ok = rows < q_len
    pos = ctx + rows  # absolute position of each query
    dims = tl.arange(0, HEAD_DIM)
    token = (tl.load(q_start_ptr + seq) + rows).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    # Keys up to the tile's last real query; a tile past the sequence's queries visits none.
    last = tl.minimum(q_len, (tile + 1) * Q_TILE)
    n_blocks = tl.where(tile * Q_TILE < q_len, tl.cdiv(ctx + last, BLOCK), 0)
    m = tl.full((Q_TILE,), float("-inf"), tl.float32)
    l = tl.zeros((Q_TILE,), tl.float32)
    acc = tl.zeros((Q_TILE, HEAD_DIM), tl.float32)
    slots = tl.arange(0, BLOCK)
    j = 0
    while j < n_blocks:  # a while loop: the interpreter cannot range over a loaded value
        block = tl.load(tables_ptr + seq * stride_table + j).to(tl.int64)
        k = tl.load(k_ptr + block * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :])
        v = tl.load(v_ptr + block * stride_vb + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :])
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = (j * BLOCK + slots)[None, :] <= pos[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # Every real row sees key 0 in block 0, so m_new is finite from the first block on.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
        j += 1
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _sequence_args(meta: AttentionMeta, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-sequence int32 arrays for the kernel, built once per forward pass: every layer shares
    the meta, so the host-to-device copies happen once, not once per layer."""
    cache = meta.__dict__.setdefault("_triton_args", {})
    if device not in cache:
        starts = [0]
        for n in meta.q_lens[:-1]:
            starts.append(starts[-1] + n)
        as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        tables = meta.block_tables.to(device=device, dtype=torch.int32).contiguous()
        cache[device] = (as_int(starts), as_int(meta.q_lens), as_int(meta.ctx_lens), tables)
    return cache[device]


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float,
              q_tile: int = ATTN_Q_TILE) -> torch.Tensor:
    """Causal attention of the flat queries q (rows, H, D) over the paged caches (blocks,
    ATTN_BLOCK, Hkv, D); rows past meta.num_tokens (padding) come back as zeros."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.shape[1] != ATTN_BLOCK or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"attention kernel: needs cache blocks of {ATTN_BLOCK} and a power-of-two head_dim >= 16, "
                         f"got blocks of {k_cache.shape[1]} and head_dim {head_dim}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    out = torch.zeros_like(q)
    starts, q_lens, ctx_lens, tables = _sequence_args(meta, q.device)
    tiles = triton.cdiv(max(meta.q_lens), q_tile)
    _attention_kernel[(len(meta.q_lens) * tiles, num_heads)](
        q, k_cache, v_cache, out, starts, q_lens, ctx_lens, tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), tables.stride(0),
        scale, tiles, num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim, Q_TILE=q_tile, BLOCK=ATTN_BLOCK,
    )
    return out
