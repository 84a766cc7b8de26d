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

from rzero.ops import cpu_kernel, cpu_layer
from rzero.ops.attention_meta import AttentionMeta, DecodeBatch
from rzero.ops.cpu_layer import CALLS, DenseLayerWeights, _Plan, _weights_apply
from rzero.ops.scratch import scratch

# rz_decoder_stack's arguments, in the order of csrc/kernels.c's SD_* and SP_* names
_DIMS = ("tokens", "rows", "table_stride", "layers", "hidden", "head_dim", "vocab", "bf16", "rope_fp32", "embed_row_stride",
         "embed_col_stride")
_PTRS = ("ids", "positions", "embed", "rope_cos", "rope_sin", "slots", "tables", "seq", "pos", "norm", "out", "work")
# those that change from step to step, filled in by decoder_stack in this order
_STEP_DIMS = [_DIMS.index(n) for n in ("tokens", "rows", "table_stride")]
_STEP_PTRS = [_PTRS.index(n) for n in ("ids", "positions", "slots", "tables", "seq", "pos", "out", "work")]


def _bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.rz_decoder_stack.argtypes is None:
        ptr = ctypes.c_void_p
        lib.rz_decoder_stack.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    return lib


class _Stack:
    """The call's argument arrays for one model's layers: the layers' own arrays (which the C call
    fills with the step's entries) and the step's. Made, checked and filled once for a model's
    layers, caches and tables (an engine's: the same every step); a step then only checks the
    plans (weights changed in place, another thread count) and fills in its own tensors."""

    def __init__(self, key: tuple, plans: list[_Plan], embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 norm: tuple[torch.Tensor, float], caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.key, self.plans, self.norm_eps = key, plans, norm[1]
        self.addresses = _addresses(embed, rope, norm)
        self.lib = _bound(plans[0].lib)
        for plan, cache in zip(plans, caches):
            plan.set_cache(cache)
        self.layer_dims = (ctypes.c_void_p * len(plans))(*(plan.dims_at for plan in plans))
        self.layer_ptrs = (ctypes.c_void_p * len(plans))(*(plan.ptrs_at for plan in plans))
        self.eps = (ctypes.c_float * len(plans))(*(plan.weights.eps for plan in plans))
        self.dims = (ctypes.c_int64 * len(_DIMS))()
        self.ptrs = (ctypes.c_int64 * len(_PTRS))()
        self.dims_at, self.ptrs_at = ctypes.addressof(self.dims), ctypes.addressof(self.ptrs)
        self.bf16 = embed.dtype == torch.bfloat16
        self.vocab, self.hidden = embed.shape
        self.head_dim = rope[0].shape[1]
        for name, value in (("layers", len(plans)), ("hidden", self.hidden), ("head_dim", self.head_dim),
                            ("vocab", self.vocab), ("bf16", int(self.bf16)), ("rope_fp32", int(rope[0].dtype == torch.float32)),
                            ("embed_row_stride", embed.stride(0)), ("embed_col_stride", embed.stride(1))):
            self.dims[_DIMS.index(name)] = value
        for name, t in (("embed", embed), ("rope_cos", rope[0]), ("rope_sin", rope[1]), ("norm", norm[0])):
            self.ptrs[_PTRS.index(name)] = t.data_ptr()
        self.work_rows = self.work = 0  # the scratch (fp32 elements) of the last row count

    def scratch(self, rows: int) -> torch.Tensor:
        if rows != self.work_rows:
            elements = 2 * rows * (self.hidden + self.head_dim) + max(plan.work_elements(rows) for plan in self.plans)
            self.work_rows, self.work = rows, -(-elements * (2 if self.bf16 else 4) // 4)
        return scratch("decoder_stack", self.work)


def _addresses(embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], norm: tuple[torch.Tensor, float]) -> tuple:
    """Where the step-invariant tensors are: a tensor's storage can change under the same object
    (`.data = ...`), and the call's arrays hold addresses."""
    return embed.data_ptr(), rope[0].data_ptr(), rope[1].data_ptr(), norm[0].data_ptr()


def _plans(layers: list[DenseLayerWeights], threads: int) -> list[_Plan] | None:
    plans = []
    for w in layers:
        if w.plan is None:
            w.plan = _Plan(w) if _weights_apply(w) else False
        if w.plan is False or not w.plan.ready(threads):
            return None
        plans.append(w.plan)
    return plans


def _inputs_apply(dtype: torch.dtype, embed: torch.Tensor, norm: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                  caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """CPU tensors in the layers' dtype (the rotary tables in it or fp32), contiguous but for the
    embedding (a transposed view is read as one), an even head size as long as the tables' rows."""
    kv = [t for cache in caches for t in cache]
    return (
        all(t.dtype == dtype and t.is_cpu for t in (embed, norm, *kv)) and embed.dim() == 2
        and all(t.is_contiguous() for t in (norm, *kv, *rope))
        and all(t.dtype in (dtype, torch.float32) and t.is_cpu for t in rope) and rope[0].dtype == rope[1].dtype
        and kv[0].shape[-1] % 2 == 0 and rope[0].shape[-1] == kv[0].shape[-1]
    )


def _stack_for(layers: list[DenseLayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]], embed: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], norm: tuple[torch.Tensor, float], threads: int) -> _Stack | None:
    """The model's call arrays, set for these layers, caches and tables on this many threads (kept on
    its first layer, checked each step); None where the C call does not apply."""
    if torch.is_grad_enabled() or len(layers) != len(caches) or not layers:
        return None
    key = (*layers, *caches, embed, *rope, norm[0])
    stack = layers[0].stack
    if (stack is not None and len(key) == len(stack.key) and all(a is b for a, b in zip(key, stack.key))
            and _addresses(embed, rope, norm) == stack.addresses and norm[1] == stack.norm_eps):
        if not all(plan.ready(threads) for plan in stack.plans):
            return None
        for plan, cache in zip(stack.plans, caches):
            plan.set_cache(cache)  # (a no-op unless the per-layer path pointed it elsewhere)
        return stack
    plans = _plans(layers, threads)
    if plans is None or not _inputs_apply(layers[0].qkv.dtype, embed, norm[0], rope, caches):
        return None
    stack = layers[0].stack = _Stack(key, plans, embed, rope, norm, caches)
    return stack


