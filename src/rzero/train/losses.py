"""Policy-gradient losses over completion tokens, one code path, chosen by name.

All losses share the normaliser Z = the number of completion tokens in the trainer step's batch
(a constant for the step, so micro-batch losses add up to the batch loss exactly). With
w_t = exp(log π_θ(a_t) − μ_t) the token-level importance ratio:

- reinforce_is (default, REINFORCE-Zero): −(1/Z) Σ stopgrad(w_t) A_i log π_θ(a_t). No clipping,
  truncation, masking or rejection of any kind.
- ppo_clip: −(1/Z) Σ min(w_t A_i, clip(w_t, 1−ε, 1+ε) A_i), μ playing the old policy.
- tis: −(1/Z) Σ stopgrad(min(w_t, C)) A_i log π_θ(a_t).
- icepop: −(1/Z) Σ 1[α ≤ w_t ≤ β] stopgrad(w_t) A_i log π_θ(a_t).
- seq_is: −(1/Z) Σ stopgrad(W_i) A_i log π_θ(a_t), W_i = exp(Σ_t∈i (log π_θ − μ)).
- on_policy: −(1/Z) Σ A_i log π_θ(a_t) (w ≡ 1, no correction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSSES = ("reinforce_is", "ppo_clip", "tis", "icepop", "seq_is", "on_policy")


@dataclass(frozen=True)
class LossSettings:
    loss: str = "reinforce_is"  # one of LOSSES
    clip_eps: float = 0.2
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)}")


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    normalizer: float,
    settings: LossSettings,
) -> torch.Tensor:
    """Loss summed over the given tokens and divided by `normalizer`.

    logprobs: (N,) log π_θ with grad; behaviour_logprobs, advantages: (N,); seq_index: (N,)
    sample id of each token (for seq_is).
    """
    log_ratio = logprobs - behaviour_logprobs
    name = settings.loss
    if name == "reinforce_is":
        weight = torch.exp(log_ratio.detach())
        per_token = weight * advantages * logprobs
    elif name == "on_policy":
        per_token = advantages * logprobs
    elif name == "tis":
        weight = torch.exp(log_ratio.detach()).clamp(max=settings.tis_cap)
        per_token = weight * advantages * logprobs
    elif name == "icepop":
        weight = torch.exp(log_ratio.detach())
        active = (weight >= settings.icepop_low) & (weight <= settings.icepop_high)
        per_token = active * weight * advantages * logprobs
    elif name == "seq_is":
        num_seqs = int(seq_index.max()) + 1 if seq_index.numel() else 0
        seq_log_ratio = torch.zeros(num_seqs, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, seq_index, log_ratio.detach())
        per_token = torch.exp(seq_log_ratio)[seq_index] * advantages * logprobs
    else:  # ppo_clip
        ratio = torch.exp(log_ratio)
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - settings.clip_eps, 1 + settings.clip_eps) * advantages
        per_token = torch.minimum(unclipped, clipped)
    return -per_token.sum() / normalizer


def group_advantages(rewards: torch.Tensor, leave_one_out: bool = False, std_norm: bool = False) -> torch.Tensor:
    """A_i = r_i − mean of the group (or of the other members, leave-one-out); optional std scaling."""
    n = rewards.numel()
    if leave_one_out and n > 1:
        adv = (rewards - (rewards.sum() - rewards) / (n - 1))
    else:
        adv = rewards - rewards.mean()
    if std_norm and n > 1:
        adv = adv / (rewards.std() + 1e-6)
    return adv
