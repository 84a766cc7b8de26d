"""All floating-point numerics of rzero, behind one switch.

Two modes, chosen once per process (`set_numerics`) and recorded with every run:

- ``invariant``: each row's result is bitwise independent of batch size, batch position, batch
  neighbours, padding, and (for attention) of prefill vs decode vs chunked prefill.
- ``standard``: the fastest stock PyTorch path a typical stack would use. It is the control.

Model and engine code call only the functions exported here; never `F.linear`, `torch.softmax`
or `scaled_dot_product_attention` directly. Every call is counted in the dispatch trace that the
C0 numerics audit reads (`trace_dispatch`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from rzero.ops import invariant as _inv
from rzero.ops import standard as _std
from rzero.ops.attention_meta import ATTN_BLOCK, AttentionMeta
from rzero.ops import sampling as _sampling
from rzero.ops.sampling import SamplingTransform

NUMERICS_MODES = ("invariant", "standard")
ROW_TILE = _inv.ROW_TILE

_mode: str = "invariant"
_impl = _inv
_trace: Counter | None = None
_inside = threading.local()  # depth of rzero-op calls on this thread (the C0 audit reads it)


def set_numerics(mode: str) -> None:
    """Choose the numerics mode for this process."""
    global _mode, _impl
    if mode not in NUMERICS_MODES:
        raise ValueError(f"unknown numerics mode {mode!r}; choose one of {NUMERICS_MODES}")
    _mode, _impl = mode, (_inv if mode == "invariant" else _std)


def get_numerics() -> str:
    return _mode


@contextlib.contextmanager
def numerics(mode: str) -> Iterator[None]:
    """Temporarily switch the numerics mode (tests and the checklist compare both)."""
    previous = _mode
    set_numerics(mode)
    try:
        yield
    finally:
        set_numerics(previous)


@contextlib.contextmanager
def trace_dispatch() -> Iterator[Counter]:
    """Count every rzero op called inside the block, by `mode.op` name (C0 reads this)."""
    global _trace
    previous, _trace = _trace, Counter()
    try:
        yield _trace
    finally:
        _trace = previous


def inside_op() -> bool:
    """True while this thread is executing an rzero op (used to find stock kernels leaking in)."""
    return getattr(_inside, "depth", 0) > 0


def _op(fn: Callable) -> Callable:
    """Count the call in the dispatch trace and mark the thread as inside an rzero op."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _trace is not None:
            _trace[f"{_mode}.{name}"] += 1
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth -= 1

    return wrapper


def padded_rows(num_rows: int) -> int:
    """Rows a forward pass should run for num_rows tokens: invariant mode pads to ROW_TILE once,
    up front, so that no op inside the model has to copy its input to pad it."""
    return _impl.padded_rows(num_rows)


@_op
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T over the last dim of x (no bias: Qwen3 has none)."""
    return _impl.linear(x, weight)


@_op
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl.rms_norm(x, weight, eps)


@_op
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (the SwiGLU activation)."""
    return _impl.silu_mul(gate, up)


@_op
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention); elementwise, identical in both modes."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@_op
def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, computed in fp32."""
    return _impl.log_softmax(x)


@_op
def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, computed in fp32."""
    return _impl.softmax(x)


@_op
def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMeta,
    scale: float,
) -> torch.Tensor:
    """Causal attention of flat queries q (T, H, D) over paged K/V caches.

    The caches hold (num_blocks, ATTN_BLOCK, Hkv, D) and already contain the keys and values of
    the query tokens themselves (the caller writes them first). GQA when H > Hkv.
    """
    return _impl.attention(q, k_cache, v_cache, meta, scale)


@_op
def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert choice: returns (weights (T, k) fp32, expert ids (T, k))."""
    return _impl.moe_route(router_logits, top_k, normalize)


@_op
def moe_combine(expert_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the k expert outputs (T, k, H) with weights (T, k) -> (T, H)."""
    return _impl.moe_combine(expert_outputs, weights)


# The sampling transform sorts, scans and normalises: it is an op like the others.
transformed_logprobs = _op(_sampling.transformed_logprobs)
sample_tokens = _op(_sampling.sample_tokens)

__all__ = [
    "ATTN_BLOCK",
    "NUMERICS_MODES",
    "ROW_TILE",
    "AttentionMeta",
    "SamplingTransform",
    "apply_rotary",
    "attention",
    "get_numerics",
    "inside_op",
    "linear",
    "log_softmax",
    "moe_combine",
    "moe_route",
    "numerics",
    "padded_rows",
    "rms_norm",
    "sample_tokens",
    "set_numerics",
    "silu_mul",
    "softmax",
    "trace_dispatch",
    "transformed_logprobs",
]