def decoder_stack(
    ids: torch.Tensor, meta: AttentionMeta, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    layers: list[DenseLayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]],
    norm: tuple[torch.Tensor, float], scale: float,
) -> torch.Tensor | None:
    """The normed final hidden states (padded tokens, hidden) of the padded token ids `ids`: the
    embeddings, each of `layers` with its cache (K/V written in place), the final norm; None where
    the C layer does not apply to every layer, and the caller runs the layers one by one.
    `rope`: the model's (cos, sin) tables, read at meta.positions."""
    threads = torch.get_num_threads()
    stack = None if ids.dtype != torch.int64 else _stack_for(layers, caches, embed, rope, norm, threads)
    if stack is None:
        return None
    tables, seq, pos = cpu_kernel._token_index(meta)
    rows = ids.shape[0]
    out = torch.empty(rows, stack.hidden, dtype=embed.dtype)
    dims, ptrs = stack.dims, stack.ptrs
    for i, value in zip(_STEP_DIMS, (meta.num_tokens, rows, tables.shape[1])):
        dims[i] = value
    for i, t in zip(_STEP_PTRS, (ids.contiguous(), meta.positions, meta.slot_mapping, tables, seq, pos, out,
                                 stack.scratch(rows))):
        ptrs[i] = t.data_ptr()
    status = stack.lib.rz_decoder_stack(stack.dims_at, stack.ptrs_at, stack.layer_dims, stack.layer_ptrs, stack.eps,
                                        stack.norm_eps, scale, threads)
    if status == 5:
        raise IndexError(f"a token id is outside the embedding's {stack.vocab} rows")
    cpu_kernel._check(status)
    CALLS[stack.plans[0].dtype_name] += len(stack.plans)
    return out


def decode_steps(
    batch: DecodeBatch, row_tile: int, lm_head: torch.Tensor, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
    layers: list[DenseLayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]], norm: tuple[torch.Tensor, float],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Up to `batch.uniform.shape[0]` decode steps of its B sequences in one C call (csrc/kernels.c,
    rz_decode_steps), each step an engine step of the rows still running (padded to `row_tile`):
    the backbone (decoder_stack), the LM head (the invariant linear on rzero's own GEMM), logits /
    temperature, log_softmax and the draw; a row stops at one of its stop ids or its limit. The
    rows go one row tile at a time through all of their steps (batch invariance: the same bits).
    Returns the tokens and logprobs (steps, B), valid for step k < counts[b], and counts (B,); None
    where a part has no C path here (the LM head's GEMM, the backbone), and the caller runs the
    steps one by one."""
    threads = torch.get_num_threads()
    operand = cpu_layer.own_gemm_operand(lm_head, True)
    stack = None if operand is None else _stack_for(layers, caches, embed, rope, norm, threads)
    if stack is None or lm_head.shape[1] != stack.hidden:
        return None
    steps, rows = batch.uniform.shape
    tokens = torch.empty(steps, rows, dtype=torch.int64)
    logprobs = torch.empty(steps, rows, dtype=torch.float32)
    counts = torch.empty(rows, dtype=torch.int64)
    stack.dims[_DIMS.index("table_stride")] = batch.block_tables.shape[1]
    stack.ptrs[_PTRS.index("tables")] = batch.block_tables.data_ptr()
    stack.ptrs[_PTRS.index("work")] = stack.scratch(row_tile).data_ptr()  # (one chunk's rows)
    # Chunks of one row tile, each through all of its steps: its K/V stay in the caches from step to
    # step (1.23-1.30x a one-thread generate of the tiny model against the whole batch per step,
    # 1.045x at two threads; 8 or 32 rows were slower; docs/benchmarks.md, twentieth session).
    dims = (ctypes.c_int64 * 7)(steps, rows, row_tile, lm_head.shape[0], caches[0][0].shape[1], operand[1], row_tile)
    ptrs = (ctypes.c_void_p * 11)(*(t.data_ptr() for t in (
        batch.ids, batch.context, batch.limit, batch.stop_ids, batch.stop_start, batch.temperature, batch.uniform,
        operand[0], tokens, logprobs, counts)))
    call = stack.lib.rz_decode_steps
    if call.argtypes is None:  # bound here: load() also loads older sources (benchmarks/bench_attention.py)
        ptr = ctypes.c_void_p
        call.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_float, ctypes.c_float, ctypes.c_int, ptr, ptr]
    status = call(stack.dims_at, stack.ptrs_at, stack.layer_dims, stack.layer_ptrs, stack.eps, stack.norm_eps, scale,
                  threads, dims, ptrs)
    if status == 5:
        raise IndexError(f"a token id is outside the embedding's {stack.vocab} rows")
    cpu_kernel._check(status)
    per_row = counts.tolist()
    ran = sum(max(per_row[i : i + row_tile]) for i in range(0, rows, row_tile))  # each chunk's steps
    CALLS[stack.plans[0].dtype_name] += len(stack.plans) * ran
    return tokens, logprobs, counts
