"""Batch-invariant attention for the CPU over the paged KV cache (the `attention` op of
rzero/ops/invariant.py). It runs our C kernel (rzero/ops/cpu_kernel.py) where one can be built;
the rest of this file is the fallback built from stock PyTorch calls on fixed shapes (other
bits, the same guarantees), and the plain backward both use.

fp32 inside. Per (sequence, KV head), the query rows (a multiple of the score tile, `score_rows`:
4 up to head_dim 64, 8 at 128 on this CPU) times all keys (a multiple of ATTN_BLOCK) in one GEMM;
each score is a length-D dot product whose bits do not depend on the row or key count. Masked
keys get -inf, and the row softmax (exact max, vectorised exp, sequential sum along the row)
ignores the exact zeros they become. probs @ V runs in fixed blocks of
ATTN_BLOCK keys aligned at position 0 (fixed-shape GEMMs), folded left to right with baddbmm_;
blocks past a query add exact zeros. Prefill, decode and chunked prefill therefore run the same
arithmetic for a given query, and a long prefill may score each block of 16 query positions
against only the keys it can see (what a chunked prefill does), skipping the masked half.
Cache slots past a sequence's length must hold finite values.
Only the forward is invariant; the backward is plain softmax-attention math (gradients need to
be right, not batch-invariant).

tests/test_ops.py checks every claim on this machine.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from rzero.ops import cpu_kernel
from rzero.ops.attention_meta import ATTN_BLOCK, AttentionMeta


# fp32 keys per no-grad attention bucket (0: no cut), see _buckets. Measured at a 0.6B model's
# decode (64 sequences, context 160): one layer's attention 43 ms uncut, 12 ms at 8 MB, 55 ms at
# 32 MB. Buffers past ~32 MB are fresh mmaps, page-faulted on every call; smaller ones are reused.
CHUNK_BYTES = 1 << 23


@functools.lru_cache(maxsize=None)
def score_rows(head_dim: int, threads: int) -> int:
    """Rows per (sequence, KV head) attention-score GEMM, a multiple of which every such GEMM has:
    the fewest of 4, 8 and 16 from which this machine's fp32 bmm gives a score the same bits
    whatever the row count, the key count (multiples of ATTN_BLOCK), the batch and the row's place
    in it. It depends on head_dim: here 4 rows suffice up to 64, while at 128 a 4-row GEMM takes
    another kernel than an 8-row one (tests/test_ops.py). Probed once per head_dim and thread count."""
    gen = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(64, head_dim, generator=gen), torch.randn(256, head_dim, generator=gen)
    for tile in (4, 8, 16):
        reference = q[:tile] @ k[:ATTN_BLOCK].t()

        def same(shift: int, rows: int, keys: int, batch: int) -> bool:
            qq = torch.cat((torch.zeros(shift, head_dim), q))[:rows].expand(batch, rows, head_dim).contiguous()
            kk = k[:keys].expand(batch, keys, head_dim).contiguous()
            return torch.equal(torch.bmm(qq, kk.transpose(1, 2))[-1, shift : shift + tile, :ATTN_BLOCK], reference)

        cases = [(0, tile * m, keys, 1) for m in (1, 2, 3, 64 // tile) for keys in (16, 48, 256)]
        cases += [(shift, tile * 4, 64, batch) for shift in (1, tile // 2 + 1, tile) for batch in (1, 8)]
        if all(same(*case) for case in cases):
            return tile
    raise RuntimeError(f"invariant attention: no row tile of 4, 8 or 16 gives head_dim {head_dim} fixed bits on this CPU")


class _AttentionPlan:
    """Index tensors for one AttentionMeta and head layout, built once per forward pass (the meta
    is shared by every layer) and cached on the meta object."""

    def __init__(self, meta: AttentionMeta, num_heads: int, num_kv_heads: int, block: int, head_dim: int):
        group = num_heads // num_kv_heads
        batch, max_q = meta.q_index.shape
        n_blocks = meta.block_tables.shape[1]
        # Fewest query slots per sequence that still make group * slots a multiple of the score
        # GEMM's row tile (`score_rows`): decode needs one slot, and the fixed-shape guarantee holds.
        q_tile = score_rows(head_dim, torch.get_num_threads())
        step = q_tile // math.gcd(group, q_tile)
        slots = -(-max(meta.q_lens) // step) * step
        q_index, q_positions = meta.q_index, meta.q_positions
        if slots > max_q:  # more padding slots than the meta has: they repeat row 0, at position 0
            q_index, q_positions = F.pad(q_index, (0, slots - max_q)), F.pad(q_positions, (0, slots - max_q))
        self.rows = group * slots  # matmul rows per (sequence, KV head): query slot-major, then group
        self.keys = n_blocks * block
        self.batch_heads = batch * num_kv_heads
        heads = torch.arange(num_heads).view(1, num_kv_heads, 1, group)
        # Row of q.view(-1, D) for every (sequence, KV head, slot, group member).
        q_index = q_index[:, :slots].reshape(batch, 1, slots, 1)
        self.q_rows = (q_index * num_heads + heads).reshape(-1)
        # Row of cache.view(-1, D) for every (sequence, KV head, key position).
        cache_slot = meta.block_tables.view(batch, 1, n_blocks, 1) * block + torch.arange(block).view(1, 1, 1, block)
        kv_head = torch.arange(num_kv_heads).view(1, num_kv_heads, 1, 1)
        self.kv_rows = (cache_slot * num_kv_heads + kv_head).reshape(-1)
        # Causal mask as an additive fp32 bias (0 or -inf, broadcast over KV heads): adding is much
        # faster than a broadcast masked_fill_, exact for the 0s, and -inf for the rest.
        q_pos = q_positions[:, :slots].view(batch, 1, slots, 1, 1).expand(batch, 1, slots, group, 1)
        future = torch.arange(self.keys).view(1, 1, 1, -1) > q_pos.reshape(batch, 1, self.rows, 1)
        self.bias = torch.zeros(future.shape).masked_fill_(future, float("-inf"))
        # Causal row blocks: the rows of query slots [16j, 16j + 16) are scored against only the
        # keys up to the block's last position (in every sequence), as a chunked prefill would be.
        # The key blocks skipped are wholly masked: exact zeros that change no bit.
        last_ctx = max(meta.ctx_lens)
        self.row_blocks = [
            (start * group, min(slots, start + block) * group, min(self.keys, -(-(last_ctx + start + block) // block) * block))
            for start in range(0, slots, block)
        ]
        # Row of the (B * Hkv * rows, D) output for every (token, head) of the flat batch.
        seq, slot = meta.out_index // max_q, meta.out_index % max_q
        head = torch.arange(num_heads)
        out_rows = ((seq.view(-1, 1) * num_kv_heads + head // group) * slots + slot.view(-1, 1)) * group + head % group
        self.out_rows = out_rows.reshape(-1)

    @staticmethod
    def get(meta: AttentionMeta, num_heads: int, num_kv_heads: int, block: int, head_dim: int) -> _AttentionPlan:
        plans = meta.__dict__.setdefault("_invariant_plans", {})
        key = (num_heads, num_kv_heads, block, head_dim)
        if key not in plans:
            plans[key] = _AttentionPlan(meta, num_heads, num_kv_heads, block, head_dim)
        return plans[key]


def _attention_forward(q, k_cache, v_cache, plan: _AttentionPlan, scale: float, keep_probs: bool = False):
    """The invariant forward in fp32: returns (output rows, and what the backward needs if asked)."""
    head_dim, block = q.shape[-1], k_cache.shape[1]
    bh, rows, keys = plan.batch_heads, plan.rows, plan.keys
    # Gathers straight into matmul layout: one copy each, no broadcast or permute copies.
    # Scaling q first is one exact-per-element multiply, the same for every row.
    qb = q.reshape(-1, head_dim).index_select(0, plan.q_rows).float().mul_(scale).view(bh, rows, head_dim)
    kb = k_cache.reshape(-1, head_dim).index_select(0, plan.kv_rows).float().view(bh, keys, head_dim)
    vb = v_cache.reshape(-1, head_dim).index_select(0, plan.kv_rows).float().view(bh, keys, head_dim)
    bias = plan.bias  # (B, 1, rows, keys)
    if len(plan.row_blocks) == 1:
        out, probs = _attention_block(qb, kb, vb, bias, block)
        return out, ((qb, kb, vb, probs) if keep_probs else None)
    out = qb.new_empty(bh, rows, head_dim)
    probs = qb.new_empty(bh, rows, keys) if keep_probs else None
    for r0, r1, visible in plan.row_blocks:
        out[:, r0:r1], block_probs = _attention_block(
            qb[:, r0:r1], kb[:, :visible], vb[:, :visible], bias[:, :, r0:r1, :visible], block
        )
        if keep_probs:  # each element written once; masked keys exact zeros, as unsplit
            probs[:, r0:r1, :visible] = block_probs
            probs[:, r0:r1, visible:] = 0
    return out, ((qb, kb, vb, probs) if keep_probs else None)


def _attention_block(qb, kb, vb, bias, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows qb (B*Hkv, rows, D) over keys kb and values vb (B*Hkv, keys, D),
    with the additive causal bias (B, 1, rows, keys): (output, probs)."""
    rows, keys = qb.shape[1], kb.shape[1]
    # Scores in one GEMM per (sequence, KV head): element (r, c) is a length-D dot product whose
    # bits do not depend on the row count (a multiple of `score_rows`) or the key count (of 16).
    scores = torch.bmm(qb, kb.transpose(1, 2))
    scores.view(bias.shape[0], -1, rows, keys).add_(bias)  # (B, Hkv, rows, keys)
    # Row softmax: exact max, vectorised exp, and a sequential vector sum along the row, so the keys
    # past a query's position (exact zeros after exp) leave its bits unchanged.
    probs = torch.softmax(scores, dim=-1)
    # probs @ V over the keys in fixed blocks of 16 (fixed-shape matmuls), folded left to right;
    # blocks past a query's position add exact zeros.
    out = torch.bmm(probs[:, :, :block], vb[:, :block])
    for start in range(block, keys, block):
        out.baddbmm_(probs[:, :, start : start + block], vb[:, start : start + block])
    return out, probs


