"""A dense decoder layer in one C call, for the engine's steps on the CPU (csrc/kernels.c,
rz_decoder_layer): bf16 models whose linears run on rzero's own bf16 GEMM (gemm_route.on_kernel),
and fp32 models whose weight shapes a probe proves for rzero's fp32 GEMM (`f32_kblock`).

Why: on a small model an engine step's layer is a dozen short kernels, and the Python between
them (module calls, op wrappers, checks, views, allocations, torch's elementwise ops) cost about
as much as the kernels (docs/benchmarks.md, sixteenth session). The call runs the very kernels
the layer's ops run one by one, on the same rows in the same order, and torch's residual adds and
SwiGLU written out with torch's bits, so the result is the same to the bit. Those elementwise
bits, and the fp32 GEMM's, are torch's, not ours: `elementwise_proven` and `f32_kblock` check them
against this process's torch once, and where they differ (another torch, another CPU) the layer
runs op by op. tests/test_cpu_layer.py holds the two compositions to one another, and `rzero
check` holds the engine to the trainer, which never runs this path.
"""

from __future__ import annotations

import ctypes
import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from rzero.ops import cpu_kernel, gemm_route, weight_copies
from rzero.ops.attention_meta import AttentionMeta
from rzero.ops.gemm_route import on_kernel
from rzero.ops.invariant_rows import ELEMENTWISE_TILE, silu_mul
from rzero.ops.scratch import scratch


# Layers run in one C call in this process, by dtype (`rzero check` reports them).
CALLS: Counter[str] = Counter()


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
    stack: object = field(default=None, init=False, repr=False)  # on a model's first layer: cpu_stack's arrays
    _watched: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self._watched = [(m._parameters, m._parameters["weight"], m._parameters["weight"].data_ptr()) for m in self.sources]

    def current(self) -> bool:
        return all(params["weight"] is weight and weight.data_ptr() == ptr for params, weight, ptr in self._watched)


def _bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.rz_decoder_layer.argtypes is None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rz_decoder_layer.argtypes = [ptr, ptr, ctypes.c_float, ctypes.c_float, ctypes.c_int]
        lib.rz_layer_elementwise.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, ptr]
        lib.rz_layer_elementwise.restype = None
        lib.rz_f32_pack.argtypes = [ptr, i64, i64, ptr]
        lib.rz_f32_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ctypes.c_int]
    return lib


