"""`Numerics`: one numerics mode's ops, the only floating-point code the model and engine call.

Two modes; every `Engine` and `Trainer` is given one at construction (and its model copy holds
it), so engines of different modes can run side by side in one process:

- ``invariant``: each row's result is bitwise independent of batch size, batch position, batch
  neighbours, padding, and (for attention) of prefill vs decode vs chunked prefill.
- ``standard``: the fastest stock PyTorch path a typical stack would use. It is the control.

Model and engine code call only these methods; never `F.linear`, `torch.softmax` or
`scaled_dot_product_attention` directly. Every call is counted in the dispatch trace that the C0
numerics audit reads (`trace_dispatch`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from rzero.ops import invariant as _invariant
from rzero.ops import sampling as _sampling
from rzero.ops import standard as _standard
from rzero.ops.attention_meta import AttentionMeta, DecodeBatch
from rzero.ops.cpu_layer import DenseLayerWeights
from rzero.ops.sampling import SamplingTransform
from rzero.ops.train_layer import AttentionParams, MLPParams

NUMERICS_MODES = ("invariant", "standard")

_trace: Counter | None = None  # the C0 audit's call counter, when one is recording
_inside = threading.local()  # depth of rzero-op calls on this thread (the C0 audit reads it)


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
    """True while this thread is executing an rzero op (used to find stock kernels leaking in).
    Kept only while a `trace_dispatch` block records (the C0 audit runs inside one): elsewhere
    the bookkeeping would cost every op call, about 60 per engine step, for nobody."""
    return getattr(_inside, "depth", 0) > 0


def _op(method: Callable) -> Callable:
    """Count the call in the dispatch trace and mark the thread as inside an rzero op."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Numerics, *args, **kwargs):
        if _trace is None:
            return method(self, *args, **kwargs)
        _trace[f"{self.mode}.{name}"] += 1
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _inside.depth -= 1

    return wrapper


