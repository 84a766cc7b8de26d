"""Copies of a weight that the CPU's invariant linear multiplies instead of the weight itself
(rzero/ops/invariant.py): a oneDNN-prepacked bf16 copy, the bf16 panels of our own GEMM, an fp32
(N, K) copy and fp32 column panels. Each is kept beside its weight for callers that want no
gradient (the engine, scoring), and made again whenever the weight changes in place (its version
counter moves: an optimizer step, `Engine.update_weights`); a weight in training changes every
step and gets a fresh copy per pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from rzero.ops import cpu_kernel

# id(weight) -> (weakref to it, its version and data pointer when packed, the packed copy). Kept
# beside the weight, not on it: the packed copy is an opaque oneDNN tensor that cannot be copied.
PREPACKED: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}


def prepacked(weight: torch.Tensor, row_tile: int) -> torch.Tensor | None:
    """The weight's oneDNN-packed copy: built on first use, again whenever the weight changes (an
    in-place load moves its version counter), dropped with the weight. None for a tensor that has
    no version counter (made under inference mode)."""
    try:
        version = weight._version
    except RuntimeError:
        return None
    key = id(weight)
    entry = PREPACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1:3] != (version, weight.data_ptr()):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), row_tile)
        ref = weakref.ref(weight, lambda _, key=key: PREPACKED.pop(key, None))
        entry = PREPACKED[key] = (ref, version, weight.data_ptr(), packed)
    return entry[3]


# (what, id of the weight's storage owner, data pointer, shape, strides) -> (weakref to the owner,
# its version when made, the copy). Keyed by the view, not the tensor object: the MoE experts'
# weights are fresh views of one stacked tensor on every call.
COPIES: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}


def _kept_beside(weight: torch.Tensor, may_cache: bool, what: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make() (a copy of the bf16 weight in another layout or dtype), kept beside the weight when
    no gradient is wanted (the engine): built on first use and again whenever the weight changes
    (its version counter moves)."""
    if not may_cache:
        return make()
    try:
        version = weight._version
    except RuntimeError:  # made under inference mode: no version counter to watch
        return make()
    owner = weight if weight._base is None else weight._base
    key = (what, id(owner), weight.data_ptr(), tuple(weight.shape), weight.stride())
    entry = COPIES.get(key)
    if entry is None or entry[0]() is not owner or entry[1] != version:
        ref = weakref.ref(owner, lambda _, key=key: COPIES.pop(key, None))
        entry = COPIES[key] = (ref, version, make())
    return entry[2]


def kernel_panels(weight: torch.Tensor, may_cache: bool) -> torch.Tensor:
    """The bf16 weight in the layout of our own bf16 GEMM (rzero/ops/cpu_kernel.py, bf16_pack)."""
    return _kept_beside(weight, may_cache, "kernel", lambda: cpu_kernel.bf16_pack(weight))


def f32_kernel_panels(weight: torch.Tensor, may_cache: bool) -> torch.Tensor:
    """The fp32 weight in the layout of rzero's fp32 GEMM (rzero/ops/cpu_layer.py, f32_pack)."""
    from rzero.ops.cpu_layer import f32_pack  # (cpu_layer imports this module)

    return _kept_beside(weight, may_cache, "f32 kernel", lambda: f32_pack(weight))


def widened(weight: torch.Tensor, may_cache: bool) -> torch.Tensor:
    """The bf16 weight as a contiguous (N, K) fp32 tensor, the layout of an fp32 model's weight (it
    decides the fp32 GEMM's bits)."""
    return _kept_beside(weight, may_cache, "rows", lambda: weight.to(torch.float32, memory_format=torch.contiguous_format))


def panels(weight: torch.Tensor, may_cache: bool, width: int) -> torch.Tensor:
    """The (N, K) bf16 weight widened into (C, K, width) fp32 column panels of its (K, N)
    transpose, the last one zero-padded; at least two (a zero panel beside a single one), because a
    batched GEMM of one problem splits it across threads, which changes its bits."""
    def make() -> torch.Tensor:
        n, k = weight.shape
        full, rest = divmod(n, width)
        out = torch.zeros(max(2, full + (rest > 0)), k, width, dtype=torch.float32, device=weight.device)
        by_row = out.permute(1, 0, 2)  # (K, C, width) view
        wt = weight.t()
        by_row[:, :full].copy_(wt[:, : full * width].view(k, full, width))
        if rest:
            by_row[:, full, :rest].copy_(wt[:, full * width :])
        return out

    return _kept_beside(weight, may_cache, "panels", make)
