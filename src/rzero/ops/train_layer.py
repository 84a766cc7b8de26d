"""A decoder layer's training forward in two autograd nodes (invariant numerics, CPU): its
attention block, h2 = h + o_proj(attention(norm(h))), and, for a dense MLP, its MLP block,
h2 + down(silu(gate) * up) of norm(h2).

Op by op, a layer's training forward records ~30 autograd nodes (linears, norms, rotary, the
private KV cache's index copies, attention, SwiGLU, splits, concatenations, residual adds) and its
backward walks them one at a time. Here the forward runs the very same kernels on the same inputs
in the same order, so every output has the op path's bits (the engine's: C9 holds unchanged),
and the backward is written out: each op's gradient formula, the one its own autograd node
applies (`_Linear`, `_RMSNorm`, `_Rotary`, `_KernelAttention`, SiLU and product, index copies),
in reverse order. Gradients equal the op path's bit for bit (tests/test_train_layer.py).

A block applies where every op in it takes the C kernels' path: the C library is built, fp32 or
bf16 throughout, and (MLP) a width that is a multiple of the elementwise tile; the caller runs
the ops otherwise (`Numerics.train_attention` / `train_mlp` return None). An MoE layer runs its
attention block here and its experts op by op.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rzero.ops import cpu_kernel
from rzero.ops.attention_meta import AttentionMeta, private_cache
from rzero.ops.invariant_rows import ELEMENTWISE_TILE
from rzero.ops.layout import joined

# Blocks run as one node in this process, by block and dtype (`rzero check` reports them).
CALLS: Counter[str] = Counter()


class AttentionParams(NamedTuple):
    """A layer's attention block as the model holds it (separate q/k/v, the tensors autograd hands
    gradients to), its norms' eps (input, q, k), its scale and head counts."""

    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    eps: tuple[float, float, float]
    scale: float
    heads: int
    kv_heads: int


class MLPParams(NamedTuple):
    """A dense layer's MLP block: the post-attention norm (and its eps) and the SwiGLU weights."""

    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    eps: float


def _kernels_apply(h: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
    return (
        cpu_kernel.library() is not None
        and h.device.type == "cpu"
        and h.dim() == 2
        and h.dtype in (torch.float32, torch.bfloat16)
        and all(w.dtype == h.dtype and w.device.type == "cpu" for w in weights)
    )


def attention_applies(h: torch.Tensor, params: AttentionParams, cos: torch.Tensor) -> bool:
    return _kernels_apply(h, params[:7]) and cos.dtype == h.dtype and params.q.shape[0] // params.heads % 2 == 0


def mlp_applies(h: torch.Tensor, params: MLPParams) -> bool:
    return _kernels_apply(h, params[:4]) and params.gate.shape[0] % ELEMENTWISE_TILE == 0


def _private_cache_grad(grad_cache: torch.Tensor, meta: AttentionMeta, rows: int) -> torch.Tensor:
    """The gradient of `private_cache`'s x for its output's gradient: each row's slot, plus
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
    """The invariant linear's forward, and the operands it multiplied (`_Linear` keeps the same)."""
    from rzero.ops.invariant import _linear_forward

    operands: list[torch.Tensor] = []
    return _linear_forward(x, weight, operands=operands), operands


def _linear_grad(operands: list[torch.Tensor], grad_output: torch.Tensor, want_weight: bool):
    """(input grad, weight grad) of a linear from its forward's operands: `_Linear`'s backward."""
    from rzero.ops.invariant import linear_backward

    dtype = grad_output.dtype
    return linear_backward(operands[0], operands[1], grad_output, dtype, dtype, True, want_weight)


def _split_rows(grad: torch.Tensor | None, *weights: torch.Tensor) -> tuple:
    """A joined weight's gradient back to each weight's rows (None: no gradient wanted)."""
    if grad is None:
        return (None,) * len(weights)
    return tuple(grad.split([w.shape[0] for w in weights]))


class _AttentionBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, cos, sin, meta, params, *weights):
        w_in, wq, wk, wv, wqn, wkn, wo = weights
        eps_in, eps_q, eps_k = params.eps
        rows, heads, kv_heads = h.shape[0], params.heads, params.kv_heads
        head_dim = wq.shape[0] // heads
        n1 = cpu_kernel.rms_norm(h, w_in, eps_in)
        qkv, qkv_ops = _linear(n1, joined([wq, wk, wv]))
        q, k, v = qkv.split_with_sizes([wq.shape[0], wk.shape[0], wv.shape[0]], dim=-1)
        q, k = q.view(rows, heads, head_dim), k.view(rows, kv_heads, head_dim)
        v = v.view(rows, kv_heads, head_dim)
        q_rot = cpu_kernel.rotary(cpu_kernel.rms_norm(q, wqn, eps_q), cos, sin)
        k_rot = cpu_kernel.rotary(cpu_kernel.rms_norm(k, wkn, eps_k), cos, sin)
        k_cache, v_cache = private_cache(k_rot, meta), private_cache(v, meta)
        attn = cpu_kernel.attention(q_rot, k_cache, v_cache, meta, params.scale).reshape(rows, heads * head_dim)
        o, o_ops = _linear(attn, wo)
        ctx.meta, ctx.params = meta, params
        ctx.save_for_backward(h, cos, sin, w_in, wqn, wkn, q, k, q_rot, k_cache, v_cache, *qkv_ops, *o_ops)
        return h + o

    @staticmethod
    def backward(ctx, grad_h2):
        h, cos, sin, w_in, wqn, wkn, q, k, q_rot, k_cache, v_cache, *operands = ctx.saved_tensors
        meta, params = ctx.meta, ctx.params
        eps_in, eps_q, eps_k = params.eps
        want = ctx.needs_input_grad[5:]  # the weights', in `weights` order
        rows = h.shape[0]
        d_attn, grad_o = _linear_grad(operands[2:], grad_h2, want[6])
        dq, dk_cache, dv_cache = cpu_kernel.attention_backward(
            q_rot, k_cache, v_cache, meta, params.scale, d_attn.view(q_rot.shape)
        )
        dq, dk_cache, dv_cache = dq.to(q_rot.dtype), dk_cache.to(k_cache.dtype), dv_cache.to(v_cache.dtype)
        dk_rot = _private_cache_grad(dk_cache, meta, rows)
        dv = _private_cache_grad(dv_cache, meta, rows)
        dq, grad_qn = cpu_kernel.rms_norm_backward(q, wqn, eps_q, cpu_kernel.rotary_backward(dq, cos, sin), True, want[4])
        dk, grad_kn = cpu_kernel.rms_norm_backward(k, wkn, eps_k, cpu_kernel.rotary_backward(dk_rot, cos, sin), True, want[5])
        d_qkv = torch.cat((dq.view(rows, -1), dk.view(rows, -1), dv.view(rows, -1)), dim=-1)
        d_n1, grad_qkv = _linear_grad(operands[:2], d_qkv, want[1] or want[2] or want[3])
        d_h, grad_in = cpu_kernel.rms_norm_backward(h, w_in, eps_in, d_n1, ctx.needs_input_grad[0], want[0])
        d_h = None if d_h is None else grad_h2 + d_h  # the residual's and the norm's
        weight_grads = (grad_in, *_split_rows(grad_qkv, params.q, params.k, params.v), grad_qn, grad_kn, grad_o)
        return d_h, None, None, None, None, *(g if w else None for g, w in zip(weight_grads, want))