def f32_pack(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """A contiguous fp32 weight (N, K) in rz_f32_gemm's layout: panels of 32 columns, k-major."""
    lib = _bound(lib or cpu_kernel.library())
    n, k = weight.shape
    out = torch.empty(-(-n // cpu_kernel.GEMM_COLUMNS) * cpu_kernel.GEMM_COLUMNS * k, dtype=torch.float32)
    weight = weight.detach().contiguous()
    cpu_kernel._check(lib.rz_f32_pack(weight.data_ptr(), n, k, out.data_ptr()))
    return out


def f32_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, kblock: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x (M, K) fp32 contiguous times the weight f32_pack packed (N = n), K summed in blocks of kblock."""
    lib = _bound(lib or cpu_kernel.library())
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    cpu_kernel._check(lib.rz_f32_gemm(x.data_ptr(), x.shape[0], x.shape[1], x.shape[1], packed.data_ptr(), n, kblock,
                                      out.data_ptr(), torch.get_num_threads()))
    return out


def _f32_fits(weight: torch.Tensor) -> bool:
    """An fp32 weight rz_f32_gemm takes: contiguous (N, K) on the CPU, below KERNEL_MAX elements
    (the tiny presets' shapes, where it was measured and checked)."""
    return weight.dtype == torch.float32 and weight.is_cpu and weight.is_contiguous() and weight.numel() < gemm_route.KERNEL_MAX


def own_gemm(x2: torch.Tensor, weight: torch.Tensor, may_cache: bool) -> torch.Tensor | None:
    """x2 (rows, K) times a small weight (N, K) on rzero's own GEMM, with the invariant linear's
    bits (`own_gemm_operand`); None: the invariant linear's tiles."""
    if weight.dtype == torch.bfloat16 and on_kernel(weight) and x2.dtype != torch.bfloat16:
        raise TypeError(f"invariant linear: input {x2.dtype} and weight {weight.dtype} must be of one dtype")
    operand = None if x2.dtype != weight.dtype else own_gemm_operand(weight, may_cache)
    if operand is None:
        return None
    if weight.dtype == torch.bfloat16:
        return cpu_kernel.bf16_gemm(x2, operand[0], weight.shape[0])
    return f32_gemm(x2, operand[0], weight.shape[0], operand[1])


def own_gemm_operand(weight: torch.Tensor, may_cache: bool) -> tuple[torch.Tensor, int] | None:
    """The packed weight and K block (0 for bf16) with which rzero's own GEMM multiplies a small
    weight (N, K) with the invariant linear's bits, or None where it does not: bf16 weights on the
    bf16 kernel where `on_kernel` (its bits are the definition there), fp32 contiguous weights
    below KERNEL_MAX on rz_f32_gemm where `f32_kblock` proves the 16-row tiles' bits (1.2-1.6x
    torch.mm here, 64-416 rows). `may_cache`: no gradient is wanted, so the packed copy is kept
    beside the weight."""
    if weight.dtype == torch.bfloat16 and on_kernel(weight):
        return weight_copies.kernel_panels(weight, may_cache), 0
    if not _f32_fits(weight) or cpu_kernel.library() is None:
        return None
    N, K = weight.shape
    kblock = f32_kblock(K, N, torch.get_num_threads())
    return None if kblock is None else (weight_copies.f32_kernel_panels(weight, may_cache), kblock)


@functools.lru_cache(maxsize=None)
def f32_kblock(K: int, N: int, threads: int) -> int | None:
    """The K block with which rz_f32_gemm gives an fp32 (N, K) weight's invariant linear exactly
    (the bits of torch.mm on 16-row tiles, `invariant._small_tiles`) on this many threads, or None:
    the grouping probe and random inputs, 16 and 64 rows, for each candidate in turn (MKL here: one
    block up to K = 192, two halves up to 384, blocks of 192 beyond; docs/numerics.md)."""
    from rzero.ops import invariant  # (invariant imports this module)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(K * 31 + N)
        cases = [tuple(t.float() for t in invariant.grouping_probe(64, K, N, seed=K + N)),
                 (torch.randn(64, K, generator=gen), torch.randn(N, K, generator=gen))]
        with torch.no_grad():
            wanted = [(x, w, [invariant._small_tiles(x[:rows], w.t()) for rows in (16, 64)]) for x, w in cases]
            for kblock in dict.fromkeys((K, 192, -(-K // 2), 128, 256, 96, 64)):
                if all(torch.equal(f32_gemm(x[:rows], f32_pack(w), N, kblock), out)
                       for x, w, outs in wanted for rows, out in zip((16, 64), outs)):
                    return kblock
        return None
    finally:
        torch.set_num_threads(previous)


@functools.lru_cache(maxsize=None)
def elementwise_proven(dtype: torch.dtype = torch.bfloat16, lib: ctypes.CDLL | None = None) -> bool:
    """Whether the C layer's silu(gate) * up and residual add in `dtype` give torch's bits here,
    bit for bit (NaNs included): every bf16 value (as the gate, and as one side of a sum and a
    product with values that round both ways), and for fp32 also random bit patterns and values of
    every magnitude. `lib`: another build of the kernels (tests); default `cpu_kernel.library()`."""
    lib = lib or cpu_kernel.library()
    if lib is None:
        return False
    _bound(lib)
    gen = torch.Generator().manual_seed(0)
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dtype)
    if dtype == torch.float32:
        bits = torch.randint(-(1 << 31), 1 << 31, (1 << 17,), generator=gen, dtype=torch.int64).to(torch.int32)
        scaled = torch.randn(1 << 17, generator=gen) * torch.exp2(torch.randint(-40, 40, (1 << 17,), generator=gen))
        values = torch.cat((values, bits.view(torch.float32), scaled))
    other = (torch.randn(values.numel(), generator=gen) * torch.exp2(torch.randint(-20, 20, (values.numel(),), generator=gen)))
    other = other.to(dtype)
    width = ELEMENTWISE_TILE
    gu = torch.cat((values.view(-1, width), other.view(-1, width)), dim=1).contiguous()
    act, total = torch.empty(gu.shape[0], width, dtype=dtype), torch.empty_like(values)
    lib.rz_layer_elementwise(dtype == torch.bfloat16, gu.data_ptr(), gu.shape[0], width, act.data_ptr(),
                             values.data_ptr(), other.data_ptr(), values.numel(), total.data_ptr())
    as_int = torch.int16 if dtype == torch.bfloat16 else torch.int32
    with torch.inference_mode():
        gate, up = gu.split_with_sizes([width, width], dim=-1)
        return torch.equal(act.view(as_int), silu_mul(gate, up).view(as_int)) and torch.equal(
            total.view(as_int), (values + other).view(as_int)
        )


def _weights_apply(w: DenseLayerWeights) -> bool:
    """Whether every op of a layer with these weights runs what the C layer runs (checked once per
    weights): the C library is built and its elementwise ops proven in the weights' dtype, every
    weight a CPU tensor of that dtype, bf16 or fp32; bf16 linears on our GEMM, fp32 weights
    contiguous (N, K), the layout whose GEMM `f32_kblock` probes, and below KERNEL_MAX elements
    (the tiny presets' shapes, where the C layer was measured and checked); the gate and up halves as wide
    as the MLP and that width a multiple of ELEMENTWISE_TILE (torch's silu then has no scalar tail)."""
    tensors = (w.input_norm, w.qkv, w.q_norm, w.k_norm, w.o, w.post_norm, w.gate_up, w.down)
    dtype, linears = w.qkv.dtype, (w.qkv, w.o, w.gate_up, w.down)
    if dtype == torch.bfloat16:
        gemm = all(on_kernel(weight) for weight in linears)
    else:
        gemm = all(_f32_fits(weight) for weight in linears)
    return (
        gemm
        and all(t.dtype == dtype and t.is_cpu for t in tensors)
        and w.gate_up_sizes[0] == w.gate_up_sizes[1] == w.down.shape[1] and w.down.shape[1] % ELEMENTWISE_TILE == 0
        and cpu_kernel.library() is not None
        and elementwise_proven(dtype)
    )


def _inputs_apply(h: torch.Tensor, w: DenseLayerWeights, cos: torch.Tensor, sin: torch.Tensor, cache) -> bool:
    """Per call: CPU inputs and caches in the weights' dtype, contiguous, no gradient wanted, an
    even head size (the rotary kernel's)."""
    k_cache, v_cache = cache
    tensors = (h, cos, sin, k_cache, v_cache)
    return (
        all(t.dtype == w.qkv.dtype and t.is_cpu for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, w.qkv, w.o, w.gate_up, w.down)))
        and h.dim() == 2 and h.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        and k_cache.shape[-1] % 2 == 0
    )


# rz_decoder_layer's arguments, in the order of csrc/kernels.c's LD_* and LP_* names
_DIMS = ("tokens", "rows", "hidden", "heads", "kv_heads", "head_dim", "block", "table_stride", "qkv_n", "width", "bf16",
         "kblock_qkv", "kblock_o", "kblock_gate_up", "kblock_down")
_PTRS = ("h", "input_norm", "qkv", "q_norm", "k_norm", "cos", "sin", "slots", "k_cache", "v_cache", "tables", "seq",
         "pos", "o", "post_norm", "gate_up", "down", "out", "work")
_LINEARS = ("qkv", "o", "gate_up", "down")
# those that change from call to call, filled in by _Plan.run in this order
_STEP_DIMS = [_DIMS.index(n) for n in ("tokens", "rows", "table_stride")]
_STEP_PTRS = [_PTRS.index(n) for n in ("h", "cos", "sin", "slots", "tables", "seq", "pos", "out", "work")]


class _Plan:
    """rz_decoder_layer's argument arrays for one layer's weights: the weights' pointers written
    once, their GEMM layouts again whenever a weight changes in place (its version moves:
    Engine.update_weights), fp32's K blocks once per thread count, the step's tensors every call."""

    def __init__(self, w: DenseLayerWeights):
        self.lib = _bound(cpu_kernel.library())
        self.weights = w
        self.bf16 = w.qkv.dtype == torch.bfloat16
        self.dtype_name = "bf16" if self.bf16 else "fp32"
        self.dims = (ctypes.c_int64 * len(_DIMS))()
        self.ptrs = (ctypes.c_int64 * len(_PTRS))()
        self.dims_at, self.ptrs_at = ctypes.addressof(self.dims), ctypes.addressof(self.ptrs)
        for name in ("input_norm", "q_norm", "k_norm", "post_norm"):
            self.ptrs[_PTRS.index(name)] = getattr(w, name).data_ptr()
        for name, value in (("hidden", w.o.shape[0]), ("qkv_n", w.qkv.shape[0]), ("width", w.down.shape[1]),
                            ("bf16", int(self.bf16))):
            self.dims[_DIMS.index(name)] = value
        self.linears = tuple(getattr(w, name) for name in _LINEARS)
        self.versions: list[int] = []
        self.panels: tuple[torch.Tensor, ...] = ()
        self.threads = 0  # the thread count the K blocks were set for
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # the one the arrays point to

    def _kblocks_set(self, threads: int) -> bool:
        """fp32: the proven K block of each linear for this many threads, or False where one has none."""
        if not self.bf16 and threads != self.threads:
            blocks = [f32_kblock(weight.shape[1], weight.shape[0], threads) for weight in self.linears]
            if None in blocks:
                return False
            for name, block in zip(_LINEARS, blocks):
                self.dims[_DIMS.index(f"kblock_{name}")] = block
            self.threads = threads
        return True

    def ready(self, threads: int) -> bool:
        """Set for a call on this many threads: fp32's K blocks (False where one is not proven),
        the GEMM layouts anew where a weight changed in place since the last call."""
        if not self._kblocks_set(threads):
            return False
        versions = [weight._version for weight in self.linears]
        if versions != self.versions:
            pack = weight_copies.kernel_panels if self.bf16 else weight_copies.f32_kernel_panels
            self.panels = tuple(pack(weight, True) for weight in self.linears)
            for name, panel in zip(_LINEARS, self.panels):
                self.ptrs[_PTRS.index(name)] = panel.data_ptr()
            self.versions = versions
        return True

    def set_cache(self, cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The layer's K/V cache (its engine's) and the sizes read off it."""
        k_cache, v_cache = cache
        k_at, v_at = _PTRS.index("k_cache"), _PTRS.index("v_cache")
        if cache is self.cache and self.ptrs[k_at] == k_cache.data_ptr() and self.ptrs[v_at] == v_cache.data_ptr():
            return  # (an engine's every step)
        self.cache = cache
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        for name, value in (("heads", self.weights.qkv.shape[0] // head_dim - 2 * kv_heads), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("block", k_cache.shape[1])):
            self.dims[_DIMS.index(name)] = value
        self.ptrs[k_at], self.ptrs[v_at] = k_cache.data_ptr(), v_cache.data_ptr()

    def work_elements(self, rows: int) -> int:
        """rz_decoder_layer's scratch for this many rows, in elements of the dtype."""
        w, heads, head_dim = self.weights, self.dims[_DIMS.index("heads")], self.dims[_DIMS.index("head_dim")]
        return rows * (3 * w.o.shape[0] + w.qkv.shape[0] + 2 * heads * head_dim + 3 * w.down.shape[1])

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta, cache,
            scale: float) -> torch.Tensor | None:
        dims, ptrs, threads = self.dims, self.ptrs, torch.get_num_threads()
        if not self.ready(threads):
            return None
        self.set_cache(cache)
        tables, seq, pos = cpu_kernel._token_index(meta)
        cos, sin = cos.contiguous(), sin.contiguous()  # (rows, 1, head_dim): rows of the rotary table
        elements = self.work_elements(h.shape[0])
        work = scratch("decoder_layer", -(-elements // 2) if self.bf16 else elements)
        out = torch.empty_like(h)
        for i, value in zip(_STEP_DIMS, (meta.num_tokens, h.shape[0], tables.shape[1])):
            dims[i] = value
        for i, t in zip(_STEP_PTRS, (h, cos, sin, meta.slot_mapping, tables, seq, pos, out, work)):
            ptrs[i] = t.data_ptr()
        cpu_kernel._check(self.lib.rz_decoder_layer(self.dims_at, self.ptrs_at, self.weights.eps, scale, threads))
        CALLS[self.dtype_name] += 1
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
    return w.plan.run(h, cos, sin, meta, cache, scale)  # None where fp32's K blocks are not proven
