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
from typing import NamedTuple

import torch

from rzero.ops import cpu_kernel, weight_copies
from rzero.ops.attention_meta import AttentionMeta
from rzero.ops.gemm_route import on_kernel
from rzero.ops.invariant_rows import ELEMENTWISE_TILE, silu_mul
from rzero.ops.scratch import scratch


class DenseLayerWeights(NamedTuple):
    """A dense Qwen3 decoder layer's weights, q/k/v and gate/up each one packed (N, K) tensor."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_sizes: list[int]
    down: torch.Tensor
    eps: float


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


def _applies(h: torch.Tensor, w: DenseLayerWeights, cos: torch.Tensor, sin: torch.Tensor, cache) -> bool:
    """Whether each of the layer's ops would run what the C layer runs: the C library is built and
    its elementwise ops proven, every tensor is a bf16 CPU tensor that wants no gradient, every
    linear is on our GEMM, the gate and up halves are as wide and the MLP width a multiple of
    ELEMENTWISE_TILE (torch's silu has no scalar tail), the caches and the hidden rows are
    contiguous, the head size even (the rotary kernel's)."""
    k_cache, v_cache = cache
    tensors = (h, w.input_norm, w.qkv, w.q_norm, w.k_norm, w.o, w.post_norm, w.gate_up, w.down, cos, sin, k_cache, v_cache)
    return (
        all(t.dtype == torch.bfloat16 and t.is_cpu for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and all(on_kernel(weight) for weight in (w.qkv, w.o, w.gate_up, w.down))
        and w.gate_up_sizes[0] == w.gate_up_sizes[1] == w.down.shape[1] and w.down.shape[1] % ELEMENTWISE_TILE == 0
        and h.dim() == 2 and h.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        and k_cache.shape[-1] % 2 == 0
        and elementwise_proven()
    )


def decoder_layer(
    h: torch.Tensor, w: DenseLayerWeights, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMeta,
    cache: tuple[torch.Tensor, torch.Tensor], scale: float,
) -> torch.Tensor | None:
    """h (padded tokens, hidden) through the layer: h2 = h + attention(norm(h)) Wo, then
    h2 + down(silu(gate) * up) of norm(h2), the keys and values written into `cache`; None where
    the C layer does not apply (`_applies`), and the caller runs the layer's ops."""
    if not _applies(h, w, cos, sin, cache):
        return None
    lib = _bound(cpu_kernel.library())
    k_cache, v_cache = cache
    rows, hidden = h.shape
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads, width = w.qkv.shape[0] // head_dim - 2 * kv_heads, w.down.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()  # (rows, 1, head_dim): rows of the rotary table
    tables, seq, pos = cpu_kernel._token_index(meta)
    qkv, o, gate_up, down = (weight_copies.kernel_panels(weight, True) for weight in (w.qkv, w.o, w.gate_up, w.down))
    work = scratch("decoder_layer", -(-rows * (3 * hidden + w.qkv.shape[0] + 2 * heads * head_dim + 3 * width) // 2))
    out = torch.empty_like(h)
    dims = torch.tensor([meta.num_tokens, rows, hidden, heads, kv_heads, head_dim, k_cache.shape[1], tables.shape[1],
                         w.qkv.shape[0], width], dtype=torch.int64)
    # In the order of csrc/kernels.c's LP_* names; every tensor is held until the call returns.
    ptrs = torch.tensor([t.data_ptr() for t in (
        h, w.input_norm, qkv, w.q_norm, w.k_norm, cos, sin, meta.slot_mapping, k_cache, v_cache, tables, seq, pos, o,
        w.post_norm, gate_up, down, out, work)], dtype=torch.int64)
    cpu_kernel._check(lib.rz_decoder_layer(dims.data_ptr(), ptrs.data_ptr(), w.eps, scale, torch.get_num_threads()))
    return out
