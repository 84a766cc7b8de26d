"""An engine step's whole backbone in one C call (rzero/ops/cpu_stack.py) gives the bits of the
layers run one C call each, and of the layers' ops one by one: hidden states, caches, tokens and
logprobs; it stays out where a layer is not a dense one on the C layer, and takes no bad token id."""

from __future__ import annotations

import random

import pytest
import torch
from test_cpu_kernel import needs_bf16_gemm, needs_kernel
from test_cpu_layer import _model, _steps

from rzero.engine.engine import Engine
from rzero.engine.sequence import SamplingParams
from rzero.model.presets import PRESETS
from rzero.model.qwen3 import rotary_table
from rzero.ops import AttentionMeta, cpu_layer, gemm_route, invariant

PATHS = ("stack", "layers", "ops")  # one call; one call per layer; the layers' ops


_REAL_STACK, _REAL_LAYER = invariant.decoder_stack, invariant.decoder_layer


def _on(monkeypatch, path: str, ran: list | None = None) -> None:
    """Let the model's forward take `path`; `ran` gets an entry each time the stack did run."""

    def stack(*args):
        out = _REAL_STACK(*args)
        if out is not None and ran is not None:
            ran.append(1)
        return out

    monkeypatch.setattr(invariant, "decoder_stack", stack if path == "stack" else lambda *a: None)
    monkeypatch.setattr(invariant, "decoder_layer", _REAL_LAYER if path != "ops" else lambda *a: None)


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize(
    "dtype, fp32_tables",
    [pytest.param(torch.bfloat16, False, marks=needs_bf16_gemm), pytest.param(torch.bfloat16, True, marks=needs_bf16_gemm),
     pytest.param(torch.float32, False, marks=needs_kernel)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_stack_gives_the_bits_of_the_layers_and_of_their_ops(dtype, fp32_tables, threads, monkeypatch):
    """Prefill, a chunk beside decodes, then decodes, on shuffled blocks, each path on its own
    caches: every step's hidden states and every cache entry equal to the bit. `fp32_tables`: a
    bf16 model whose rotary tables stayed fp32 (the rows are rounded as the model rounds them)."""
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    model, rng = _model(seed=3, dtype=dtype), random.Random(10 + threads)
    if fp32_tables:
        model.rope_cos, model.rope_sin = rotary_table(model.config.head_dim, model.config.rope_theta, 1024)
    blocks = list(range(24))
    rng.shuffle(blocks)
    tables = [blocks[0:8], blocks[8:16], blocks[16:24]]
    caches = {path: model.new_kv_caches(24) for path in PATHS}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    steps = _steps(rng)
    name, ran = "bf16" if dtype == torch.bfloat16 else "fp32", []
    before = cpu_layer.CALLS[name]
    try:
        for q_lens, ctx_lens in steps:
            meta = AttentionMeta.build(q_lens, ctx_lens, tables, row_tile=model.numerics.row_tile)
            ids = torch.tensor([rng.randrange(model.config.vocab_size) for _ in range(sum(q_lens))])
            out = {}
            for path in PATHS:
                _on(monkeypatch, path, ran)
                with torch.inference_mode():
                    out[path] = model(ids, meta, caches[path])
            assert out["stack"].shape == (sum(q_lens), model.config.hidden_size)
            assert torch.equal(_int_view(out["stack"]), _int_view(out["layers"]))
            assert torch.equal(_int_view(out["stack"]), _int_view(out["ops"]))
    finally:
        torch.set_num_threads(previous)
    # both C paths count their layers (what `rzero check` reports)
    assert len(ran) == len(steps)
    assert cpu_layer.CALLS[name] - before == 2 * len(steps) * model.config.num_hidden_layers
    for path in ("layers", "ops"):
        for (k1, v1), (k2, v2) in zip(caches["stack"], caches[path]):
            assert torch.equal(_int_view(k1), _int_view(k2)) and torch.equal(_int_view(v1), _int_view(v2))


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16_gemm), pytest.param("fp32", marks=needs_kernel)])
def test_the_engines_tokens_and_logprobs_do_not_change(dtype, tiny_dense_dir, monkeypatch):
    """Shared prompts (forked groups), a weight update in place (the layouts made again), then
    more steps: the stack's tokens and logprobs are those of the ops, and it ran."""
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    rng = random.Random(2)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(4, 40))] for _ in range(5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=4, n=3)
    fresh = _model(seed=12, dtype=torch.float32).state_dict()
    results = {}
    for path in ("stack", "ops"):
        ran = []
        _on(monkeypatch, path, ran)
        engine = Engine(tiny_dense_dir, dtype=dtype)
        first = engine.generate(prompts, params)
        engine.update_weights(fresh, version=1)
        second = engine.generate(prompts, params)
        results[path] = [(o.token_ids, o.logprobs) for o in first + second]
        assert (len(ran) > 0) == (path == "stack")
    assert results["stack"] == results["ops"]


@needs_kernel
def test_the_stack_stays_out_of_what_it_does_not_cover_and_takes_no_bad_token_id(monkeypatch):
    model = _model(seed=1, dtype=torch.float32)
    caches = model.new_kv_caches(4)
    meta = AttentionMeta.build([3], [0], [[0]], row_tile=model.numerics.row_tile)
    layers = [layer.dense_weights() for layer in model.model.layers]
    rope, norm = (model.rope_cos, model.rope_sin), (model.model.norm.weight, model.model.norm.eps)
    ids = torch.tensor([5, 6, 7] + [0] * (meta.padded_tokens - 3))

    def stack(ids=ids, embed=model.model.embed_tokens.weight, rope=rope, layers=layers, caches=caches):
        return _REAL_STACK(ids, meta, embed, rope, layers, caches, norm, 0.1)

    with torch.inference_mode():
        assert stack() is not None
        assert stack(embed=model.model.embed_tokens.weight.bfloat16()) is None  # not the layers' dtype
        assert stack(ids=ids.int()) is None
        assert stack(caches=[(k.bfloat16(), v.bfloat16()) for k, v in caches]) is None
        assert stack(layers=layers[:-1]) is None  # one cache per layer
        cache_before = [(k.clone(), v.clone()) for k, v in caches]
        with pytest.raises(IndexError, match="outside the embedding's 1024 rows"):
            stack(ids=torch.tensor([5, 1024, 7] + [0] * (meta.padded_tokens - 3)))
        for (k, v), (k0, v0) in zip(caches, cache_before):  # refused before any layer wrote its K/V
            assert torch.equal(k, k0) and torch.equal(v, v0)
        # the embedding's storage swapped under the same parameter: read from its new address
        out = stack()
        embed = model.model.embed_tokens.weight
        embed.data = embed.data.clone() * 2
        assert not torch.equal(stack(), out)
        embed.data = embed.data / 2
        assert torch.equal(stack(), out)
        monkeypatch.setattr(cpu_layer, "f32_kblock", lambda K, N, threads: None)  # a GEMM not proven
        assert stack(layers=[layer.dense_weights() for layer in _model(seed=1, dtype=torch.float32).model.layers]) is None
    assert stack() is None  # a gradient may be wanted
    # an MoE model has no dense weights: its forward never asks for the stack
    monkeypatch.setattr(invariant, "decoder_stack", lambda *a: pytest.fail("the stack was asked for"))
    moe_cls, moe_config = PRESETS["tiny-moe"]
    moe = moe_cls(moe_config)
    moe.pack_weights()
    with torch.inference_mode():
        moe(torch.tensor([5, 6, 7]), meta, moe.new_kv_caches(4))
