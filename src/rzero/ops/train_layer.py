"""A training forward through a dense decoder layer as one autograd node (invariant numerics, CPU).

Op by op, a layer's training forward records ~30 autograd nodes (linears, norms, rotary, the
private KV cache's index copies, attention, SwiGLU, splits, concatenations, residual adds) and its
backward walks them one at a time. Here the forward runs the very same kernels on the same inputs
in the same order, so every output has the op path's bits (the engine's: C9 holds unchanged),
and the backward is written out: each op's gradient formula, the one its own autograd node
applies (`_Linear`, `_RMSNorm`, `_Rotary`, `_KernelAttention`, SiLU and product, index copies),
in reverse order. Gradients equal the op path's up to the order in which a tensor's several
gradient terms are summed (tests/test_train_layer.py).

Applies where every op of the layer takes the C kernels' path: the C library is built, fp32 or
bf16 throughout, a dense MLP whose width is a multiple of the elementwise tile; the caller runs
the ops otherwise (`Numerics.train_decoder_layer` returns None).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rzero.ops import cpu_kernel
from rzero.ops.attention_meta import ATTN_BLOCK, AttentionMeta
from rzero.ops.layout import joined


# Training forwards run as one node in this process, by dtype (`rzero check` reports them).
CALLS: Counter[str] = Counter()


class DenseLayerParams(NamedTuple):
    """A dense decoder layer's parameters as the model holds them (separate q/k/v and gate/up, the
    tensors autograd hands gradients to), its norms' eps and its attention scale."""

    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    eps: tuple[float, float, float, float]  # input, q, k, post-attention norm
    scale: float
    heads: int
    kv_heads: int


def applies(h: torch.Tensor, params: DenseLayerParams, cos: torch.Tensor) -> bool:
    """Whether every op of the layer runs on the C kernels here (the op path's choice, op by op)."""
    from rzero.ops.invariant_rows import ELEMENTWISE_TILE

    weights = params[:11]
    dtype = h.dtype
    return (
        cpu_kernel.library() is not None
        and h.device.type == "cpu"
        and h.dim() == 2
        and dtype in (torch.float32, torch.bfloat16)
        and cos.dtype == dtype
        and all(w.dtype == dtype and w.device.type == "cpu" for w in weights)
        and params.gate.shape[0] % ELEMENTWISE_TILE == 0
        and params.q.shape[0] // params.heads % 2 == 0
    )


