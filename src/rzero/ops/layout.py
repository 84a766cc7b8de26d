"""How a model's weights are stored for `Numerics.linear`: several projections that read the same
input in one tensor (one GEMM instead of three), laid out the way the GEMM reads them fastest.

Both layouts give every output element the bits of the separate, (N, K)-stored projections
(tests/test_linear_layout.py probes it), so a packed engine and an unpacked trainer agree.
"""

from __future__ import annotations

import torch


def joined(weights: list[torch.Tensor]) -> torch.Tensor:
    """`weights` ((N_i, K) each, one K and dtype) stacked along N into one (sum N_i, K) tensor, in
    the layout `packed` gives it; differentiable, so a training forward also runs one GEMM (its
    backward hands each weight its rows of the gradient). bf16 is stored row-major (K, sum N_i)
    underneath: the invariant bf16 GEMM's operand (`invariant.gemm_operand`) without a copy;
    fp32 stays (N, K), the layout its bits are proven in."""
    if weights[0].dtype == torch.bfloat16:
        return torch.cat([w.t() for w in weights], dim=1).t()
    return torch.cat(weights)


def packed(weights: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`joined(weights)`, detached, and each weight as a view of it."""
    fused = joined([w.detach() for w in weights])
    return fused, list(fused.split([w.shape[0] for w in weights]))
