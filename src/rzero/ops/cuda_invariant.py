"""The `invariant` numerics for CUDA tensors: the Triton kernels of rzero/ops/triton_kernels.py
behind the same functions as rzero/ops/invariant.py (the CPU kernels), with autograd.

`Numerics("invariant")` sends an op here when its input is on a CUDA device. Only the forward
has to be batch-invariant (it is what the engine and the trainer must agree on bit for bit); the
backward is ordinary PyTorch math (cuBLAS, autograd through a stock reference), which is correct
but not invariant, exactly as on the CPU.

Why the ops that stay stock PyTorch are invariant on CUDA: elementwise kernels (SwiGLU, rotary,
the MoE combine, casts) compute every element with the same per-element code whatever the
tensor's size (vectorised loads change how elements are fetched, not the arithmetic); sorting
and top-k are exact. Reductions never stay stock: matmuls, norms and softmaxes go to Triton, the
MoE weight normalisation is an explicit left-to-right sum over the k slots, and the sampler's
top-p scan runs one row at a time (rzero/ops/sampling.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rzero.ops import standard as _standard
from rzero.ops import triton_kernels as _tk
from rzero.ops.attention_meta import AttentionMeta
from rzero.ops.invariant import ROW_TILE, moe_combine  # noqa: F401  (moe_combine: elementwise, left to right)

__all__ = ["ROW_TILE", "attention", "linear", "log_softmax", "moe_combine", "moe_route", "rms_norm", "silu_mul", "softmax"]


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Linear(torch.autograd.Function):
    """Triton forward; the backward's two GEMMs are cuBLAS (gradients need not be invariant)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _tk.matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w


class _KernelWithReference(torch.autograd.Function):
    """Forward: `kernel(*inputs)`. Backward: autograd through `reference(*inputs)`, the same
    function in stock PyTorch, recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, kernel, reference, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(need) for x, need in zip(inputs, needs)]
            out = ctx.reference(*xs)
            wanted = [x for x in xs if x.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (None, None, *[next(grads) if x.requires_grad else None for x in xs])


def _apply(kernel, reference, *inputs: torch.Tensor) -> torch.Tensor:
    if _needs_grad(*inputs):
        return _KernelWithReference.apply(kernel, reference, *inputs)
    return kernel(*inputs)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if _needs_grad(x, weight):
        return _Linear.apply(x, weight)
    return _tk.matmul(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _apply(
        lambda x_, w_: _tk.rms_norm(x_, w_, eps), lambda x_, w_: _standard.rms_norm(x_, w_, eps), x, weight
    )


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return _apply(_tk.log_softmax, _standard.log_softmax, x)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return _apply(_tk.softmax, _standard.softmax, x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up  # elementwise: the same bits for an element whatever the tensor size


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
) -> torch.Tensor:
    return _apply(
        lambda q_, k_, v_: _tk.attention(q_, k_, v_, meta, scale),
        lambda q_, k_, v_: _standard.attention(q_, k_, v_, meta, scale),
        q, k_cache, v_cache,
    )


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = softmax(router_logits)
    # A stable sort breaks ties toward the lower expert id, whatever else is in the batch.
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if normalize:
        total = weights[:, 0]
        for slot in range(1, top_k):  # left to right: a stock sum's order may follow the batch shape
            total = total + weights[:, slot]
        weights = weights / total[:, None]
    return weights, experts