def _private_cache(x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """The whole sequences' keys (or values) x (rows, Hkv, D) in a private paged cache, as
    `Attention.forward` builds it op by op (zeros, rows at slot_mapping, shared prompt rows again)."""
    cache = x.new_zeros((meta.num_blocks * ATTN_BLOCK, *x.shape[1:]))  # in place: no autograd records it here
    cache.index_copy_(0, meta.slot_mapping, x[: meta.num_tokens])
    if meta.copy_slots is not None:
        cache.index_copy_(0, meta.copy_slots, x[meta.copy_rows])
    return cache.view(meta.num_blocks, ATTN_BLOCK, *x.shape[1:])


def _private_cache_grad(grad_cache: torch.Tensor, meta: AttentionMeta, rows: int) -> torch.Tensor:
    """The gradient of `_private_cache`'s x for its output's gradient: each row's slot, plus
    (summed) the slots it was copied to for other completions of its prompt."""
    flat = grad_cache.view(-1, *grad_cache.shape[2:])
    grad = flat.new_empty((rows, *flat.shape[1:]))
    torch.index_select(flat, 0, meta.slot_mapping, out=grad[: meta.num_tokens])
    grad[meta.num_tokens :].zero_()
    if meta.copy_slots is not None:
        copies = flat.new_zeros(grad.shape).index_put_((meta.copy_rows,), flat.index_select(0, meta.copy_slots), accumulate=True)
        grad = grad + copies
    return grad


def _linear(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from rzero.ops.invariant import _linear_forward

    operands: list[torch.Tensor] = []
    return _linear_forward(x, weight, operands=operands), operands


class _DenseLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, cos, sin, meta, params, *weights):
        w_in, wq, wk, wv, wqn, wkn, wo, w_post, wg, wu, wd = weights
        eps_in, eps_q, eps_k, eps_post = params.eps
        rows, heads, kv_heads = h.shape[0], params.heads, params.kv_heads
        head_dim = wq.shape[0] // heads
        n1 = cpu_kernel.rms_norm(h, w_in, eps_in)
        qkv, qkv_ops = _linear(n1, joined([wq, wk, wv]))
        q, k, v = qkv.split_with_sizes([wq.shape[0], wk.shape[0], wv.shape[0]], dim=-1)
        q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
        v = v.view(rows, kv_heads, head_dim)
        q_rot = cpu_kernel.rotary(cpu_kernel.rms_norm(q, wqn, eps_q), cos, sin)
        k_rot = cpu_kernel.rotary(cpu_kernel.rms_norm(k, wkn, eps_k), cos, sin)
        k_cache, v_cache = _private_cache(k_rot, meta), _private_cache(v, meta)
        attn = cpu_kernel.attention(q_rot, k_cache, v_cache, meta, params.scale).reshape(rows, heads * head_dim)
        o, o_ops = _linear(attn, wo)
        h2 = h + o
        n2 = cpu_kernel.rms_norm(h2, w_post, eps_post)
        gate_up, gate_up_ops = _linear(n2, joined([wg, wu]))
        gate, up = gate_up.split_with_sizes([wg.shape[0], wu.shape[0]], dim=-1)
        silu = F.silu(gate)
        down, down_ops = _linear(silu * up, wd)
        ctx.meta, ctx.params = meta, params
        ctx.save_for_backward(
            h, cos, sin, w_in, wqn, wkn, w_post, q, k, q_rot, k_cache, v_cache, h2, gate, up, silu,
            *qkv_ops, *o_ops, *gate_up_ops, *down_ops,
        )
        return h2 + down

    @staticmethod
    def backward(ctx, grad_out):
        (h, cos, sin, w_in, wqn, wkn, w_post, q, k, q_rot, k_cache, v_cache, h2, gate, up, silu,
         *operands) = ctx.saved_tensors
        meta, params = ctx.meta, ctx.params
        eps_in, eps_q, eps_k, eps_post = params.eps
        want = ctx.needs_input_grad[5:]  # the weights', in `weights` order
        rows = h.shape[0]
        linear_grad = _linear_grads(operands, h.dtype)
        # MLP: down, SwiGLU (the product's and SiLU's gradients), gate/up, post-attention norm
        d_act, grad_down = linear_grad(3, grad_out, want[10])
        d_gate_up = torch.cat((torch.ops.aten.silu_backward(d_act * up, gate), d_act * silu), dim=-1)
        d_n2, grad_gate_up = linear_grad(2, d_gate_up, want[8] or want[9])
        d_h2, grad_post = cpu_kernel.rms_norm_backward(h2, w_post, eps_post, d_n2, True, want[7])
        d_h2 = grad_out + d_h2  # the residual's and the norm's
        # attention: o_proj, the kernel's backward, the private caches, rotary, q/k norms, q/k/v
        d_attn, grad_o = linear_grad(1, d_h2, want[6])
        dq, dk_cache, dv_cache = cpu_kernel.attention_backward(
            q_rot, k_cache, v_cache, meta, params.scale, d_attn.view(q_rot.shape)
        )
        dq, dk_cache, dv_cache = dq.to(q_rot.dtype), dk_cache.to(k_cache.dtype), dv_cache.to(v_cache.dtype)
        dk_rot = _private_cache_grad(dk_cache, meta, rows)
        dv = _private_cache_grad(dv_cache, meta, rows)
        dq, grad_qn = cpu_kernel.rms_norm_backward(q, wqn, eps_q, cpu_kernel.rotary_backward(dq, cos, sin), True, want[4])
        dk, grad_kn = cpu_kernel.rms_norm_backward(k, wkn, eps_k, cpu_kernel.rotary_backward(dk_rot, cos, sin), True, want[5])
        d_qkv = torch.cat((dq.view(rows, -1), dk.view(rows, -1), dv.view(rows, -1)), dim=-1)
        d_n1, grad_qkv = linear_grad(0, d_qkv, want[1] or want[2] or want[3])
        d_h, grad_in = cpu_kernel.rms_norm_backward(h, w_in, eps_in, d_n1, ctx.needs_input_grad[0], want[0])
        d_h = None if d_h is None else d_h2 + d_h
        grads_qkv = _split_rows(grad_qkv, params.q, params.k, params.v)
        grads_gate_up = _split_rows(grad_gate_up, params.gate, params.up)
        weight_grads = (grad_in, *grads_qkv, grad_qn, grad_kn, grad_o, grad_post, *grads_gate_up, grad_down)
        return d_h, None, None, None, None, *(g if w else None for g, w in zip(weight_grads, want))


def _linear_grads(operands: list[torch.Tensor], dtype: torch.dtype):
    """grad(i, grad_output, want_weight) -> (input grad, weight grad) of the layer's i-th linear
    (q/k/v, o, gate/up, down), from the operands its forward multiplied: `_Linear`'s backward."""
    from rzero.ops.invariant import linear_backward

    def grad(i: int, grad_output: torch.Tensor, want_weight: bool):
        return linear_backward(operands[2 * i], operands[2 * i + 1], grad_output, dtype, dtype, True, want_weight)

    return grad


def _split_rows(grad: torch.Tensor | None, *weights: torch.Tensor) -> tuple:
    """A joined weight's gradient back to each weight's rows (None: no gradient wanted)."""
    if grad is None:
        return (None,) * len(weights)
    return tuple(grad.split([w.shape[0] for w in weights]))


def dense_layer(h: torch.Tensor, params: DenseLayerParams, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMeta) -> torch.Tensor | None:
    """The layer's output, as one autograd node, or None where `applies` says no."""
    if not applies(h, params, cos):
        return None
    CALLS["bf16" if h.dtype == torch.bfloat16 else "fp32"] += 1
    return _DenseLayer.apply(h, cos, sin, meta, params, *params[:11])
