"""Stock PyTorch numerics: what a typical stack runs. The negative control for every check.

Shapes and reduction orders follow whatever the batch happens to be: `F.linear` on the real row
count, SDPA for prefill, a separate matmul-softmax path for decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rzero.ops.attention_meta import AttentionMeta


ROW_TILE = 1  # no padding: every op runs on the real row count


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding; elementwise, so its bits never depend on the batch (the
    invariant CPU kernel gives exactly these)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    batch, max_q = meta.q_index.shape
    keys = k_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)  # (B, Hkv, L, D)
    values = v_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)
    key_pos = torch.arange(keys.shape[2], device=keys.device)
    if meta.is_decode:
        # The usual separate decode kernel: one query per sequence, matmul + softmax.
        query = q[meta.q_index[:, :1]].transpose(1, 2)  # (B, H, 1, D)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(key_pos.view(1, 1, 1, -1) >= meta.kv_lens.view(-1, 1, 1, 1), float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), values)
        out = out.expand(batch, num_heads, max_q, head_dim)
    else:
        query = q[meta.q_index].transpose(1, 2)  # (B, H, Mq, D)
        mask = key_pos.view(1, 1, 1, -1) <= meta.q_positions.view(batch, 1, max_q, 1)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)[meta.out_index]


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights, experts = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def moe_combine(expert_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (expert_outputs * weights.to(expert_outputs.dtype).unsqueeze(-1)).sum(1)