class _Attention(torch.autograd.Function):
    """Invariant forward; plain (not batch-invariant) softmax-attention backward: only the forward
    pass has to match the engine bit for bit, the gradients just have to be right."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, plan, scale):
        out, saved = _attention_forward(q, k_cache, v_cache, plan, scale, keep_probs=True)
        ctx.plan, ctx.scale, ctx.shapes = plan, scale, (q.shape, q.dtype, k_cache.shape, k_cache.dtype)
        ctx.save_for_backward(out, *saved)
        return _token_rows(out, plan, q)

    @staticmethod
    def backward(ctx, grad):
        return _attention_backward(ctx, ctx.saved_tensors, grad)


class _KernelAttention(torch.autograd.Function):
    """The C kernel's forward and backward (rzero/ops/cpu_kernel.py): training sees the engine's
    forward bits; the backward is plain softmax-attention math in C."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, meta, scale):
        ctx.meta, ctx.scale = meta, scale
        ctx.save_for_backward(q, k_cache, v_cache)
        return cpu_kernel.attention(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k_cache, v_cache = ctx.saved_tensors
        dq, dk, dv = cpu_kernel.attention_backward(q, k_cache, v_cache, ctx.meta, ctx.scale, grad)
        return dq.to(q.dtype), dk.to(k_cache.dtype), dv.to(v_cache.dtype), None, None


def _attention_backward(ctx, saved, grad) -> tuple:
    """Gradients of q, k_cache and v_cache from the matmul-layout forward's (out, qb, kb, vb, probs)."""
    out, qb, kb, vb, probs = saved
    plan, (q_shape, q_dtype, kv_shape, kv_dtype) = ctx.plan, ctx.shapes
    head_dim = q_shape[-1]
    d_out = out.new_zeros(out.numel() // head_dim, head_dim)
    d_out = d_out.index_add_(0, plan.out_rows, grad.reshape(-1, head_dim).float()).view(out.shape)
    # Softmax backward, in place on the fresh (B*Hkv, rows, L) buffer to spare big allocations.
    d_scores = torch.bmm(d_out, vb.transpose(1, 2)).sub_((d_out * out).sum(-1, keepdim=True)).mul_(probs)
    def scatter(rows: torch.Tensor, d: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        # Back from matmul layout to the caller's rows; repeated rows (padding) accumulate.
        g = d.new_zeros(shape.numel() // head_dim, head_dim).index_add_(0, rows, d.reshape(-1, head_dim))
        return g.view(shape).to(dtype)

    grads = [None] * 5
    if ctx.needs_input_grad[0]:
        grads[0] = scatter(plan.q_rows, torch.bmm(d_scores, kb).mul_(ctx.scale), q_shape, q_dtype)
    if ctx.needs_input_grad[1]:
        grads[1] = scatter(plan.kv_rows, torch.bmm(d_scores.transpose(1, 2), qb), kv_shape, kv_dtype)
    if ctx.needs_input_grad[2]:
        grads[2] = scatter(plan.kv_rows, torch.bmm(probs.transpose(1, 2), d_out), kv_shape, kv_dtype)
    return tuple(grads)


def _buckets(meta: AttentionMeta, key_bytes: int) -> list[tuple[torch.Tensor, AttentionMeta]] | None:
    """Sequences of similar query and key counts, each with its own meta; None for one bucket.

    One padded matmul over the whole batch pads every sequence to the longest query chunk and the
    longest context: a 20-token prefill next to 255 decodes multiplies the decode rows' work by
    20. Each element's bits do not depend on that padding (see _attention_forward), so the batch
    may be split anywhere; the split only saves work. A bucket is also cut so that its keys in
    fp32 (`key_bytes` per key position: all KV heads) stay near CHUNK_BYTES: the gathered K and V
    buffers then come from reused memory, not fresh page-faulted mappings.
    """
    cached = meta.__dict__.setdefault("_invariant_buckets", {})
    if key_bytes in cached:
        return cached[key_bytes]
    blocks = [-(-int(n) // ATTN_BLOCK) for n in meta.kv_lens.tolist()]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (n, b) in enumerate(zip(meta.q_lens, blocks)):
        groups.setdefault((1 << (n - 1).bit_length(), 1 << (b - 1).bit_length()), []).append(i)
    if CHUNK_BYTES:
        chunked = {}
        for (n, b), seqs in groups.items():
            size = max(1, CHUNK_BYTES // (b * ATTN_BLOCK * key_bytes))
            for start in range(0, len(seqs), size):
                chunked[(n, b, start)] = seqs[start : start + size]
        groups = chunked
    buckets = None
    if len(groups) > 1:
        starts = [0]
        for n in meta.q_lens:
            starts.append(starts[-1] + n)
        buckets = []
        for seqs in groups.values():
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
            tables = [meta.block_tables[i, : blocks[i]].tolist() for i in seqs]
            sub = AttentionMeta.build(
                [meta.q_lens[i] for i in seqs], [meta.ctx_lens[i] for i in seqs], tables, row_tile=1
            )  # row_tile 1: a bucket's output rows are its real tokens, cut by the caller anyway
            buckets.append((rows, sub))
    cached[key_bytes] = buckets
    return buckets


def _token_rows(out: torch.Tensor, plan: _AttentionPlan, q: torch.Tensor) -> torch.Tensor:
    """From the (B * Hkv, rows, D) matmul layout back to q's (tokens, heads, D) rows and dtype."""
    return out.view(-1, q.shape[-1]).index_select(0, plan.out_rows).view(-1, *q.shape[1:]).to(q.dtype)


def _attention_rows(q, k_cache, v_cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
    plan = _AttentionPlan.get(meta, q.shape[1], k_cache.shape[2], k_cache.shape[1], q.shape[2])
    out, _ = _attention_forward(q, k_cache, v_cache, plan, scale)
    return _token_rows(out, plan, q)


def cached_attention(
    q, k, v, q_weight, k_weight, eps: float, cos, sin, cache, meta: AttentionMeta, scale: float
) -> torch.Tensor | None:
    """`Numerics.cached_attention` in one C call (cpu_kernel.cached_attention) where it applies:
    the kernel is built, no gradient is wanted, and every tensor is of one dtype, fp32 or bf16.
    None otherwise: the caller runs the ops one by one (the same bits)."""
    k_cache, v_cache = cache
    tensors = (q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache)
    if (
        cpu_kernel.library() is None
        or q.dtype not in (torch.float32, torch.bfloat16)
        or any(t.dtype != q.dtype for t in tensors)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        or q.shape[-1] % 2
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    return cpu_kernel.cached_attention(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, meta, scale)


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    if cpu_kernel.library() is not None:
        if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
            return _KernelAttention.apply(q, k_cache, v_cache, meta, scale)
        return cpu_kernel.attention(q, k_cache, v_cache, meta, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        plan = _AttentionPlan.get(meta, q.shape[1], k_cache.shape[2], k_cache.shape[1], q.shape[2])
        return _Attention.apply(q, k_cache, v_cache, plan, scale)
    buckets = _buckets(meta, k_cache.shape[2] * q.shape[2] * 4)
    if buckets is None:
        return _attention_rows(q, k_cache, v_cache, meta, scale)
    out = q.new_zeros((meta.padded_tokens, *q.shape[1:]))  # padding rows stay 0: finite, never used
    for rows, sub in buckets:
        out.index_copy_(0, rows, _attention_rows(q.index_select(0, rows), k_cache, v_cache, sub, scale)[: len(rows)])
    return out
