"""Each loss's gradient with respect to the token logprobs, checked against its formula."""

import math

import pytest
import torch

from rzero.train.losses import LOSSES, LossSettings, group_advantages, policy_loss

# A hand-made batch: two samples (3 and 2 completion tokens) with known ratios.
LOGP = [-1.0, -0.5, -2.0, -0.3, -1.2]
MU = [-1.2, -0.5, -0.9, -0.3, -2.0]  # w = exp(0.2), 1, exp(-1.1), 1, exp(0.8)
ADV = [0.5, 0.5, 0.5, -1.0, -1.0]
SEQ = [0, 0, 0, 1, 1]
Z = 5.0


def grad_of(name: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.tensor(LOGP, requires_grad=True)
    loss = policy_loss(logp, torch.tensor(MU), torch.tensor(ADV), torch.tensor(SEQ), Z, LossSettings(name, **kw))
    loss.backward()
    return loss.detach(), logp.grad


def w(i: int) -> float:
    return math.exp(LOGP[i] - MU[i])


def test_reinforce_is_gradient_is_minus_w_times_advantage_over_z():
    loss, grad = grad_of("reinforce_is")
    expected = torch.tensor([-w(i) * ADV[i] / Z for i in range(5)])
    assert torch.allclose(grad, expected, atol=1e-7)
    # No clipping of any kind: a ratio far from 1 keeps its full weight.
    assert w(4) > 2 and abs(grad[4] - (-w(4) * ADV[4] / Z)) < 1e-7


def test_on_policy_gradient_ignores_ratios():
    _, grad = grad_of("on_policy")
    assert torch.allclose(grad, torch.tensor([-a / Z for a in ADV]), atol=1e-7)


def test_tis_truncates_weights_at_cap():
    _, grad = grad_of("tis", tis_cap=1.5)
    expected = torch.tensor([-min(w(i), 1.5) * ADV[i] / Z for i in range(5)])
    assert torch.allclose(grad, expected, atol=1e-7)
    assert w(4) > 1.5  # the cap is active on token 4


def test_icepop_masks_tokens_outside_band():
    _, grad = grad_of("icepop", icepop_low=0.5, icepop_high=2.0)
    expected = torch.tensor([(-w(i) * ADV[i] / Z) if 0.5 <= w(i) <= 2.0 else 0.0 for i in range(5)])
    assert torch.allclose(grad, expected, atol=1e-7)
    assert grad[4] == 0 and grad[2] == 0  # w = 2.23 and 0.33 are masked


def test_seq_is_uses_sequence_ratio():
    _, grad = grad_of("seq_is")
    seq_w = [math.exp(sum(LOGP[i] - MU[i] for i in range(5) if SEQ[i] == s)) for s in (0, 1)]
    expected = torch.tensor([-seq_w[SEQ[i]] * ADV[i] / Z for i in range(5)])
    assert torch.allclose(grad, expected, atol=1e-6)


def test_ppo_clip_gradient_and_clipping():
    _, grad = grad_of("ppo_clip", clip_eps=0.2)
    expected = []
    for i in range(5):
        ratio = w(i)
        clipped = min(max(ratio, 0.8), 1.2)
        # d/dlogp of min(r A, clip(r) A): r A when the unclipped term is the smaller one, else 0.
        expected.append(-ratio * ADV[i] / Z if ratio * ADV[i] <= clipped * ADV[i] else 0.0)
    assert torch.allclose(grad, torch.tensor(expected), atol=1e-7)
    assert grad[4] != 0  # A < 0 and r > 1 + eps: pessimistic term keeps the gradient
    assert grad[0] == 0  # A > 0 and r > 1 + eps: clipped, no gradient
    assert grad[2] != 0  # A > 0 and r < 1 - eps: the unclipped term is smaller and keeps it


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_equals_reinforce_on_policy_at_ratio_one(name):
    logp = torch.tensor(LOGP, requires_grad=True)
    loss = policy_loss(logp, torch.tensor(LOGP), torch.tensor(ADV), torch.tensor(SEQ), Z, LossSettings(name))
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-a / Z for a in ADV]), atol=1e-7)


def test_unknown_loss_is_rejected():
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        LossSettings("ppo")


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert torch.equal(group_advantages(r), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    loo = group_advantages(r, leave_one_out=True)
    assert torch.allclose(loo, torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    normed = group_advantages(r, std_norm=True)
    assert torch.allclose(normed, torch.tensor([0.5, -0.5, -0.5, 0.5]) / (r.std() + 1e-6))
    assert torch.equal(group_advantages(torch.ones(4)), torch.zeros(4))
