"""The trainer: scores rollouts with the engine's model code, takes AdamW steps, publishes weights.

fp32 master weights live in `master`; the forward runs in `compute`, a copy cast to the model
dtype that is exactly what every engine holds at the same version (C1). Step s computes
π with the weights of version s and publishes version s + 1.

This is the only trainer in rzero: `token_logprobs` is the one teacher-forced scoring function,
and every update (RL steps, the supervised warm start, the checklist's update) goes through
`forward_backward` and the same optimizer step. `rzero check` runs these methods, not a copy.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

import torch

from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.ops import AttentionMeta, Numerics, SamplingTransform, resolve_device
from rzero.ops import numerics as numerics_of
from rzero.rollout.record import Rollout
from rzero.train.losses import LossSettings, group_advantages, policy_loss

# loss_fn(micro_batch, its token logprobs) -> the micro-batch's share of the step's loss
LossFn = Callable[[list[Rollout], list[torch.Tensor]], torch.Tensor]


@dataclass
class TrainerSettings:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    steps: int = 1  # the schedule's length
    micro_batch_tokens: int = 4096
    share_prompts: bool = True  # a group's prompt runs once per micro-batch (`token_logprobs`)
    gradient_checkpointing: bool = False  # recompute each layer in backward instead of storing it
    leave_one_out: bool = False
    advantage_std_norm: bool = False
    decompose: bool = True  # keep the last max_lag + 1 versions to split log w (diagnostics)
    max_lag: int = 0
    objective: LossSettings = field(default_factory=LossSettings)

    @classmethod
    def from_values(cls, values: Mapping) -> TrainerSettings:
        """Settings from a mapping with these field names and more (e.g. the config's train
        section merged with rollout.max_lag): each field of this class, and of LossSettings for
        `objective`, takes the value of the same name; the other keys are ignored."""
        pick = lambda c: {f.name: values[f.name] for f in fields(c) if f.name in values}  # noqa: E731
        settings = pick(cls)
        settings.pop("objective", None)
        return cls(**settings, objective=LossSettings(**pick(LossSettings)))


def copy_grads_to_master(master: torch.nn.Module, compute: torch.nn.Module) -> None:
    """Hand the compute copy's gradients to the fp32 master parameters. A parameter that got no
    gradient (an MoE expert no token was routed to) keeps none, so AdamW leaves it alone. Each
    gradient takes its master's memory layout: a packed compute weight is stored transposed
    (`pack_weights`), and the fused AdamW pairs parameter and gradient elements by memory order."""
    for mp, cp in zip(master.parameters(), compute.parameters()):
        mp.grad = None if cp.grad is None else torch.empty_like(mp).copy_(cp.grad)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


class Trainer:
    def __init__(
        self,
        master: Qwen3ForCausalLM,
        dtype: torch.dtype,
        settings: TrainerSettings,
        *,
        numerics: str | Numerics = "invariant",
        device: str | torch.device | None = None,
        version: int = 0,
        reducer=None,
    ):
        self.settings = settings
        # Data parallelism (rzero.train.data_parallel): None in one process; otherwise the object
        # whose `forward_backward(trainer, micro_batches, loss_fn)` spreads the micro-batches over
        # the ranks and leaves every rank with the same summed gradient.
        self.reducer = reducer
        self.numerics = numerics_of(numerics)
        # None: where `master` already is. Otherwise it moves there (in place, like .float()).
        self.device = master.device if device is None else resolve_device(device)
        self.master = master.float().to(self.device).train()
        self.master.numerics = self.numerics
        self.compute = self.master if dtype == torch.float32 else copy.deepcopy(self.master).to(dtype)
        if self.compute is not self.master:
            # bf16: weights row-major, the invariant GEMM's operand without a copy per pass. (Not
            # the fp32 master: its parameters stay plain tensors for the optimizer and checkpoints.)
            self.compute.pack_weights()
        self.compute.gradient_checkpointing = settings.gradient_checkpointing
        # fused: one kernel over every parameter, ~3x faster than the per-tensor loop on a tiny model
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, settings.warmup_steps, settings.steps, settings.schedule),
        )
        self.version = version
        self.skipped_updates = 0
        self.ring: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._scratch: Qwen3ForCausalLM | None = None
        self._remember_version()

    # ----------------------------------------------------------------- weights

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights of the current version in the model dtype (what engines load): copies that
        nothing writes again, so the ring's copy of this version (decompose) serves as well."""
        kept = self.ring.get(self.version)
        if kept is not None:
            return kept
        return {name: p.detach().clone() for name, p in self.compute.named_parameters()}

    def _sync_compute(self) -> None:
        if self.compute is not self.master:
            with torch.no_grad():
                for dst, src in zip(self.compute.parameters(), self.master.parameters()):
                    dst.copy_(src)

    def _remember_version(self) -> None:
        """Keep the weights of the last max_lag + 1 versions for the log-ratio decomposition."""
        if not self.settings.decompose:
            return
        self.ring[self.version] = self.engine_state_dict()
        while len(self.ring) > self.settings.max_lag + 1:
            self.ring.popitem(last=False)

    # ----------------------------------------------------------------- scoring

    @staticmethod
    def token_logprobs(model: Qwen3ForCausalLM, rollouts: list[Rollout], share_prompts: bool = True) -> list[torch.Tensor]:
        """log π(a_t) of every sampled completion token under `model`, one tensor per rollout
        (environment tokens are in the context but not scored), under each rollout's sampling
        transform. All rollouts are packed into one forward pass; grad mode is the caller's.
        `share_prompts`: consecutive rollouts with the same prompt (a GRPO group) run that prompt
        once (`AttentionMeta.for_shared_prompts`); under invariant numerics the logprobs have the
        same bits either way, and the gradients differ only in rounding."""
        groups: list[list[Rollout]] = []
        for r in rollouts:
            if share_prompts and groups and groups[-1][0].prompt_ids == r.prompt_ids:
                groups[-1].append(r)
            else:
                groups.append([r])
        positions = {id(r): r.policy_positions() for r in rollouts}
        tokens: list[int] = []
        rows: list[int] = []  # the row whose hidden state predicts each scored token
        targets: list[int] = []
        for group in groups:
            prompt = group[0].prompt_ids
            if not prompt:
                raise ValueError("a rollout to score has an empty prompt: its first token has no context")
            tokens.extend(prompt)
            prompt_last = len(tokens) - 1  # predicts every completion's first token
            for r in group:
                first = len(tokens)  # row of r's first completion token
                tokens.extend(r.completion_ids)
                rows.extend(prompt_last if i == 0 else first + i - 1 for i in positions[id(r)])
                targets.extend(r.completion_ids[i] for i in positions[id(r)])
        meta = AttentionMeta.for_shared_prompts(
            [(len(g[0].prompt_ids), [len(r.completion_ids) for r in g]) for g in groups], row_tile=model.numerics.row_tile
        )
        hidden = model(torch.tensor(tokens, dtype=torch.long), meta)
        logits = model.logits(hidden[rows])
        target = torch.tensor(targets, dtype=torch.long, device=logits.device)
        sizes = [len(positions[id(r)]) for r in rollouts]
        transforms = {r.transform for r in rollouts}
        if len(transforms) == 1:  # the usual case: one transform, no row gathers or scatters
            picked = model.numerics.transformed_logprobs(logits, transforms.pop()).gather(1, target[:, None])[:, 0]
            return list(picked.split(sizes))
        by_transform: dict[SamplingTransform, list[int]] = {}
        cursor = 0
        for r, n in zip(rollouts, sizes):
            by_transform.setdefault(r.transform, []).extend(range(cursor, cursor + n))
            cursor += n
        out = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
        for transform, idx in by_transform.items():
            idx_t = torch.tensor(idx, dtype=torch.long, device=logits.device)
            lp = model.numerics.transformed_logprobs(logits[idx_t], transform)
            out[idx_t] = lp.gather(1, target[idx_t, None])[:, 0]
        return list(out.split(sizes))

    def micro_batches(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
        """Consecutive rollouts, at most micro_batch_tokens tokens per batch (at least one rollout);
        a prompt shared with the rollout before it in the batch counts once (`share_prompts`)."""
        batches, current, tokens = [], [], 0
        for r in rollouts:
            shared = self.settings.share_prompts and current and current[-1].prompt_ids == r.prompt_ids
            n = len(r.completion_ids) + (0 if shared else len(r.prompt_ids))
            if current and tokens + n > self.settings.micro_batch_tokens:
                batches.append(current)
                current, tokens = [], 0
                n = len(r.prompt_ids) + len(r.completion_ids)
            current.append(r)
            tokens += n
        if current:
            batches.append(current)
        return batches

    # -------------------------------------------------------------------- step

    def forward_backward(
        self, micro_batches: list[list[Rollout]], loss_fn: LossFn
    ) -> tuple[float, list[torch.Tensor], bool]:
        """Accumulate gradients on the compute copy, one micro-batch at a time: score it with
        `token_logprobs` (autograd on), take `loss_fn` of it, backward. Stops at the first
        non-finite loss. Returns (summed loss, detached token logprobs per rollout, all finite).
        With a `reducer`, the ranks share the micro-batches and all end with the same gradient."""
        if self.reducer is not None:
            return self.reducer.forward_backward(self, micro_batches, loss_fn)
        loss_total, logprobs = 0.0, []
        for mb in micro_batches:
            lps = self.token_logprobs(self.compute, mb, self.settings.share_prompts)
            loss = loss_fn(mb, lps)
            if not torch.isfinite(loss):
                return loss_total, logprobs, False
            loss.backward()
            loss_total += float(loss.detach())
            logprobs.extend(x.detach() for x in lps)
        return loss_total, logprobs, True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.compute.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        """Hand the gradients to the fp32 master, clip them, and step AdamW when their norm is
        finite. Returns the norm (NaN or inf: no step was taken)."""
        if self.compute is not self.master:
            copy_grads_to_master(self.master, self.compute)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.settings.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts updates actually taken
        return grad_norm

    def _next_version(self, took_step: bool) -> None:
        """Publish version + 1 (the same weights again when the update was skipped)."""
        if not took_step:
            self.skipped_updates += 1
        self.zero_grad()
        self._sync_compute()
        self.version += 1
        self._remember_version()

    def train_step(self, groups: list[list[Rollout]]) -> dict[str, float]:
        """One RL optimizer step on the given groups; publishes version + 1. Returns metrics."""
        s = self.settings
        rollouts = [r for g in groups for r in g if r.completion_ids]
        advantages = {}
        for g in groups:
            adv = group_advantages(torch.tensor([r.reward for r in g]), s.leave_one_out, s.advantage_std_norm)
            advantages.update({id(r): float(a) for r, a in zip(g, adv)})
        num_tokens = sum(len(r.policy_positions()) for r in rollouts)
        normalizer = float(max(num_tokens, 1))

        def loss_fn(mb: list[Rollout], lps: list[torch.Tensor]) -> torch.Tensor:
            on = {"device": lps[0].device}
            mu = torch.tensor([x for r in mb for x in r.policy_logprobs()], dtype=torch.float32, **on)
            adv = torch.tensor([advantages[id(r)] for r, x in zip(mb, lps) for _ in range(len(x))], dtype=torch.float32, **on)
            seq_index = torch.tensor([i for i, x in enumerate(lps) for _ in range(len(x))], dtype=torch.long, **on)
            return policy_loss(torch.cat(lps), mu, adv, seq_index, normalizer, s.objective)

        self.zero_grad()
        loss_total, trainer_lps, finite = self.forward_backward(self.micro_batches(rollouts), loss_fn)
        grad_norm = self._optimizer_step() if finite else float("nan")
        took_step = math.isfinite(grad_norm)
        root = self.reducer is None or self.reducer.is_root  # only the root rank gets all logprobs
        metrics = self._diagnostics(rollouts, trainer_lps) if took_step and root else {}
        self._next_version(took_step)
        metrics.update(
            {
                "loss": loss_total if took_step else float("nan"),
                "grad_norm": grad_norm,
                "lr": self.optimizer.param_groups[0]["lr"],
                "train/skipped_updates": float(self.skipped_updates),
                "train/completion_tokens": float(num_tokens),
            }
        )
        return metrics

    def supervised_step(self, rollouts: list[Rollout]) -> dict[str, float]:
        """One step of next-token cross-entropy on the sampled-token positions of `rollouts` (the
        mean over those tokens); publishes version + 1. Returns loss and gradient norm."""
        num_tokens = float(max(sum(len(r.policy_positions()) for r in rollouts), 1))
        self.zero_grad()
        loss, _, finite = self.forward_backward(
            self.micro_batches(rollouts), lambda mb, lps: -torch.cat(lps).sum() / num_tokens
        )
        grad_norm = self._optimizer_step() if finite else float("nan")
        took_step = math.isfinite(grad_norm)
        self._next_version(took_step)
        return {"loss": loss if took_step else float("nan"), "grad_norm": grad_norm}

    # ------------------------------------------------------------- diagnostics

    @torch.no_grad()
    def _diagnostics(self, rollouts: list[Rollout], trainer_lps: list[torch.Tensor]) -> dict[str, float]:
        step = self.version
        pi = torch.cat(trainer_lps)
        mu = torch.tensor([x for r in rollouts for x in r.policy_logprobs()], dtype=torch.float32, device=pi.device)
        per_rollout = [set(r.policy_versions()) for r in rollouts]
        versions = torch.tensor([v for r in rollouts for v in r.policy_versions()], dtype=torch.long, device=pi.device)
        log_w = pi - mu
        w = torch.exp(log_w)
        median = float(w.median())
        lag = (step - versions).float()
        out = {
            "is/peak": float(w.max()),
            "is/median": median,
            "is/peak_over_median": float(w.max()) / median if median > 0 else float("inf"),
            "is/ess": float(w.sum() ** 2 / (w.numel() * (w * w).sum())),
            "is/mismatch_kl": float((w - log_w - 1).mean()),
            "is/frac_above_2": float((w > 2).float().mean()),
            "lag/mean": float(lag.mean()),
            "lag/max": float(lag.max()),
        }
        if self.settings.decompose:
            # log π_θv per token: from the rollout where its worker scored it (rzero.rollout.scoring),
            # else one forward here per old version (tokens of the current version: π itself).
            offsets = [0, *itertools.accumulate(len(x) for x in trainer_lps)]
            unscored = [i for i, r in enumerate(rollouts) if r.version_logprobs is None]
            if len(unscored) == len(rollouts):
                pi_v = pi.clone()
            else:
                pairs = list(zip(rollouts, trainer_lps))
                filled = [x for r, lp in pairs for x in (r.policy_version_logprobs() or [0.0] * len(lp))]
                from_workers = [r.version_logprobs is not None for r, lp in pairs for _ in range(len(lp))]
                pi_v = torch.where(
                    torch.tensor(from_workers, device=pi.device), torch.tensor(filled, dtype=torch.float32, device=pi.device), pi
                )
            for v in sorted({v for i in unscored for v in per_rollout[i]} - {step}):
                if v not in self.ring:
                    raise RuntimeError(f"weights of version {v} left the ring buffer (lag beyond max_lag?)")
                chosen = [i for i in unscored if v in per_rollout[i]]
                scored = self.token_logprobs(self._scratch_model(v), [rollouts[i] for i in chosen], self.settings.share_prompts)
                for i, lp in zip(chosen, scored):
                    sl = slice(offsets[i], offsets[i + 1])
                    mask = versions[sl] == v
                    pi_v[sl][mask] = lp[mask]
            out["mismatch/kernel_max_abs"] = float((pi_v - mu).abs().max())
            out["mismatch/lag_max_abs"] = float((pi - pi_v).abs().max())
        return out

    def _scratch_model(self, version: int) -> Qwen3ForCausalLM:
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.compute).eval()
            for p in self._scratch.parameters():
                p.requires_grad_(False)
            self._scratch.pack_weights()
        with torch.no_grad():
            for name, p in self._scratch.named_parameters():
                p.copy_(self.ring[version][name])
        return self._scratch

    # ------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "skipped_updates": self.skipped_updates,
            "ring": dict(self.ring),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.skipped_updates = state["skipped_updates"]
        self.ring = OrderedDict(sorted(state["ring"].items()))
        self._sync_compute()
