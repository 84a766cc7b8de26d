"""A dense decoder layer's training forward as one autograd node (rzero/ops/train_layer.py): the
logprobs have the bits of the layer's ops run one by one, the gradients too (every parameter, fp32
and bf16, 1 and 2 threads, GRPO groups whose prompts end inside a cache block), under gradient
checkpointing as well; a backward that drops a term is caught; it runs in every dense layer of a
training forward and stays out where it does not apply."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_cpu_kernel import needs_kernel

from rzero.model.io import load_model
from rzero.ops import invariant, numerics, train_layer
from rzero.rollout.record import Rollout
from rzero.train.trainer import Trainer


def _rollouts(seed: int, vocab: int) -> list[Rollout]:
    """GRPO-like groups: prompts ending before, at and past a block boundary (shared partial
    blocks), completions of 0-19 tokens, one with environment tokens."""
    rng = random.Random(seed)
    rollouts = []
    for prompt_len in (3, 15, 16, 17, 33):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for _ in range(3):
            n = rng.randrange(0, 20)
            mask = [int(i % 3 != 1) for i in range(n)] if n > 2 and n % 2 else None
            rollouts.append(Rollout(prompt, [rng.randrange(vocab) for _ in range(n)], [0.0] * n, [0] * n, 0.0, mask=mask))
    return rollouts


def _logprobs_and_grads(model, rollouts, fused: bool, monkeypatch) -> tuple[list[torch.Tensor], dict, int]:
    """Token logprobs, the gradients of a weighted sum of them, and how many layers ran fused."""
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(invariant, "train_decoder_layer", lambda *args: None)
        model.zero_grad(set_to_none=True)
        before = sum(train_layer.CALLS.values())
        lps = Trainer.token_logprobs(model, rollouts, share_prompts=True)
        ran = sum(train_layer.CALLS.values()) - before
        flat = torch.cat(lps)
        (flat.float() * torch.linspace(-1, 1, len(flat))).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [x.detach() for x in lps], grads, ran


def _assert_same(a, b) -> None:
    (lps_a, grads_a, _), (lps_b, grads_b, _) = a, b
    assert all(torch.equal(x, y) for x, y in zip(lps_a, lps_b)), "logprobs differ"
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), f"gradient of {name} differs"


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_node_gives_the_ops_logprobs_and_gradients(tiny_dense_dir, dtype, threads, monkeypatch):
    model = load_model(tiny_dense_dir, dtype)
    if dtype == "bf16":
        model.pack_weights()  # the trainer's bf16 compute copy is packed
    rollouts = _rollouts(threads, model.config.vocab_size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = _logprobs_and_grads(model, rollouts, True, monkeypatch)
        ops = _logprobs_and_grads(model, rollouts, False, monkeypatch)
        model.gradient_checkpointing = True
        checkpointed = _logprobs_and_grads(model, rollouts, True, monkeypatch)
    finally:
        torch.set_num_threads(previous)
        model.gradient_checkpointing = False
    layers = model.config.num_hidden_layers
    assert fused[2] == checkpointed[2] == layers and ops[2] == 0
    _assert_same(fused, ops)
    _assert_same(checkpointed, ops)


@needs_kernel
def test_a_backward_that_drops_the_shared_prompt_copies_is_caught(tiny_dense_dir, monkeypatch):
    """Negative control: without the gradient through the prompt rows copied into each
    completion's block, the k/v weights' gradients differ from the ops'."""
    model = load_model(tiny_dense_dir, "fp32")
    rollouts = _rollouts(5, model.config.vocab_size)
    ops = _logprobs_and_grads(model, rollouts, False, monkeypatch)
    original = train_layer._private_cache_grad

    def without_copies(grad_cache, meta, rows):
        meta = copy.copy(meta)
        meta.copy_slots = meta.copy_rows = None
        return original(grad_cache, meta, rows)

    monkeypatch.setattr(train_layer, "_private_cache_grad", without_copies)
    fused = _logprobs_and_grads(model, rollouts, True, monkeypatch)
    assert fused[2] == model.config.num_hidden_layers
    assert all(torch.equal(x, y) for x, y in zip(fused[0], ops[0]))  # the forward is untouched
    differs = [name for name in ops[1] if not torch.equal(fused[1][name], ops[1][name])]
    assert any("k_proj" in name for name in differs) and any("v_proj" in name for name in differs)


def test_it_stays_out_where_it_does_not_apply(tiny_model_dirs, monkeypatch):
    """MoE layers, standard numerics, no gradient, and (dense, invariant) a model whose MLP width
    is not a multiple of the elementwise tile run the ops."""
    rollouts = _rollouts(7, 1000)
    moe = load_model(tiny_model_dirs["tiny-moe"], "fp32")
    assert _logprobs_and_grads(moe, rollouts, True, monkeypatch)[2] == 0
    dense = load_model(tiny_model_dirs["tiny-dense"], "fp32")
    dense.numerics = numerics("standard")
    assert _logprobs_and_grads(dense, rollouts, True, monkeypatch)[2] == 0
    dense.numerics = numerics("invariant")
    before = sum(train_layer.CALLS.values())
    with torch.no_grad():
        Trainer.token_logprobs(dense, rollouts)
    assert sum(train_layer.CALLS.values()) == before
    params = dense.model.layers[0].train_params()
    odd = params._replace(gate=params.gate[:96], up=params.up[:96], down=params.down[:, :96])
    h = torch.zeros(16, dense.config.hidden_size)
    assert not train_layer.applies(h, odd, torch.zeros(16, 1, dense.config.head_dim))
    assert train_layer.applies(h, params, torch.zeros(16, 1, dense.config.head_dim)) == (train_layer.cpu_kernel.library() is not None)
