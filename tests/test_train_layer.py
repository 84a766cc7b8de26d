"""A decoder layer's training forward as two autograd nodes, its attention block and its dense MLP
block (rzero/ops/train_layer.py): the logprobs have the bits of the layer's ops run one by one,
the gradients too (every parameter, fp32 and bf16, 1 and 2 threads, GRPO groups whose prompts end
inside a cache block, MoE layers' attention blocks), under gradient checkpointing as well; a
backward that drops a term is caught; the blocks run in every layer they apply to and stay out
where they do not."""

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


def _logprobs_and_grads(model, rollouts, fused: bool, monkeypatch) -> tuple[list[torch.Tensor], dict, dict]:
    """Token logprobs, the gradients of a weighted sum of them, and how many blocks of each kind
    ran as one node."""
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(invariant, "train_attention", lambda *args: None)
            patch.setattr(invariant, "train_mlp", lambda *args: None)
        model.zero_grad(set_to_none=True)
        before = dict(train_layer.CALLS)
        lps = Trainer.token_logprobs(model, rollouts, share_prompts=True)
        ran = {kind: sum(n - before.get(k, 0) for k, n in train_layer.CALLS.items() if k.startswith(kind))
               for kind in ("attention", "mlp")}
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
    assert fused[2] == checkpointed[2] == {"attention": layers, "mlp": layers}
    assert ops[2] == {"attention": 0, "mlp": 0}
    _assert_same(fused, ops)
    _assert_same(checkpointed, ops)


@needs_kernel
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_moe_layer_runs_its_attention_block_as_one_node(tiny_moe_dir, dtype, monkeypatch):
    """The experts run op by op after it; logprobs and gradients are still the ops' bits."""
    model = load_model(tiny_moe_dir, dtype)
    rollouts = _rollouts(11, model.config.vocab_size)
    fused = _logprobs_and_grads(model, rollouts, True, monkeypatch)
    ops = _logprobs_and_grads(model, rollouts, False, monkeypatch)
    assert fused[2] == {"attention": model.config.num_hidden_layers, "mlp": 0}
    _assert_same(fused, ops)


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
    assert fused[2]["attention"] == model.config.num_hidden_layers
    assert all(torch.equal(x, y) for x, y in zip(fused[0], ops[0]))  # the forward is untouched
    differs = [name for name in ops[1] if not torch.equal(fused[1][name], ops[1][name])]
    assert any("k_proj" in name for name in differs) and any("v_proj" in name for name in differs)


def test_it_stays_out_where_it_does_not_apply(tiny_model_dirs, monkeypatch):
    """Standard numerics and no gradient run the ops; so does (dense, invariant) an MLP whose width
    is not a multiple of the elementwise tile."""
    rollouts = _rollouts(7, 1000)
    dense = load_model(tiny_model_dirs["tiny-dense"], "fp32")
    dense.numerics = numerics("standard")
    assert _logprobs_and_grads(dense, rollouts, True, monkeypatch)[2] == {"attention": 0, "mlp": 0}
    dense.numerics = numerics("invariant")
    before = dict(train_layer.CALLS)
    with torch.no_grad():
        Trainer.token_logprobs(dense, rollouts)
    assert dict(train_layer.CALLS) == before
    layer = dense.model.layers[0]
    mlp, attention = layer.mlp_params(), layer.attention_params()
    odd = mlp._replace(gate=mlp.gate[:96], up=mlp.up[:96], down=mlp.down[:, :96])
    h, cos = torch.zeros(16, dense.config.hidden_size), torch.zeros(16, 1, dense.config.head_dim)
    built = train_layer.cpu_kernel.library() is not None
    assert not train_layer.mlp_applies(h, odd) and train_layer.mlp_applies(h, mlp) == built
    assert train_layer.attention_applies(h, attention, cos) == built
    assert not train_layer.attention_applies(h.bfloat16(), attention, cos)  # one dtype throughout


@needs_kernel
def test_frozen_parameters_get_no_gradient_and_the_rest_the_ops(tiny_dense_dir, monkeypatch):
    """Parameters that want no gradient (a frozen embedding, norms and projections) get none, and
    every other one the op path's bits."""
    model = load_model(tiny_dense_dir, "fp32")
    frozen = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.2.mlp.down_proj.weight", "model.layers.3.self_attn.k_norm.weight")
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    rollouts = _rollouts(13, model.config.vocab_size)
    fused = _logprobs_and_grads(model, rollouts, True, monkeypatch)
    ops = _logprobs_and_grads(model, rollouts, False, monkeypatch)
    assert fused[2]["attention"] == model.config.num_hidden_layers
    assert not set(frozen) & set(fused[1])
    _assert_same(fused, ops)
