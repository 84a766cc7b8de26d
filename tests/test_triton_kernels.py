"""The CUDA `invariant` kernels (rzero/ops/triton_kernels.py), run on the CPU by Triton's
interpreter (TRITON_INTERPRET=1; fp32 only: the interpreter has no bf16).

Each kernel is checked against a stock PyTorch reference (allclose) and for the batch invariance
of its design (torch.equal): a row alone vs in batches of other sizes and positions, and for
attention a query in one prefill vs a chunked prefill vs decode steps vs a batch of neighbours.
The interpreter runs each block op with numpy, so these tests prove the kernels' index
arithmetic, masking and reduction order, not the GPU's MMA units: those are for the device check
(benchmarks/device_check.sh). Negative controls show that the probes see a change of reduction
order, so the invariance tests cannot pass vacuously.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before triton_kernels is imported: @triton.jit reads it
pytest.importorskip("triton", reason="triton is not installed (pip install 'reinforce-zero[test]')")

from rzero.ops import ATTN_BLOCK, AttentionMeta, cuda_invariant  # noqa: E402
from rzero.ops import standard as std  # noqa: E402
from rzero.ops import triton_kernels as tk  # noqa: E402

TILES = (16, 16, 16)  # small matmul tiles keep the interpreter quick; the design is the same


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def probe(g: torch.Generator, rows: int, k: int) -> torch.Tensor:
    """Entries 0, ±1, ±2^24 and small odd values: fp32 sums of their products depend on the order
    in which they are grouped (2^24 + 1 - 2^24 is 0 or 1), so any change of grouping shows."""
    choice = torch.randint(0, 5, (rows, k), generator=g)
    values = torch.tensor([0.0, 1.0, -1.0, 2.0**24, 3.0])
    return values[choice] * torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)


def test_matmul_matches_torch():
    g = gen(0)
    x, w = torch.randn(37, 72, generator=g), torch.randn(40, 72, generator=g)
    torch.testing.assert_close(tk.matmul(x, w, TILES), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tk.matmul(x, w), x @ w.T, rtol=1e-5, atol=1e-5)  # the fp32 default tiles
    with pytest.raises(ValueError, match="weight is"):
        tk.matmul(x, w.double())


def test_matmul_row_is_batch_invariant():
    g = gen(1)
    k, n = 80, 24  # K not a multiple of BLOCK_K: the masked tail is in every row's sum
    w = probe(g, n, k)
    row = probe(g, 1, k)
    alone = tk.matmul(row, w, TILES)
    for rows, pos in [(2, 1), (17, 16), (33, 5), (64, 63)]:
        batch = probe(g, rows, k)
        batch[pos] = row[0]
        assert torch.equal(tk.matmul(batch, w, TILES)[pos], alone[0]), (rows, pos)


def test_matmul_probe_sees_a_change_of_k_blocking():
    # Negative control: the same row with another BLOCK_K (what a split-K or a shape-dependent
    # kernel choice does) gives other bits, so the test above would catch it.
    g = gen(2)
    w, row = probe(g, 24, 80), probe(g, 1, 80)
    assert not torch.equal(tk.matmul(row, w, (16, 16, 16)), tk.matmul(row, w, (16, 16, 32)))


def test_rms_norm_matches_and_is_batch_invariant():
    g = gen(3)
    x, w = torch.randn(21, 96, generator=g), torch.randn(96, generator=g)
    torch.testing.assert_close(tk.rms_norm(x, w, 1e-6), std.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    alone = tk.rms_norm(x[7:8], w, 1e-6)
    assert torch.equal(tk.rms_norm(x, w, 1e-6)[7], alone[0])
    assert torch.equal(tk.rms_norm(x[5:40].repeat(3, 1), w, 1e-6)[2], alone[0])
    heads = torch.randn(5, 4, 32, generator=g)  # per-head norms: (rows, heads, head_dim)
    torch.testing.assert_close(tk.rms_norm(heads, w[:32], 1e-6), std.rms_norm(heads, w[:32], 1e-6))


@pytest.mark.parametrize("log", [True, False])
def test_softmax_matches_and_is_batch_invariant(log):
    g = gen(4)
    x = torch.randn(9, 300, generator=g) * 4
    x[3, 100:] = float("-inf")  # truncated logits (top-k / top-p) stay exact zeros / -inf
    fn = tk.log_softmax if log else tk.softmax
    ref = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    torch.testing.assert_close(fn(x, 64), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fn(x), ref, rtol=1e-5, atol=1e-6)  # the default chunk (> the row)
    for i in (0, 3):
        alone = fn(x[i : i + 1], 64)[0]
        assert torch.equal(fn(x, 64)[i], alone)
        assert torch.equal(fn(torch.cat([torch.randn(30, 300, generator=g), x[i : i + 1]]), 64)[30], alone)


def test_softmax_probe_sees_a_change_of_chunking():
    # Negative control: another chunk width regroups the sum of exponentials and moves the bits.
    x = torch.randn(4, 1000, generator=gen(5)) * 6
    assert not torch.equal(tk.log_softmax(x, 32), tk.log_softmax(x, 128))


# ------------------------------------------------------------------------------------- attention

H, HKV, D = 4, 2, 16  # GQA: two query heads per KV head
SCALE = D**-0.5


def filled_cache(g: torch.Generator, lengths: list[int]):
    """K/V caches holding every position of each sequence, in blocks laid out per sequence (the
    last sequence's blocks reversed, so block ids are not in position order)."""
    tables, blocks = [], 0
    for n in lengths:
        count = -(-n // ATTN_BLOCK)
        tables.append(list(range(blocks, blocks + count)))
        blocks += count
    tables[-1].reverse()
    k = torch.randn(blocks, ATTN_BLOCK, HKV, D, generator=g)
    v = torch.randn(blocks, ATTN_BLOCK, HKV, D, generator=g)
    return k, v, tables


def run(q_of, chunks: list[tuple[int, int, int]], k, v, tables) -> list[torch.Tensor]:
    """Attention for one batch of chunks (sequence, first position, length); queries from q_of."""
    meta = AttentionMeta.build([n for _, _, n in chunks], [p for _, p, _ in chunks], [tables[s] for s, _, _ in chunks],
                               row_tile=16)
    q = torch.zeros(meta.padded_tokens, H, D)
    q[: meta.num_tokens] = torch.cat([q_of[s][p : p + n] for s, p, n in chunks])
    out = tk.attention(q, k, v, meta, SCALE)
    assert not out[meta.num_tokens :].any()  # padding rows come back as zeros
    return list(out[: meta.num_tokens].split([n for _, _, n in chunks]))


def test_attention_matches_the_reference():
    g = gen(6)
    lengths = [37, 5, 20]
    k, v, tables = filled_cache(g, lengths)
    q_of = [torch.randn(n, H, D, generator=g) for n in lengths]
    chunks = [(0, 10, 27), (1, 4, 1), (2, 0, 20)]  # a chunk after a cached prefix, a decode, a prefill
    meta = AttentionMeta.build([27, 1, 20], [10, 4, 0], tables, row_tile=16)
    q = torch.zeros(meta.padded_tokens, H, D)
    q[:48] = torch.cat([q_of[s][p : p + n] for s, p, n in chunks])
    ref = std.attention(q, k, v, meta, SCALE)[:48]
    torch.testing.assert_close(tk.attention(q, k, v, meta, SCALE)[:48], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        tk.attention(q[..., :12], k[..., :12], v[..., :12], meta, SCALE)


def test_attention_prefill_chunks_decode_and_neighbours_give_the_same_bits():
    g = gen(7)
    lengths = [45, 29, 3]
    k, v, tables = filled_cache(g, lengths)
    q_of = [torch.randn(n, H, D, generator=g) for n in lengths]
    n = lengths[0]
    prefill = torch.cat(run(q_of, [(0, 0, n)], k, v, tables))
    chunked = torch.cat([torch.cat(run(q_of, [(0, s, min(c, n - s))], k, v, tables))
                         for s, c in [(0, 7), (7, 16), (23, 5), (28, 17)]])
    decode = torch.cat([run(q_of, [(0, p, 1)], k, v, tables)[0] for p in range(n)])
    # In a batch: other sequences before it, decode rows of others beside a chunk of it.
    batched = torch.cat([run(q_of, [(1, 0, 29), (0, 0, 20), (2, 2, 1)], k, v, tables)[1],
                         run(q_of, [(2, 0, 3), (1, 28, 1), (0, 20, 25)], k, v, tables)[2]])
    assert torch.equal(chunked, prefill)
    assert torch.equal(decode, prefill)
    assert torch.equal(batched, prefill)


def test_attention_equality_is_not_automatic():
    # Negative control: the same queries through another order of reduction over the keys (the
    # stock path: one softmax over the whole row) give other bits for some rows, so the
    # equalities above are the kernel's fixed order at work, not a property of any attention.
    g = gen(8)
    k, v, tables = filled_cache(g, [45])
    q_of = [torch.randn(45, H, D, generator=g)]
    ours = torch.cat(run(q_of, [(0, 0, 45)], k, v, tables))
    meta = AttentionMeta.build([45], [0], tables, row_tile=16)
    q = torch.zeros(meta.padded_tokens, H, D)
    q[:45] = q_of[0]
    stock = std.attention(q, k, v, meta, SCALE)[:45]
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ours, stock)


# ------------------------------------------------------------------------- autograd wrappers


def test_cuda_invariant_gradients_match_stock_pytorch():
    g = gen(9)
    x = torch.randn(19, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    nw = torch.randn(48, generator=g, requires_grad=True)

    def loss(linear, norm, lsm):
        return (lsm(norm(linear(x, w), nw, 1e-6)) * torch.linspace(-1, 1, 48)).sum()

    got = torch.autograd.grad(loss(cuda_invariant.linear, cuda_invariant.rms_norm, cuda_invariant.log_softmax), [x, w, nw])
    ref = torch.autograd.grad(loss(std.linear, std.rms_norm, std.log_softmax), [x, w, nw])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_cuda_invariant_attention_gradient_and_moe_route():
    g = gen(10)
    k, v, tables = filled_cache(g, [20])
    meta = AttentionMeta.build([20], [0], tables, row_tile=16)
    q = torch.randn(meta.padded_tokens, H, D, generator=g, requires_grad=True)
    kr, vr = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
    weight = torch.randn(meta.padded_tokens, H, D, generator=g)[:20]
    got = torch.autograd.grad((cuda_invariant.attention(q, kr, vr, meta, SCALE)[:20] * weight).sum(), [q, kr, vr])
    ref = torch.autograd.grad((std.attention(q, kr, vr, meta, SCALE)[:20] * weight).sum(), [q, kr, vr])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    logits = torch.randn(7, 8, generator=g)
    logits[2, 5] = logits[2, 1]  # a tie: the lower expert id comes first
    weights, experts = cuda_invariant.moe_route(logits, 2, normalize=True)
    ref_w, ref_e = std.moe_route(logits, 2, normalize=True)
    assert torch.equal(experts.sort(-1).values, ref_e.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))
    alone_w, alone_e = cuda_invariant.moe_route(logits[2:3], 2, normalize=True)
    assert torch.equal(alone_w[0], weights[2]) and torch.equal(alone_e[0], experts[2])


# ----------------------------------------------------------------------------- end to end


MICRO = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_engine_and_trainer_agree_bitwise_through_the_triton_kernels(moe):
    """The whole shipping path on the CUDA kernels (in the interpreter, fp32), on a micro Qwen3
    (dense, and MoE for the router): the engine's behaviour logprobs from a chunked prefill and
    batched decode steps equal the trainer's teacher-forced logprobs bit for bit. The standard
    numerics, on the same model and requests, is the negative control."""
    from rzero.engine import Engine, SamplingParams
    from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM
    from rzero.model.qwen3_moe import Qwen3MoeForCausalLM
    from rzero.ops import Numerics, SamplingTransform
    from rzero.rollout.record import Rollout
    from rzero.train.trainer import Trainer, TrainerSettings

    if moe:
        config = Qwen3Config(intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **MICRO)
    else:
        config = Qwen3Config(intermediate_size=128, **MICRO)

    def gap(nx: Numerics) -> float:
        model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config)
        model.init_weights(seed=0, std=0.2)  # large enough weights that the logits are not all alike
        trainer = Trainer(model, torch.float32, TrainerSettings(), numerics=nx)
        engine = Engine(trainer.compute, numerics=nx, eos_token_ids=[], num_kv_blocks=16,
                        max_num_batched_tokens=16)  # the 20-token prompt is prefilled in two chunks
        g = gen(11)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 6)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=4, seed=3, ignore_eos=True, temperature=0.8))
        transform = SamplingTransform(temperature=0.8)
        rollouts = [Rollout(p, o.token_ids, o.logprobs, o.versions, 0.0, transform) for p, o in zip(prompts, outs)]
        with torch.no_grad():
            pi = torch.cat(trainer.token_logprobs(trainer.compute, rollouts))
        mu = torch.tensor([x for o in outs for x in o.logprobs])
        assert len(mu) == 8
        return float((pi - mu).abs().max())

    triton_nx = Numerics("invariant")
    triton_nx._on = lambda x: cuda_invariant  # this object only: the CUDA kernels on CPU tensors
    assert gap(triton_nx) == 0.0
    assert gap(Numerics("standard")) > 0.0
