"""A dense decoder layer of a bf16 model in one C call, for the engine's steps on CPUs where its
linears run on rzero's own bf16 GEMM (gemm_route.on_kernel): csrc/kernels.c, rz_decoder_layer.

Why: on a small model an engine step's layer is a dozen short kernels, and the Python between
them (module calls, op wrappers, checks, views, allocations, torch's elementwise ops) cost about
as much as the kernels (docs/benchmarks.md, sixteenth session). The call runs the very kernels
the layer's ops run one by one, on the same rows in the same order, and torch's bf16 residual
adds and SwiGLU written out with torch's bits, so the result is the same to the bit. Those
elementwise bits are torch's, not ours: `elementwise_proven` checks them against this torch on
every bf16 input once per process, and where they differ (another torch, another CPU) the layer
runs op by op. tests/test_cpu_layer.py holds the two compositions to one another, and `rzero
check` holds the engine to the trainer, which never runs this path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from rzero.ops import cpu_kernel, weight_copies
from rzero.ops.attention_meta import AttentionMeta
from rzero.ops.gemm_route import on_kernel
from rzero.ops.invariant_rows import ELEMENTWISE_TILE, silu_mul
from rzero.ops.scratch import scratch


@dataclass(eq=False)
class DenseLayerWeights:
    """A dense Qwen3 decoder layer's weights, q/k/v and gate/up each one packed (N, K) tensor, as
    the model hands them to `Numerics.decoder_layer`. `sources`: the modules whose `weight`
    parameters these are or are views of; `current()` says whether they still are, at the same
    addresses (a cast or a reassigned parameter makes the model build a new one). The C call's
    arguments are kept with it (`plan`), so a step only fills in what changes."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_sizes: list[int]
    down: torch.Tensor
    eps: float  # every norm's (one config value)
    sources: tuple[nn.Module, ...] = ()
    plan: _Plan | None | bool = field(default=None, init=False, repr=False)  # False: the C layer does not apply
    _watched: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self._watched = [(m._parameters, m._parameters["weight"], m._parameters["weight"].data_ptr()) for m in self.sources]

    def current(self) -> bool:
        return all(params["weight"] is weight and weight.data_ptr() == ptr for params, weight, ptr in self._watched)


def _bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.rz_decoder_layer.argtypes is None:
        ptr = ctypes.c_void_p
        lib.rz_decoder_layer.argtypes = [ptr, ptr, ctypes.c_float, ctypes.c_float, ctypes.c_int]
        lib.rz_layer_elementwise.argtypes = [ptr, ctypes.c_int64, ctypes.c_int64, ptr, ptr, ptr, ctypes.c_int64, ptr]
        lib.rz_layer_elementwise.restype = None
    return lib