class _MLPBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h2, params, *weights):
        w_post, wg, wu, wd = weights
        n2 = cpu_kernel.rms_norm(h2, w_post, params.eps)
        gate_up, gate_up_ops = _linear(n2, joined([wg, wu]))
        gate, up = gate_up.split_with_sizes([wg.shape[0], wu.shape[0]], dim=-1)
        silu = F.silu(gate)
        down, down_ops = _linear(silu * up, wd)
        ctx.params = params
        ctx.save_for_backward(h2, w_post, gate, up, silu, *gate_up_ops, *down_ops)
        return h2 + down

    @staticmethod
    def backward(ctx, grad_out):
        h2, w_post, gate, up, silu, *operands = ctx.saved_tensors
        params = ctx.params
        want = ctx.needs_input_grad[2:]
        d_act, grad_down = _linear_grad(operands[2:], grad_out, want[3])
        # SwiGLU: the product's gradient, then SiLU's, into the joined gate/up gradient
        d_gate_up = torch.cat((torch.ops.aten.silu_backward(d_act * up, gate), d_act * silu), dim=-1)
        d_n2, grad_gate_up = _linear_grad(operands[:2], d_gate_up, want[1] or want[2])
        d_h2, grad_post = cpu_kernel.rms_norm_backward(h2, w_post, params.eps, d_n2, ctx.needs_input_grad[0], want[0])
        d_h2 = None if d_h2 is None else grad_out + d_h2  # the residual's and the norm's
        weight_grads = (grad_post, *_split_rows(grad_gate_up, params.gate, params.up), grad_down)
        return d_h2, None, *(g if w else None for g, w in zip(weight_grads, want))


def _dtype_name(h: torch.Tensor) -> str:
    return "bf16" if h.dtype == torch.bfloat16 else "fp32"


def attention_block(h: torch.Tensor, params: AttentionParams, cos: torch.Tensor, sin: torch.Tensor,
                    meta: AttentionMeta) -> torch.Tensor | None:
    """h + the attention block's output, as one autograd node, or None where it does not apply."""
    if not attention_applies(h, params, cos):
        return None
    CALLS[f"attention {_dtype_name(h)}"] += 1
    return _AttentionBlock.apply(h, cos, sin, meta, params, *params[:7])


def mlp_block(h2: torch.Tensor, params: MLPParams) -> torch.Tensor | None:
    """h2 + the dense MLP block's output, as one autograd node, or None where it does not apply."""
    if not mlp_applies(h2, params):
        return None
    CALLS[f"mlp {_dtype_name(h2)}"] += 1
    return _MLPBlock.apply(h2, params, *params[:4])
