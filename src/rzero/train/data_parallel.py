"""Data-parallel gradient accumulation over `torch.distributed` ranks (one Trainer replica each).

Every rank runs the same `Trainer.train_step(groups)` (SPMD); only `forward_backward` differs.
Micro-batch i of the step's list is computed by rank i % K, and the ranks agree on the result:

- `OrderedReduce` (train.grad_reduce = "ordered", the default): each micro-batch's gradient is
  captured alone, then the gradients are summed on every rank in global micro-batch order, exactly
  as one process accumulates them (`.grad` starts as micro-batch 0's gradient, each next one is
  added elementwise in the compute dtype). Every rank therefore ends with bitwise the gradient of
  world_size 1 and takes bitwise the same optimizer step: no weight broadcast is ever needed, and
  adding ranks is a pure speed knob. Cost: every micro-batch's gradient travels to every rank
  (one broadcast of the whole model per micro-batch, n_micro_batches x model bytes per step), and
  a rank holds its own micro-batches' gradients until the reduction.
- `AllReduce` ("allreduce"): each rank accumulates its micro-batches locally, then one
  `all_reduce(SUM)` per parameter. One model's worth of traffic per step, but the sum is taken in
  a different order (and, in bf16, with different roundings) than in one process, so the run is
  NOT bitwise equal to world_size 1; the weights stay identical across ranks (all take the same
  reduced gradient).

Both stop exactly as one process does: a non-finite micro-batch loss on any rank skips the update
on every rank. The root rank (0) also receives every micro-batch's token logprobs, in order, for
the loss, the IS diagnostics and the log-ratio decomposition; the other ranks skip diagnostics.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from rzero.rollout.record import Rollout

LossFn = Callable[[list[Rollout], list[torch.Tensor]], torch.Tensor]
Result = tuple[float, list[torch.Tensor], bool]


def backend_for(device: torch.device | str) -> str:
    """The process-group backend for a device: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _score(trainer, micro_batch: list[Rollout], loss_fn: LossFn) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A micro-batch's token logprobs (autograd on) and its share of the loss."""
    lps = trainer.token_logprobs(trainer.compute, micro_batch, trainer.settings.share_prompts)
    return lps, loss_fn(micro_batch, lps)