@functools.lru_cache(maxsize=None)
def elementwise_proven(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the C layer's silu(gate) * up and residual add give torch's bits here, on every
    bf16 value: each of the 65536 as the gate (rows of ELEMENTWISE_TILE, as the MLP's are), and
    as one side of a sum and a product with values that round both ways. `lib`: another build of
    the kernels (tests); default `cpu_kernel.library()`."""
    lib = lib or cpu_kernel.library()
    if lib is None:
        return False
    _bound(lib)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    other = (torch.randn(1 << 16, generator=gen) * torch.exp2(torch.randint(-20, 20, (1 << 16,), generator=gen))).bfloat16()
    width = ELEMENTWISE_TILE
    gu = torch.cat((every.view(-1, width), other.view(-1, width)), dim=1).contiguous()
    act, total = torch.empty(gu.shape[0], width, dtype=torch.bfloat16), torch.empty_like(every)
    lib.rz_layer_elementwise(gu.data_ptr(), gu.shape[0], width, act.data_ptr(), every.data_ptr(), other.data_ptr(),
                             every.numel(), total.data_ptr())
    with torch.inference_mode():
        gate, up = gu.split_with_sizes([width, width], dim=-1)
        return torch.equal(act.view(torch.int16), silu_mul(gate, up).view(torch.int16)) and torch.equal(
            total.view(torch.int16), (every + other).view(torch.int16)
        )


def _weights_apply(w: DenseLayerWeights) -> bool:
    """Whether every op of a layer with these weights runs what the C layer runs (checked once per
    weights): the C library is built and its elementwise ops proven, every weight is a bf16 CPU
    tensor, every linear on our GEMM, the gate and up halves as wide as the MLP and that width a
    multiple of ELEMENTWISE_TILE (torch's silu then has no scalar tail)."""
    tensors = (w.input_norm, w.qkv, w.q_norm, w.k_norm, w.o, w.post_norm, w.gate_up, w.down)
    return (
        all(t.dtype == torch.bfloat16 and t.is_cpu for t in tensors)
        and all(on_kernel(weight) for weight in (w.qkv, w.o, w.gate_up, w.down))
        and w.gate_up_sizes[0] == w.gate_up_sizes[1] == w.down.shape[1] and w.down.shape[1] % ELEMENTWISE_TILE == 0
        and elementwise_proven()
    )


def _inputs_apply(h: torch.Tensor, w: DenseLayerWeights, cos: torch.Tensor, sin: torch.Tensor, cache) -> bool:
    """Per call: bf16 CPU inputs and caches, contiguous, no gradient wanted, an even head size (the
    rotary kernel's)."""
    k_cache, v_cache = cache
    tensors = (h, cos, sin, k_cache, v_cache)
    return (
        all(t.dtype == torch.bfloat16 and t.is_cpu for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, w.qkv, w.o, w.gate_up, w.down)))
        and h.dim() == 2 and h.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        and k_cache.shape[-1] % 2 == 0
    )


# rz_decoder_layer's arguments, in the order of csrc/kernels.c's LD_* and LP_* names
_DIMS = ("tokens", "rows", "hidden", "heads", "kv_heads", "head_dim", "block", "table_stride", "qkv_n", "width")
_PTRS = ("h", "input_norm", "qkv", "q_norm", "k_norm", "cos", "sin", "slots", "k_cache", "v_cache", "tables", "seq",
         "pos", "o", "post_norm", "gate_up", "down", "out", "work")
# those that change from call to call, filled in by _Plan.run in this order
_STEP_DIMS = [_DIMS.index(n) for n in ("tokens", "rows", "heads", "kv_heads", "head_dim", "block", "table_stride")]
_STEP_PTRS = [_PTRS.index(n) for n in ("h", "cos", "sin", "slots", "k_cache", "v_cache", "tables", "seq", "pos", "out",
                                       "work")]


class _Plan:
    """rz_decoder_layer's argument arrays for one layer's weights: the weights' pointers written
    once, their GEMM layouts again whenever a weight changes in place (its version moves:
    Engine.update_weights), the step's tensors on every call."""

    def __init__(self, w: DenseLayerWeights):
        self.lib = _bound(cpu_kernel.library())
        self.weights = w
        self.dims = (ctypes.c_int64 * len(_DIMS))()
        self.ptrs = (ctypes.c_int64 * len(_PTRS))()
        self.dims_at, self.ptrs_at = ctypes.addressof(self.dims), ctypes.addressof(self.ptrs)
        for name in ("input_norm", "q_norm", "k_norm", "post_norm"):
            self.ptrs[_PTRS.index(name)] = getattr(w, name).data_ptr()
        self.dims[_DIMS.index("hidden")], self.dims[_DIMS.index("qkv_n")] = w.o.shape[0], w.qkv.shape[0]
        self.dims[_DIMS.index("width")] = w.down.shape[1]
        self.versions: tuple[int, ...] = ()
        self.panels: tuple[torch.Tensor, ...] = ()

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta, cache, scale: float):
        w, dims, ptrs = self.weights, self.dims, self.ptrs
        linears = (w.qkv, w.o, w.gate_up, w.down)
        versions = tuple(weight._version for weight in linears)
        if versions != self.versions:
            self.panels = tuple(weight_copies.kernel_panels(weight, True) for weight in linears)
            for name, panel in zip(("qkv", "o", "gate_up", "down"), self.panels):
                ptrs[_PTRS.index(name)] = panel.data_ptr()
            self.versions = versions
        k_cache, v_cache = cache
        rows, hidden = h.shape
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        heads = w.qkv.shape[0] // head_dim - 2 * kv_heads
        tables, seq, pos = cpu_kernel._token_index(meta)
        cos, sin = cos.contiguous(), sin.contiguous()  # (rows, 1, head_dim): rows of the rotary table
        width = w.down.shape[1]
        work = scratch("decoder_layer", -(-rows * (3 * hidden + w.qkv.shape[0] + 2 * heads * head_dim + 3 * width) // 2))
        out = torch.empty_like(h)
        for i, value in zip(_STEP_DIMS, (meta.num_tokens, rows, heads, kv_heads, head_dim, k_cache.shape[1], tables.shape[1])):
            dims[i] = value
        for i, t in zip(_STEP_PTRS, (h, cos, sin, meta.slot_mapping, k_cache, v_cache, tables, seq, pos, out, work)):
            ptrs[i] = t.data_ptr()
        cpu_kernel._check(self.lib.rz_decoder_layer(self.dims_at, self.ptrs_at, w.eps, scale, torch.get_num_threads()))
        return out


def decoder_layer(
    h: torch.Tensor, w: DenseLayerWeights, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta,
    cache: tuple[torch.Tensor, torch.Tensor], scale: float,
) -> torch.Tensor | None:
    """h (padded tokens, hidden) through the layer: h2 = h + attention(norm(h)) Wo, then
    h2 + down(silu(gate) * up) of norm(h2), the keys and values written into `cache`; None where
    the C layer does not apply, and the caller runs the layer's ops."""
    if w.plan is None:
        w.plan = _Plan(w) if _weights_apply(w) else False
    if w.plan is False or not _inputs_apply(h, w, cos, sin, cache):
        return None
    return w.plan.run(h, cos, sin, meta, cache, scale)
