"""The engine's dense decoder layer in one C call (rzero/ops/cpu_layer.py, csrc/kernels.c
rz_decoder_layer), bf16 and fp32: its elementwise ops have torch's bits (and a changed one is
caught), its fp32 GEMM the invariant linear's where the K blocks are proven, the layer gives the
bits of its ops run one by one for prefill, chunks and decode steps on 1 and 2 threads, the
engine's tokens and logprobs do not change, and it stays out of every case it does not cover."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_cpu_kernel import PORTABLE, needs_bf16_gemm, needs_kernel

from rzero.engine.engine import Engine
from rzero.engine.sequence import SamplingParams
from rzero.model.presets import PRESETS
from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.ops import AttentionMeta, cpu_kernel, cpu_layer, gemm_route, invariant


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_elementwise_ops_have_torchs_bits_and_a_changed_exp_is_caught(dtype, tmp_path):
    """silu(gate) * up and the residual add against torch (all 65536 bf16 values; for fp32 also
    random bit patterns and magnitudes), native and portable builds; a build whose exp polynomial
    is off in one coefficient's sixth digit fails."""
    assert cpu_layer.elementwise_proven(dtype)
    assert cpu_layer.elementwise_proven(dtype, cpu_kernel.load(PORTABLE, cache_dir=tmp_path))
    text = cpu_kernel.SOURCE.read_text()
    assert text.count("#define EXP_C0 0.5f") == 1
    changed = tmp_path / "kernels.c"
    changed.write_text(text.replace("#define EXP_C0 0.5f", "#define EXP_C0 0.50001f"))
    assert not cpu_layer.elementwise_proven(dtype, cpu_kernel.load(source=changed, cache_dir=tmp_path))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fp32_gemm_gets_the_invariant_linears_bits_where_its_k_blocks_are_proven(threads, tmp_path):
    """f32_kblock finds the K block that gives the invariant linear's bits (torch.mm's on 16-row
    tiles) for the tiny presets' shapes (K = 128, 512) and a two-halves one (K = 256); another
    block gives other bits, and the portable build (scalar fmaf) the same bits as the native one.
    The invariant linear itself runs on it then (`own_gemm`), for any row count."""
    from rzero.ops import invariant

    portable = cpu_kernel.load(PORTABLE, cache_dir=tmp_path)
    gen = torch.Generator().manual_seed(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for K, N in [(128, 256), (512, 128), (256, 96)]:
            kblock = cpu_layer.f32_kblock(K, N, threads)
            assert kblock is not None
            x, w = torch.randn(37, K, generator=gen), torch.randn(N, K, generator=gen)
            packed = cpu_layer.f32_pack(w)
            # the invariant linear's definition: torch.mm on 16-row tiles (zero rows after the last)
            expected = invariant._small_tiles(torch.cat((x, x.new_zeros(11, K))), w.t())[:37]
            assert torch.equal(cpu_layer.f32_gemm(x, packed, N, kblock), expected)
            assert torch.equal(cpu_layer.f32_gemm(x, packed, N, kblock, lib=portable), expected)
            with torch.no_grad():
                assert torch.equal(invariant.linear(x, w), expected)
                assert torch.equal(invariant.linear(x[3:4], w), expected[3:4])
            if K > 192:  # one chain over the whole K is not torch's sum here
                assert not torch.equal(cpu_layer.f32_gemm(x, packed, N, K), expected)
    finally:
        torch.set_num_threads(previous)


def _counting(real, ran: list):
    """`real` (invariant.decoder_layer), appending to `ran` each time the C layer did run (not None)."""

    def layer(*args):
        out = real(*args)
        if out is not None:
            ran.append(1)
        return out

    return layer


def _model(seed: int, dtype: torch.dtype = torch.bfloat16) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(PRESETS["tiny-dense"][1])
    model.init_weights(seed)
    model.to(dtype)
    model.pack_weights()
    return model


def _steps(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(q_lens, ctx_lens) of an engine's steps over three sequences: whole prompts, then the first
    sequence's next chunk beside two decodes, then decode steps."""
    steps = [([33, 17, 5], [0, 0, 0]), ([20, 1, 1], [33, 17, 5])]
    ctx = [53, 18, 6]
    for _ in range(rng.randint(3, 6)):
        steps.append(([1, 1, 1], list(ctx)))
        ctx = [c + 1 for c in ctx]
    return steps


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16_gemm), pytest.param(torch.float32, marks=needs_kernel)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_layer_gives_the_bits_of_the_layers_ops(dtype, threads, monkeypatch):
    """The same model and steps run twice on their own caches, once on the C layer and once op by
    op: every step's hidden states and every cache entry equal to the bit, on shuffled blocks."""
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    monkeypatch.setattr(invariant, "decoder_stack", lambda *a: None)  # one call per layer (test_cpu_stack.py: all)
    model, rng = _model(seed=7, dtype=dtype), random.Random(threads)
    blocks = list(range(24))
    rng.shuffle(blocks)
    tables = [blocks[0:8], blocks[8:16], blocks[16:24]]
    caches = {"c layer": model.new_kv_caches(24), "ops": model.new_kv_caches(24)}
    real, used = invariant.decoder_layer, []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps = _steps(rng)
        for q_lens, ctx_lens in steps:
            meta = AttentionMeta.build(q_lens, ctx_lens, tables, row_tile=model.numerics.row_tile)
            ids = torch.tensor([rng.randrange(model.config.vocab_size) for _ in range(sum(q_lens))])
            out = {}
            for path, layer_fn in (("c layer", _counting(real, used)), ("ops", lambda *a: None)):
                monkeypatch.setattr(invariant, "decoder_layer", layer_fn)
                with torch.inference_mode():
                    out[path] = model(ids, meta, caches[path])
            assert torch.equal(out["c layer"].view(torch.int16), out["ops"].view(torch.int16))
    finally:
        torch.set_num_threads(previous)
    assert len(used) == len(steps) * model.config.num_hidden_layers
    for (k1, v1), (k2, v2) in zip(caches["c layer"], caches["ops"]):
        assert torch.equal(k1.view(torch.int16), k2.view(torch.int16))
        assert torch.equal(v1.view(torch.int16), v2.view(torch.int16))


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16_gemm), pytest.param("fp32", marks=needs_kernel)])
def test_the_engines_tokens_and_logprobs_do_not_change(dtype, tiny_dense_dir, monkeypatch):
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    monkeypatch.setattr(invariant, "decoder_stack", lambda *a: None)
    monkeypatch.setattr(invariant, "decode_steps", lambda *a: None)  # each step's layers: the calls counted here
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0)
    real, used = invariant.decoder_layer, []
    monkeypatch.setattr(invariant, "decoder_layer", _counting(real, used))
    engine = Engine(tiny_dense_dir, dtype=dtype)
    before = cpu_layer.CALLS[dtype]
    fused = engine.generate(prompts, params)
    assert used and cpu_layer.CALLS[dtype] - before == len(used)  # what `rzero check` reports
    monkeypatch.setattr(invariant, "decoder_layer", lambda *a: None)
    by_ops = Engine(engine.model, dtype=dtype).generate(prompts, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in by_ops]
    assert [o.logprobs for o in fused] == [o.logprobs for o in by_ops]