class Numerics:
    """The ops of one numerics mode. Use `numerics("invariant")` (or `INVARIANT` / `STANDARD`)."""

    def __init__(self, mode: str):
        if mode not in NUMERICS_MODES:
            raise ValueError(f"unknown numerics mode {mode!r}; choose one of {', '.join(NUMERICS_MODES)}")
        self.mode = mode
        self._impl = _invariant if mode == "invariant" else _standard
        # A forward pass pads its token rows to a multiple of this once, up front (AttentionMeta),
        # so that no op inside the model has to copy its input to pad it.
        self.row_tile: int = self._impl.ROW_TILE

    def _on(self, x: torch.Tensor):
        """The kernels for x's device: under `invariant`, CUDA tensors take the Triton kernels
        (rzero/ops/cuda_invariant.py), imported on first use so the CPU path never needs triton.
        `standard` is stock PyTorch on every device (cuBLAS and SDPA on CUDA)."""
        if self._impl is _invariant and x.is_cuda:
            from rzero.ops import cuda_invariant

            return cuda_invariant
        return self._impl

    def __repr__(self) -> str:
        return f"Numerics({self.mode!r})"

    # One object per mode: copies of a model (deepcopy, pickle) keep pointing at it.
    def __deepcopy__(self, memo) -> Numerics:
        return self

    def __reduce__(self):
        return numerics, (self.mode,)

    @_op
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T over the last dim of x (no bias: Qwen3 has none)."""
        return self._on(x).linear(x, weight)

    @_op
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._on(x).rms_norm(x, weight, eps)

    @_op
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (the SwiGLU activation)."""
        return self._on(gate).silu_mul(gate, up)

    @_op
    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (rotate-half convention) of x (T, H, D) by cos, sin (T, 1, D);
        elementwise, the same bits in both modes (`invariant` on the CPU runs it as one C pass)."""
        if self._impl is _invariant and x.device.type == "cpu":
            return _invariant.apply_rotary(x, cos, sin)
        return _standard.apply_rotary(x, cos, sin)

    @_op
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """log_softmax over the last dim, computed in fp32."""
        return self._on(x).log_softmax(x)

    @_op
    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        """softmax over the last dim, computed in fp32."""
        return self._on(x).softmax(x)

    @_op
    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float
    ) -> torch.Tensor:
        """Causal attention of flat queries q (T, H, D) over paged K/V caches.

        The caches hold (num_blocks, ATTN_BLOCK, Hkv, D) and already contain the keys and values
        of the query tokens themselves (the caller writes them first). GQA when H > Hkv.
        """
        return self._on(q).attention(q, k_cache, v_cache, meta, scale)

    @_op
    def cached_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        eps: float, cos: torch.Tensor, sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMeta, scale: float,
    ) -> torch.Tensor:
        """An engine step's attention: RMSNorm (q_weight, k_weight) and rotary of the queries q
        (T, H, D) and keys k (T, Hkv, D), the keys and values v written into the paged `cache` at
        meta.slot_mapping, then `attention`. Invariant numerics on the CPU run it as one C call
        with the bits of these ops one by one (fewer calls and tensors, rzero/ops/cpu_kernel.py)."""
        fused = getattr(self._on(q), "cached_attention", None)
        out = None if fused is None else fused(q, k, v, q_weight, k_weight, eps, cos, sin, cache, meta, scale)
        if out is not None:
            return out
        q, k = self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps)
        q, k = self.apply_rotary(q, cos, sin), self.apply_rotary(k, cos, sin)
        k_cache, v_cache = cache
        real = meta.num_tokens
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k[:real])
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v[:real])
        return self.attention(q, k_cache, v_cache, meta, scale)

    @_op
    def decoder_layer(
        self, h: torch.Tensor, weights: DenseLayerWeights, cos: torch.Tensor, sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMeta, scale: float,
    ) -> torch.Tensor | None:
        """An engine step through a dense decoder layer (its `weights`), where this numerics has it
        in one call with the bits of the layer's ops one by one (invariant numerics on the CPU, bf16
        or fp32: rzero/ops/cpu_layer.py); None elsewhere, and the caller runs the ops."""
        fused = getattr(self._on(h), "decoder_layer", None)
        return None if fused is None else fused(h, weights, cos, sin, meta, cache, scale)

    @_op
    def decoder_stack(
        self, ids: torch.Tensor, meta: AttentionMeta, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        layers: list[DenseLayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]],
        norm: tuple[torch.Tensor, float], scale: float,
    ) -> torch.Tensor | None:
        """An engine step's whole backbone for the padded token ids: embeddings, the dense `layers`
        with their caches, the final norm (weight, eps), in one call with the bits of the layers
        one by one where this numerics has it (invariant numerics on the CPU:
        rzero/ops/cpu_stack.py); None elsewhere, and the caller runs the layers."""
        fused = getattr(self._on(embed), "decoder_stack", None)
        return None if fused is None else fused(ids, meta, embed, rope, layers, caches, norm, scale)

    @_op
    def decode_steps(
        self, batch: DecodeBatch, caches: list[tuple[torch.Tensor, torch.Tensor]], lm_head: torch.Tensor,
        embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layers: list[DenseLayerWeights],
        norm: tuple[torch.Tensor, float], scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Up to batch.uniform.shape[0] engine decode steps of its sequences (backbone, LM head,
        temperature, log_softmax, the draw), each with the bits of the steps one by one, in one call
        where this numerics has it (invariant numerics on the CPU: rzero/ops/cpu_stack.py): tokens
        and logprobs (steps, B), valid below each row's count, and the counts (B,); None elsewhere,
        and the caller runs the steps."""
        fused = getattr(self._on(embed), "decode_steps", None)
        return None if fused is None else fused(batch, self.row_tile, lm_head, embed, rope, layers, caches, norm, scale)

    @_op
    def train_attention(
        self, h: torch.Tensor, params: AttentionParams, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta
    ) -> torch.Tensor | None:
        """h + a decoder layer's attention block (its `params`) for a training forward (whole
        sequences, gradients wanted) as one autograd node, with the bits of the block's ops one by
        one and their gradients (invariant numerics on the CPU: rzero/ops/train_layer.py); None
        elsewhere, and the caller runs the ops."""
        fused = getattr(self._on(h), "train_attention", None)
        return None if fused is None else fused(h, params, cos, sin, meta)

    @_op
    def train_mlp(self, h: torch.Tensor, params: MLPParams) -> torch.Tensor | None:
        """h + a dense MLP block (its `params`, the post-attention norm first) as one autograd
        node, as `train_attention`; None where it does not apply."""
        fused = getattr(self._on(h), "train_mlp", None)
        return None if fused is None else fused(h, params)

    @_op
    def moe_route(self, router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert choice: returns (weights (T, k) fp32, expert ids (T, k))."""
        return self._on(router_logits).moe_route(router_logits, top_k, normalize)

    @_op
    def moe_combine(self, expert_outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum over the k expert outputs (T, k, H) with weights (T, k) -> (T, H)."""
        return self._on(expert_outputs).moe_combine(expert_outputs, weights)

    # The sampling transform sorts, scans and normalises: it is an op like the others.
    @_op
    def transformed_logprobs(self, logits: torch.Tensor, transform: SamplingTransform) -> torch.Tensor:
        """(N, V) logits -> (N, V) fp32 logprobs of the distribution `transform` samples from."""
        return _sampling.transformed_logprobs(self, logits, transform)

    @_op
    def sample_tokens(
        self, logprobs: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | _sampling.UniformStream | None]
    ) -> torch.Tensor:
        """One token per row (inverse CDF at a uniform from each row's own generator or stream of
        its uniforms; argmax for greedy rows)."""
        return _sampling.sample_tokens(logprobs, greedy, generators)


INVARIANT = Numerics("invariant")
STANDARD = Numerics("standard")


def numerics(mode: str | Numerics) -> Numerics:
    """The `Numerics` of a mode name ("invariant" or "standard"); a `Numerics` is returned as is."""
    if isinstance(mode, Numerics):
        return mode
    if mode == "invariant":
        return INVARIANT
    if mode == "standard":
        return STANDARD
    return Numerics(mode)  # raises the error that names the valid modes
