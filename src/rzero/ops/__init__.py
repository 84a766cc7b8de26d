"""All floating-point numerics of rzero, behind one switch: a `Numerics` object per mode.

`numerics("invariant")` and `numerics("standard")` give the two modes' ops (rzero/ops/numerics.py
says what each guarantees). There is no process-wide mode: an `Engine` or a `Trainer` is given
its numerics at construction and hands it to its model copy, so both modes can run side by side.
"""

from rzero.ops.attention_meta import ATTN_BLOCK, AttentionMeta, DecodeBatch, private_cache
from rzero.ops.cpu_layer import DenseLayerWeights
from rzero.ops.device import DEVICE_NAMES, resolve_device
from rzero.ops.layout import joined, packed
from rzero.ops.numerics import INVARIANT, NUMERICS_MODES, STANDARD, Numerics, inside_op, numerics, trace_dispatch
from rzero.ops.sampling import SamplingTransform
from rzero.ops.train_layer import AttentionParams, MLPParams

__all__ = [
    "ATTN_BLOCK",
    "DEVICE_NAMES",
    "INVARIANT",
    "NUMERICS_MODES",
    "STANDARD",
    "AttentionMeta",
    "AttentionParams",
    "DecodeBatch",
    "DenseLayerWeights",
    "MLPParams",
    "Numerics",
    "SamplingTransform",
    "inside_op",
    "numerics",
    "joined",
    "packed",
    "private_cache",
    "resolve_device",
    "trace_dispatch",
]
