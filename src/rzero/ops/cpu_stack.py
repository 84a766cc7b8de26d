"""An engine step's whole backbone in one C call (csrc/kernels.c, rz_decoder_stack): the token
embeddings, every dense decoder layer (cpu_layer.py's call, one after the other) and the final
RMSNorm, for the engine's steps on the CPU.

Why: with each layer one C call, what was left around them in Python (per layer a module call,
the weights' check, the op wrappers and the argument arrays; per step the embedding, the rotary
rows and the final norm as torch ops) cost a tiny model's decode step about a tenth of its time,
more on two threads where the kernels take half as long (docs/benchmarks.md, nineteenth session).

The bits: the same kernels on the same rows in the same order as the layer-by-layer forward; the
embedding and rotary rows are copies (bf16 rotary rows rounded from the fp32 table as torch's
`.to(bfloat16)` rounds them). tests/test_cpu_stack.py holds the two forwards to one another.
"""

from __future__ import annotations

import ctypes

import torch

from rzero.ops import cpu_kernel
from rzero.ops.attention_meta import AttentionMeta
from rzero.ops.cpu_layer import CALLS, DenseLayerWeights, _Plan, _weights_apply
from rzero.ops.scratch import scratch

# rz_decoder_stack's arguments, in the order of csrc/kernels.c's SD_* and SP_* names
_DIMS = ("tokens", "rows", "table_stride", "layers", "hidden", "head_dim", "vocab", "bf16", "rope_fp32", "embed_row_stride",
         "embed_col_stride")
_PTRS = ("ids", "positions", "embed", "rope_cos", "rope_sin", "slots", "tables", "seq", "pos", "norm", "out", "work")


def _bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.rz_decoder_stack.argtypes is None:
        ptr = ctypes.c_void_p
        lib.rz_decoder_stack.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    return lib


class _Stack:
    """The call's argument arrays for one list of layer plans: the layers' own arrays (which the
    C call fills with the step's entries) and the step's."""

    def __init__(self, plans: list[_Plan]):
        self.lib = _bound(plans[0].lib)
        self.plans = plans
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last ones checked
        self.work_rows = self.work = 0  # the scratch elements of the last row count
        self.layer_dims = (ctypes.c_void_p * len(plans))(*(plan.dims_at for plan in plans))
        self.layer_ptrs = (ctypes.c_void_p * len(plans))(*(plan.ptrs_at for plan in plans))
        self.eps = (ctypes.c_float * len(plans))(*(plan.weights.eps for plan in plans))
        self.dims = (ctypes.c_int64 * len(_DIMS))()
        self.ptrs = (ctypes.c_int64 * len(_PTRS))()

    def holds(self, plans: list[_Plan]) -> bool:
        return len(plans) == len(self.plans) and all(a is b for a, b in zip(plans, self.plans))

    def set_caches(self, dtype: torch.dtype, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Point the layers at these caches (an engine's, the same every step: checked once)."""
        if len(caches) != len(self.caches) or any(a is not b for a, b in zip(caches, self.caches)):
            kv = [t for cache in caches for t in cache]
            if not all(t.dtype == dtype and t.is_cpu and t.is_contiguous() for t in kv) or kv[0].shape[-1] % 2:
                return False
            self.caches, self.work_rows = list(caches), 0
        for plan, cache in zip(self.plans, caches):
            plan.set_cache(cache)
        return True

    def work_elements(self, rows: int, hidden: int, head_dim: int) -> int:
        """rz_decoder_stack's scratch for this many rows, in elements of the dtype."""
        if rows != self.work_rows:
            layer = max(plan.work_elements(rows) for plan in self.plans)
            self.work_rows, self.work = rows, 2 * rows * (hidden + head_dim) + layer
        return self.work


def _plans(layers: list[DenseLayerWeights], threads: int) -> list[_Plan] | None:
    plans = []
    for w in layers:
        if w.plan is None:
            w.plan = _Plan(w) if _weights_apply(w) else False
        if w.plan is False or not w.plan.ready(threads):
            return None
        plans.append(w.plan)
    return plans


def _inputs_apply(dtype: torch.dtype, ids: torch.Tensor, embed: torch.Tensor, norm: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """CPU tensors in the layers' dtype, contiguous (the rotary tables in it or fp32; the embedding
    may be a transposed view), int64 ids."""
    return (
        ids.dtype == torch.int64 and ids.is_contiguous()
        and all(t.dtype == dtype and t.is_cpu for t in (embed, norm)) and norm.is_contiguous() and embed.dim() == 2
        and all(t.dtype in (dtype, torch.float32) and t.is_cpu and t.is_contiguous() for t in rope)
        and rope[0].dtype == rope[1].dtype
    )


def decoder_stack(
    ids: torch.Tensor, meta: AttentionMeta, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    layers: list[DenseLayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]],
    norm: tuple[torch.Tensor, float], scale: float,
) -> torch.Tensor | None:
    """The normed final hidden states (padded tokens, hidden) of the padded token ids `ids`: the
    embeddings, each of `layers` with its cache (K/V written in place), the final norm; None where
    the C layer does not apply to every layer, and the caller runs the layers one by one.
    `rope`: the model's fp32 (cos, sin) tables, read at meta.positions."""
    if torch.is_grad_enabled() or len(layers) != len(caches) or not layers:
        return None
    threads = torch.get_num_threads()
    plans = _plans(layers, threads)
    dtype = layers[0].qkv.dtype
    if plans is None or not _inputs_apply(dtype, ids, embed, norm[0], rope):
        return None
    stack = layers[0].stack
    if stack is None or not stack.holds(plans):
        stack = layers[0].stack = _Stack(plans)
    if not stack.set_caches(dtype, caches) or rope[0].shape[-1] != caches[0][0].shape[-1]:
        return None
    tables, seq, pos = cpu_kernel._token_index(meta)
    rows, (vocab, hidden), head_dim = ids.shape[0], embed.shape, rope[0].shape[1]
    elements = stack.work_elements(rows, hidden, head_dim)
    work = scratch("decoder_stack", -(-elements * (2 if dtype == torch.bfloat16 else 4) // 4))
    out = torch.empty(rows, hidden, dtype=dtype)
    dims, ptrs = stack.dims, stack.ptrs
    for i, value in enumerate((meta.num_tokens, rows, tables.shape[1], len(plans), hidden, head_dim, vocab,
                               int(dtype == torch.bfloat16), int(rope[0].dtype == torch.float32), *embed.stride())):
        dims[i] = value
    for i, t in enumerate((ids, meta.positions, embed, rope[0], rope[1], meta.slot_mapping, tables, seq, pos, norm[0],
                           out, work)):
        ptrs[i] = t.data_ptr()
    status = stack.lib.rz_decoder_stack(ctypes.addressof(dims), ctypes.addressof(ptrs), stack.layer_dims,
                                        stack.layer_ptrs, stack.eps, norm[1], scale, threads)
    if status == 5:
        raise IndexError(f"a token id is outside the embedding's {vocab} rows")
    cpu_kernel._check(status)
    CALLS[plans[0].dtype_name] += len(plans)
    return out