@needs_kernel
def test_the_c_layer_stays_out_of_what_it_does_not_cover(monkeypatch):
    """A dtype other than the weights', a gradient wanted, weights not packed, bf16 weights off
    our GEMM, fp32 weights whose K blocks are not proven, an MLP width with a scalar tail in
    torch's silu, an MoE layer: each runs the layer's ops."""
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    model = _model(seed=1)
    layer = model.model.layers[0]
    weights = layer.dense_weights()
    assert weights is not None
    cache = model.new_kv_caches(4)[0]
    meta = AttentionMeta.build([3], [0], [[0]], row_tile=model.numerics.row_tile)
    h = torch.randn(meta.padded_tokens, model.config.hidden_size).bfloat16()
    cos = model.rope_cos[meta.positions].bfloat16().unsqueeze(1)
    sin = model.rope_sin[meta.positions].bfloat16().unsqueeze(1)

    def fresh(**changes):  # a copy with no argument plan yet
        return dataclasses.replace(weights, **changes)

    with torch.inference_mode():
        assert cpu_layer.decoder_layer(h, fresh(), cos, sin, meta, cache, 0.1) is not None
        assert cpu_layer.decoder_layer(h.float(), fresh(), cos, sin, meta, cache, 0.1) is None
        assert cpu_layer.decoder_layer(h, fresh(gate_up_sizes=[500, 500]), cos, sin, meta, cache, 0.1) is None
        monkeypatch.setattr(gemm_route, "KERNEL_MAX", 1)
        assert cpu_layer.decoder_layer(h, fresh(), cos, sin, meta, cache, 0.1) is None
    monkeypatch.setattr(gemm_route, "KERNEL_MAX", 1 << 20)
    trained = fresh(down=weights.down.detach().clone().requires_grad_())
    assert cpu_layer.decoder_layer(h, trained, cos, sin, meta, cache, 0.1) is None
    # fp32: on where every K block is proven, off where one is not
    model32 = _model(seed=1, dtype=torch.float32)
    weights32, cache32 = model32.model.layers[0].dense_weights(), model32.new_kv_caches(4)[0]
    with torch.inference_mode():
        args = (h.float(), cos.float(), sin.float(), meta, cache32, 0.1)
        assert cpu_layer.decoder_layer(args[0], dataclasses.replace(weights32), *args[1:]) is not None
        monkeypatch.setattr(gemm_route, "KERNEL_MAX", 1 << 16)  # too big for rz_f32_gemm: MKL's
        assert cpu_layer.decoder_layer(args[0], dataclasses.replace(weights32), *args[1:]) is None
        monkeypatch.setattr(gemm_route, "KERNEL_MAX", 1 << 20)
        monkeypatch.setattr(cpu_layer, "f32_kblock", lambda K, N, threads: None if K == 512 else 128)
        assert cpu_layer.decoder_layer(args[0], dataclasses.replace(weights32), *args[1:]) is None
    # kept by the layer while current; a cast, or a parameter put in another's place, is seen
    assert layer.dense_weights() is weights
    layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight.detach().clone())
    assert layer.dense_weights() is not weights and layer.dense_weights() is layer.dense_weights()
    model.float()
    assert layer.dense_weights() is None  # the packed weights are no longer what the layer multiplies
    unpacked = Qwen3ForCausalLM(PRESETS["tiny-dense"][1]).to(torch.bfloat16)
    assert unpacked.model.layers[0].dense_weights() is None
    moe_cls, moe_config = PRESETS["tiny-moe"]
    moe = moe_cls(moe_config).to(torch.bfloat16)
    moe.pack_weights()
    assert all(layer.dense_weights() is None for layer in moe.model.layers)


@pytest.mark.parametrize("dtype", [pytest.param("bf16", marks=needs_bf16_gemm), pytest.param("fp32", marks=needs_kernel)])
def test_the_c_layer_follows_weight_updates(dtype, tiny_dense_dir, monkeypatch):
    """After Engine.update_weights (in place: the GEMM layouts are made again), the engine's tokens
    and logprobs are those of an engine built on the new weights."""
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    monkeypatch.setattr(invariant, "decoder_stack", lambda *a: None)
    rng = random.Random(1)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(4, 30))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5)  # not the request count's
    engine = Engine(tiny_dense_dir, dtype=dtype)
    engine.generate(prompts, params)  # the layers' plans and layouts made on the old weights
    fresh = _model(seed=11, dtype=torch.float32)
    engine.update_weights(fresh.state_dict(), version=1)
    after = engine.generate(prompts, params)
    reference = Engine(fresh, dtype=dtype).generate(prompts, params)
    assert [o.token_ids for o in after] == [o.token_ids for o in reference]
    assert [o.logprobs for o in after] == [o.logprobs for o in reference]
