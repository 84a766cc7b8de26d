"""Batch-invariant row and elementwise ops for the CPU: RMSNorm, softmaxes, SwiGLU, rotary, MoE
routing. Part of the invariant numerics (rzero/ops/invariant.py: the linear layers and the
numerics' namespace; attention in rzero/ops/invariant_attention.py). Why each is invariant:

- rms_norm and log_softmax: our C kernels (rzero/ops/cpu_kernel.py), one fixed order per row, and
  for log_softmax our own exp and log (the same bits on every machine). Without a compiler, and
  for softmax: each row is reduced by one thread in a fixed vectorised order,
  unless there are fewer rows than threads and a row is longer than the reduction grain (32768);
  padding rows to ROW_TILE rules that out.
- elementwise transcendental ops (silu, sigmoid): the vectorised body and the scalar tail differ
  in the last bit, and which elements fall in the tail depends on the tensor's total size. We pad
  the flat size to a multiple of ELEMENTWISE_TILE so that no element is ever in a tail.
- rotary: products and a sum per element, no reduction; on the CPU one C pass that rounds each
  as torch's expression does (the same bits), instead of five tensor ops.
- attention: our C kernel (rzero/ops/cpu_kernel.py), or without a compiler the stock-op version
  of rzero/ops/invariant_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rzero.ops import cpu_kernel
from rzero.ops import standard as _standard

ROW_TILE = 16  # rows are padded to a multiple of this (the invariant linear's tile; rzero.ops.invariant)
ELEMENTWISE_TILE = 64  # two AVX-512 vectors of bf16


def _pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """View x as (rows, last) and pad rows to a multiple of ROW_TILE."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    pad = (-rows) % ROW_TILE
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    return x2.contiguous(), rows


class _RMSNorm(torch.autograd.Function):
    """The C kernel's forward (the engine's bits) and backward (plain RMSNorm math, in C too)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return cpu_kernel.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = cpu_kernel.rms_norm_backward(x, weight, ctx.eps, grad, *ctx.needs_input_grad[:2])
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if cpu_kernel.library() is not None and x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16):
        # One C pass per row instead of seven tensor ops (rzero/ops/cpu_kernel.py).
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _RMSNorm.apply(x, weight, eps)
        return cpu_kernel.rms_norm(x, weight, eps)
    # Stock ops (no C compiler): rows padded to ROW_TILE, see the module docstring.
    x2, rows = _pad_rows(x)
    xf = x2.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype))[:rows].reshape(x.shape)


class _Rotary(torch.autograd.Function):
    """The C kernel's forward; the backward is the torch expression's own gradient (grad * cos plus
    the rotated grad * sin), the bits autograd gives the expression, also in one C pass."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return cpu_kernel.rotary(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.dtype == cos.dtype:  # one C pass with the expression's bits (rzero/ops/cpu_kernel.py)
            return cpu_kernel.rotary_backward(grad, cos, sin), None, None
        half = grad.shape[-1] // 2
        through_sin = grad * sin
        return grad * cos + torch.cat((through_sin[..., half:], -through_sin[..., :half]), dim=-1), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: the C kernel (one pass, the torch expression's bits) where it applies, else
    the expression itself (rzero.ops.standard): no compiler, another layout or dtype, an odd
    head_dim, or tables that want a gradient (never the model's: they are fixed buffers)."""
    kernel_fits = (
        cpu_kernel.library() is not None and x.dim() == 3 and x.shape[-1] % 2 == 0
        and x.dtype == cos.dtype == sin.dtype and x.dtype in (torch.float32, torch.bfloat16)
    )
    grad = torch.is_grad_enabled()
    if not kernel_fits or (grad and (cos.requires_grad or sin.requires_grad)):
        return _standard.apply_rotary(x, cos, sin)
    return _Rotary.apply(x, cos, sin) if grad and x.requires_grad else cpu_kernel.rotary(x, cos, sin)


class _LogSoftmax(torch.autograd.Function):
    """The C kernel's forward; the backward is log_softmax's gradient, g - softmax * sum(g)."""

    @staticmethod
    def forward(ctx, x):
        out = cpu_kernel.log_softmax(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad - out.exp() * grad.sum(-1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    if cpu_kernel.library() is not None and x.is_cpu and x.numel():
        # rzero's own, one C pass per row: the same bits on every machine (rzero/ops/cpu_kernel.py)
        return _LogSoftmax.apply(x) if torch.is_grad_enabled() and x.requires_grad else cpu_kernel.log_softmax(x)
    x2, rows = _pad_rows(x)
    return torch.log_softmax(x2, dim=-1)[:rows].reshape(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    x2, rows = _pad_rows(x.float())
    return torch.softmax(x2, dim=-1)[:rows].reshape(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape[-1] % ELEMENTWISE_TILE == 0:
        # Rows of whole vectors (every preset's MLP width): no element can fall in a scalar tail,
        # whether the loop runs over the flat tensor or row by row over a strided column slice
        # (the gate of the joined gate/up GEMM), so no contiguous copy is needed.
        return F.silu(gate) * up
    # Otherwise flat and padded, so that the vectorised body and tail split the flat tensor at a
    # multiple of the tile, never inside a strided row.
    gate = gate.contiguous()
    n = gate.numel()
    pad = (-n) % ELEMENTWISE_TILE
    if not pad:
        return F.silu(gate) * up
    flat = F.pad(gate.reshape(-1), (0, pad))
    return F.silu(flat)[:n].reshape(gate.shape) * up


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
