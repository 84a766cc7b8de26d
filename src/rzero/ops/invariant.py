"""Batch-invariant kernels for the CPU, built from stock PyTorch calls on fixed shapes.

Why each is invariant (tests/test_ops.py checks every claim on this machine):

- matmul: the CPU GEMM gives row r the same bits for every row count that is a multiple of 4; a
  lone row (M = 1) or the last M % 4 rows take other kernels. We pad rows to ROW_TILE.
- row reductions (norms, softmax): each row is reduced by one thread in a fixed vectorised order,
  unless there are fewer rows than threads and a row is longer than the reduction grain (32768);
  padding rows to ROW_TILE rules that out.
- elementwise transcendental ops (silu, sigmoid): the vectorised body and the scalar tail differ
  in the last bit, and which elements fall in the tail depends on the tensor's total size. We pad
  the flat size to a multiple of ELEMENTWISE_TILE so that no element is ever in a tail.
- attention: keys are processed in blocks of ATTN_BLOCK positions aligned at position 0 with
  fixed-shape matmuls (queries padded to a multiple of 4); the row max is exact in any order; the
  per-block sums are folded left to right with cumsum (a sequential scan). Prefill, decode and
  chunked prefill therefore run the same arithmetic for a given query.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rzero.ops.attention_meta import AttentionMeta

ROW_TILE = 16
ELEMENTWISE_TILE = 64  # two AVX-512 vectors of bf16


def _pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """View x as (rows, last) and pad rows to a multiple of ROW_TILE."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    pad = (-rows) % ROW_TILE
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    return x2.contiguous(), rows


def padded_rows(num_rows: int) -> int:
    return num_rows + (-num_rows) % ROW_TILE


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x2, rows = _pad_rows(x)
    out = F.linear(x2, weight)[:rows]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2, rows = _pad_rows(x)
    xf = x2.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype))[:rows].reshape(x.shape)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    x2, rows = _pad_rows(x.float())
    return torch.log_softmax(x2, dim=-1)[:rows].reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    x2, rows = _pad_rows(x.float())
    return torch.softmax(x2, dim=-1)[:rows].reshape(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    n = gate.numel()
    pad = (-n) % ELEMENTWISE_TILE
    if not pad:
        return F.silu(gate) * up
    flat = F.pad(gate.reshape(-1), (0, pad))
    return F.silu(flat)[:n].reshape(gate.shape) * up


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    batch, max_q = meta.q_index.shape
    n_blocks = meta.block_tables.shape[1]
    rows = group * max_q  # a multiple of 4: the fixed-shape matmul guarantee applies

    # (B, Hkv, 1, G*Mq, D): the query heads sharing one KV head are stacked as matmul rows.
    qb = q[meta.q_index].float().view(batch, max_q, num_kv_heads, group, head_dim)
    qb = qb.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, 1, rows, head_dim)
    kb = k_cache[meta.block_tables].float().permute(0, 3, 1, 4, 2)  # (B, Hkv, nb, D, blk)
    vb = v_cache[meta.block_tables].float().permute(0, 3, 1, 2, 4)  # (B, Hkv, nb, blk, D)

    scores = torch.matmul(qb, kb) * scale  # (B, Hkv, nb, rows, blk): one fixed-shape GEMM per block
    key_pos = torch.arange(n_blocks * block).view(1, 1, n_blocks, 1, block)
    q_pos = meta.q_positions.view(batch, 1, 1, max_q).expand(batch, 1, group, max_q)
    scores = scores.masked_fill(key_pos > q_pos.reshape(batch, 1, 1, rows, 1), float("-inf"))

    row_max = scores.amax(dim=(2, 4), keepdim=True)  # max is exact in any order
    probs = torch.exp(scores - row_max)
    # Per-block partial sums, then a left-to-right fold over blocks (cumsum is a sequential scan);
    # blocks past a query's position contribute exact zeros, so the fold ends on the same bits.
    denom = probs.sum(-1).cumsum(2)[:, :, -1]  # (B, Hkv, rows)
    numer = torch.matmul(probs, vb).cumsum(2)[:, :, -1]  # (B, Hkv, rows, D)
    out = numer / denom.unsqueeze(-1)
    out = out.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch * max_q, num_heads, head_dim)[meta.out_index].to(q.dtype)


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = softmax(router_logits)
    # A stable sort breaks ties toward the lower expert id, whatever else is in the batch.
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def moe_combine(expert_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    weights = weights.to(expert_outputs.dtype)
    out = expert_outputs[:, 0] * weights[:, :1]
    for slot in range(1, expert_outputs.shape[1]):  # fixed left-to-right order over the k slots
        out = out + expert_outputs[:, slot] * weights[:, slot : slot + 1]
    return out
