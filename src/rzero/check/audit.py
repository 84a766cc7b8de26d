"""The C0 numerics audit: record every aten op a forward pass runs and find stock reductions.

`AtenRecorder` is a `TorchDispatchMode`: it sees each aten op after autograd and after
composite ops are decomposed (so `F.linear` shows up as `aten.mm`/`aten.addmm`, `torch.softmax`
as `aten._softmax`, SDPA as `aten._scaled_dot_product_flash_attention_for_cpu`). For every
floating-point reduction or matmul it asks `ops.inside_op()` (answered while an
`ops.trace_dispatch` block records: use the recorder inside one): inside an rzero op the kernel is
rzero's own choice (invariant or standard, which the `ops.trace_dispatch` counter tells apart);
outside one it is a stock kernel leaking into the forward pass, whose summation order depends on
the batch.

Only the forward pass is audited: the recorder has a `phase`, and ops run while it is not
"forward" (the loss reduction, the autograd backward, activation recomputation) are counted but
never flagged.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rzero import ops

# aten overload packets (trailing "_" of in-place variants stripped) whose result depends on a
# floating-point summation order (matmuls, sums, scans, norms, softmax, attention, scatter-adds)
# or is a reduction over a dimension (max/min: exact, but still a reduction rzero must own).
REDUCTION_OPS = frozenset(
    {
        # matmul family
        "mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "matmul", "dot", "vdot",
        "mv", "addmv", "linear", "einsum", "tensordot", "_int_mm", "_weight_int4pack_mm",
        "_weight_int8pack_mm", "convolution", "_convolution", "chain_matmul", "linalg_multi_dot",
        # sums and scans
        "sum", "nansum", "mean", "nanmean", "prod", "cumsum", "cumprod", "logcumsumexp", "trace",
        "logsumexp", "var", "std", "var_mean", "std_mean",
        # max/min-style reductions (the elementwise binary overloads are excluded below)
        "amax", "amin", "max", "min", "aminmax",
        # softmax and norms
        "softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "norm",
        "linalg_vector_norm", "linalg_norm", "frobenius_norm", "native_layer_norm",
        "native_group_norm", "native_batch_norm", "_native_batch_norm_legit", "rms_norm",
        "_fused_rms_norm", "renorm", "_weight_norm_interface", "cdist", "_cdist_forward", "dist",
        # attention kernels
        "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward",
        # scatter-adds (accumulation order is the scatter order)
        "index_add", "scatter_add", "scatter_reduce", "index_reduce", "embedding_bag",
        "_embedding_bag", "_embedding_bag_forward_only", "segment_reduce", "histc",
        # losses (each ends in a reduction)
        "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss", "kl_div",
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "cross_entropy_loss",
        "huber_loss", "smooth_l1_loss",
    }
)
# Overloads of max/min that are elementwise (two tensors) rather than reductions.
_ELEMENTWISE_OVERLOADS = {("max", "other"), ("min", "other"), ("max", "out"), ("min", "out")}


def _is_float_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def is_float_reduction(func, args, kwargs) -> bool:
    """True for an aten op whose numerics depend on a reduction order, on floating-point input."""
    name = func.overloadpacket.__name__
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    if base in ("index_put", "_index_put_impl"):  # only the accumulating form adds
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        if not accumulate:
            return False
    elif base not in REDUCTION_OPS or (base, func._overloadname) in _ELEMENTWISE_OVERLOADS:
        return False
    flat = list(args) + list(kwargs.values())
    for a in flat:
        if _is_float_tensor(a):
            return True
        if isinstance(a, (list, tuple)) and any(_is_float_tensor(t) for t in a):
            return True
    return False


class AtenRecorder(TorchDispatchMode):
    """Counts aten ops; flags floating-point reductions run outside rzero ops in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.leaks: Counter[str] = Counter()  # forward reductions outside rzero ops, by aten op
        self.owned: Counter[str] = Counter()  # forward reductions inside rzero ops, by aten op
        self.other_phases: Counter[str] = Counter()  # ops seen outside the forward (ignored)
        self.num_forward_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase != "forward":
            self.other_phases[self.phase] += 1
        else:
            self.num_forward_ops += 1
            if is_float_reduction(func, args, kwargs):
                key = str(func)
                if ops.inside_op():
                    self.owned[key] += 1
                else:
                    self.leaks[key] += 1
        return func(*args, **kwargs)