class _Reduce:
    """Shared part: which micro-batches are this rank's, and the gather of losses and logprobs."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def _mine(self, n: int) -> list[int]:
        return list(range(self.rank, n, self.world_size))

    def _gather_logprobs(self, local: dict[int, list[torch.Tensor]], n: int) -> list[torch.Tensor]:
        """Every micro-batch's token logprobs on the root, in order (an empty list elsewhere; and
        everywhere when n is 0: a skipped step, whose logprobs nobody reads)."""
        everyone: list | None = [None] * self.world_size if self.is_root else None
        dist.gather_object(local, everyone, dst=0)
        if not self.is_root or n == 0:
            return []
        merged = {i: v for part in everyone for i, v in part.items()}
        return [lp for i in range(n) for lp in merged[i]]

    def _gather_losses(self, local: dict, n: int) -> tuple[dict, list[bool], list[float]]:
        """Every rank's {micro-batch: (loss, finite, ...)} merged on every rank, with the finite
        flags and losses in micro-batch order (a micro-batch no rank reached counts as not finite)."""
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, local)
        merged = {i: v for part in everyone for i, v in part.items()}
        finite = [i in merged and merged[i][1] for i in range(n)]
        losses = [merged[i][0] if i in merged else math.nan for i in range(n)]
        return merged, finite, losses

    def _finish(self, losses: list[float], finite: list[bool], local_lps, n: int) -> Result | None:
        """(loss, logprobs, False) as one process returns it when a micro-batch loss is not
        finite; None when all are finite."""
        if all(finite):
            return None
        first_bad = finite.index(False)
        total = 0.0
        for loss in losses[:first_bad]:
            total += loss
        self._gather_logprobs(local_lps, 0)  # every rank takes part in the same collectives
        return total, [], False


class OrderedReduce(_Reduce):
    """Bitwise world-size invariant accumulation: see the module docstring."""

    def forward_backward(self, trainer, micro_batches: list[list[Rollout]], loss_fn: LossFn) -> Result:
        params = list(trainer.compute.parameters())
        n = len(micro_batches)
        grads: dict[int, torch.Tensor] = {}  # micro-batch -> its gradient, packed as bytes
        masks: dict[int, tuple[bool, ...]] = {}  # which parameters got a gradient
        local: dict[int, tuple[float, bool]] = {}
        local_lps: dict[int, list[torch.Tensor]] = {}
        for i in self._mine(n):
            lps, loss = _score(trainer, micro_batches[i], loss_fn)
            if not torch.isfinite(loss):
                local[i] = (float("nan"), False)
                break  # the step is skipped everywhere; the rest of this rank's work is moot
            for p in params:
                p.grad = None
            loss.backward()  # this micro-batch's gradient alone
            present = tuple(p.grad is not None for p in params)
            masks[i] = present
            grads[i] = _pack([p.grad for p in params if p.grad is not None])
            for p in params:
                p.grad = None
            local[i] = (float(loss.detach()), True)
            local_lps[i] = [x.detach() for x in lps]
        local = {i: (*v, masks.get(i)) for i, v in local.items()}
        merged, finite, losses = self._gather_losses(local, n)
        skipped = self._finish(losses, finite, local_lps, n)
        if skipped is not None:
            return skipped
        # The reduction, in global micro-batch order: exactly one process's `loss.backward()` chain.
        acc: list[torch.Tensor | None] = [None] * len(params)
        for i in range(n):
            mask = merged[i][2]
            src = i % self.world_size
            shapes = [p for p, has in zip(params, mask) if has]
            buf = grads.pop(i) if src == self.rank else torch.empty(_packed_size(shapes), dtype=torch.uint8)
            dist.broadcast(buf, src=src)
            unpacked = iter(_unpack(buf, shapes))
            for j, has in enumerate(mask):
                if has:
                    g = next(unpacked)
                    if acc[j] is None:
                        acc[j] = g  # AccumulateGrad's first gradient: taken as is
                    else:
                        acc[j] += g  # AccumulateGrad's next ones: added elementwise, compute dtype
        for p, g in zip(params, acc):
            p.grad = g
        loss_total = 0.0
        for loss in losses:
            loss_total += loss
        return loss_total, self._gather_logprobs(local_lps, n), True


class AllReduce(_Reduce):
    """Fast, non-exact: local accumulation, then one all_reduce(SUM) per parameter. The summation
    order (rank partial sums, then gloo's/NCCL's own reduction order) differs from one process's,
    so results match world_size 1 only up to rounding; ranks stay identical to each other."""

    def forward_backward(self, trainer, micro_batches: list[list[Rollout]], loss_fn: LossFn) -> Result:
        params = list(trainer.compute.parameters())
        n = len(micro_batches)
        local: dict[int, tuple[float, bool]] = {}
        local_lps: dict[int, list[torch.Tensor]] = {}
        for i in self._mine(n):
            lps, loss = _score(trainer, micro_batches[i], loss_fn)
            if not torch.isfinite(loss):
                local[i] = (float("nan"), False)
                break  # the step is skipped everywhere; the rest of this rank's work is moot
            loss.backward()
            local[i] = (float(loss.detach()), True)
            local_lps[i] = [x.detach() for x in lps]
        merged, finite, losses = self._gather_losses(local, n)
        skipped = self._finish(losses, finite, local_lps, n)
        if skipped is not None:
            return skipped
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
        for p, has in zip(params, present.tolist()):
            if not has:
                continue  # no rank routed a token to it: no gradient, as in one process
            g = p.grad.contiguous() if p.grad is not None else torch.zeros_like(p, memory_format=torch.contiguous_format)
            dist.all_reduce(g, op=dist.ReduceOp.SUM)  # (gloo needs contiguous tensors; packed weights are not)
            p.grad = g
        loss_total = 0.0
        for loss in losses:
            loss_total += loss
        return loss_total, self._gather_logprobs(local_lps, n), True


def make_reducer(kind: str) -> _Reduce:
    """The reducer for train.grad_reduce ("ordered" or "allreduce") on the initialised default
    process group (all ranks of the run)."""
    if kind == "ordered":
        return OrderedReduce()
    if kind == "allreduce":
        return AllReduce()
    raise ValueError(f"train.grad_reduce must be 'ordered' or 'allreduce', not {kind!r}")


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, concatenated (exact transport whatever the dtype)."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _packed_size(like: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in like)


def _unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in like:
        size = p.numel() * p.element_size()
        out.append(buf[offset : offset + size].view(p.dtype).view(p.shape))
        offset += size
    return out
