"""Packed and re-laid-out weights (`rzero.ops.packed`, `Qwen3ForCausalLM.pack_weights`) keep every
bit of the invariant linear: the engine runs q/k/v and gate/up as one GEMM on row-major bf16
weights, the trainer runs them one by one on the checkpoint's (N, K) weights, and both must give
the numbers the unpacked linear always gave. Probed with inputs that expose any change of how the
GEMM groups its K terms (test_ops.grouping_probe)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_cpu_kernel import needs_bf16_gemm
from test_ops import PROBE_SHAPES

from rzero import ops
from rzero.model.presets import PRESETS
from rzero.ops import AttentionMeta, cpu_kernel, gemm_route, invariant, weight_copies
from rzero.ops.invariant import ROW_TILE, grouping_probe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (K, [N of each packed projection]): tiny presets' q/k/v and gate/up, a Qwen3-0.6B layer's, and
# every single projection of PROBE_SHAPES.
PACKS = [(128, [128, 64, 64]), (128, [512, 512]), (128, [128, 128]), (1024, [2048, 1024, 1024]), (1024, [3072, 3072])]
PACKS += [(K, [N]) for K, N in PROBE_SHAPES]


@pytest.fixture(autouse=True)
def bf16_gemm_on_bf16(monkeypatch):
    """These tests are about the bf16 GEMM's layouts and paths: run them in that mode on every CPU
    (without AMX the default is the fp32 GEMM, tested at the end of this file), with small weights
    on it too rather than on our own bf16 GEMM (`bf16_kernel`, tested in test_ops.py)."""
    monkeypatch.setattr(invariant, "bf16_gemm", lambda: "bf16")
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: False)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The invariant linear as first defined: one bmm of 16-row tiles by the (N, K) weight's
    transposed view, on one thread (on two, MKL splits a one-tile fp32 bmm across them)."""
    pad = (-x.shape[0]) % 16
    tiles = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(-1, 16, x.shape[1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = torch.bmm(tiles, weight.t().expand(tiles.shape[0], *weight.t().shape))
    finally:
        torch.set_num_threads(threads)
    return out.view(-1, weight.shape[0])[: x.shape[0]]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("K,sizes", PACKS)
@pytest.mark.parametrize("path", ["mm-per-tile", "bmm", "bmm-chunks"])
def test_packed_linear_keeps_the_bits(K, sizes, dtype, path, monkeypatch):
    monkeypatch.setattr(invariant, "TILE_LOOP_MIN", 0 if path == "mm-per-tile" else 1 << 62)
    monkeypatch.setattr(invariant, "BMM_CHUNK", 3 if path == "bmm-chunks" else 1 << 30)
    x, weight = grouping_probe(160, K, sum(sizes), seed=K * sum(sizes))
    x, weight = x.to(DTYPES[dtype]), weight.to(DTYPES[dtype])
    parts = list(weight.split(sizes))
    fused, views = ops.packed(parts)
    assert all(torch.equal(v, p) for v, p in zip(views, parts))
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            for m in (1, 5, 16, 48, 160):
                got = ops.INVARIANT.linear(x[:m], fused).split(sizes, dim=-1)
                for i, (part, out) in enumerate(zip(parts, got)):
                    ref = reference(x[:m], part)
                    assert torch.equal(out, ref), f"{dtype} K={K} part {i} of {sizes}: rows={m} threads={t}"
                    # The trainer's path: one projection, stored (N, K).
                    assert torch.equal(ops.INVARIANT.linear(x[:m], part), ref)
    finally:
        torch.set_num_threads(threads)


def test_invariant_linear_backward_through_the_tile_loop(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x0, w0 = torch.randn(40, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
    grads = {}
    for path, limit in (("mm-per-tile", 0), ("bmm", 1 << 62)):
        monkeypatch.setattr(invariant, "TILE_LOOP_MIN", limit)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        (ops.INVARIANT.linear(x, w).float() * torch.arange(32.0)).sum().backward()
        grads[path] = (x.grad, w.grad)
    x, w = x0.float().requires_grad_(), w0.float().requires_grad_()
    (torch.nn.functional.linear(x, w) * torch.arange(32.0)).sum().backward()
    for path, got in grads.items():  # both bf16 paths within bf16 rounding of the fp32 gradient
        for g, ref in zip(got, (x.grad, w.grad)):
            assert (g.float() - ref).abs().max() <= 2e-2 * ref.abs().max(), path


def _forward(model, seqs):
    meta, _ = AttentionMeta.for_sequences([len(s) for s in seqs], row_tile=model.numerics.row_tile)
    with torch.no_grad():
        return model.logits(model(torch.tensor([t for s in seqs for t in s]), meta))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("mode", ["invariant", "standard"])
def test_pack_weights_keeps_names_shapes_and_bits(preset, dtype, mode):
    cls, config = PRESETS[preset]
    model = cls(config, numerics=mode)
    model.init_weights(0)
    model = model.to(DTYPES[dtype])
    packed = copy.deepcopy(model)
    packed.pack_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = packed.state_dict()
    assert list(before) == list(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    seqs = [[1, 2, 3, 4, 5, 6, 7], list(range(40, 80)), [9]]
    if mode == "invariant":  # standard numerics may change bits with the layout; it is the control
        assert torch.equal(_forward(model, seqs), _forward(packed, seqs))
    attn = packed.model.layers[0].self_attn
    assert attn.packed.usable([attn.q_proj, attn.k_proj, attn.v_proj]) and attn.q_proj.weight.data_ptr() == attn.packed.ptrs[0]
    # In-place loads (Engine.update_weights) write through to the packed tensor.
    new = cls(config, numerics=mode)
    new.init_weights(1)
    new = new.to(DTYPES[dtype])
    with torch.no_grad():
        for name, p in packed.named_parameters():
            p.copy_(new.get_parameter(name))
    assert attn.q_proj.weight.data_ptr() == attn.packed.ptrs[0]  # still packed
    if mode == "invariant":
        assert torch.equal(_forward(new, seqs), _forward(packed, seqs))


def test_packed_path_is_used_only_while_it_holds(monkeypatch):
    cls, config = PRESETS["tiny-dense"]
    model = cls(config).to(torch.bfloat16)
    model.init_weights(0)
    unpacked = copy.deepcopy(model)
    model.pack_weights()
    attn = model.model.layers[0].self_attn
    calls = []
    original = ops.Numerics.linear
    monkeypatch.setattr(ops.Numerics, "linear", lambda self, x, w: calls.append(w) or original(self, x, w))
    seqs = [[1, 2, 3]]
    reference_logits = _forward(model, seqs)
    assert any(w.data_ptr() == attn.packed.weight.data_ptr() for w in calls)  # q+k+v: the packed tensor itself
    assert {256, 1024} <= {w.shape[0] for w in calls}  # q+k+v (128+64+64) and gate+up (512+512)
    # With gradients wanted, one GEMM on the weights joined for the pass: autograd reaches the leaves.
    # (The op path's `project`; the layer as one autograd node: tests/test_train_layer.py.)
    monkeypatch.setattr(invariant, "train_attention", lambda *args: None)
    calls.clear()
    meta, _ = AttentionMeta.for_sequences([3], row_tile=model.numerics.row_tile)
    model(torch.tensor([1, 2, 3]), meta).float().sum().backward()
    joined = [w for w in calls if w.shape[0] == 256]
    assert joined and all(w.requires_grad and w.data_ptr() != attn.packed.weight.data_ptr() for w in joined)
    assert attn.q_proj.weight.grad is not None and attn.v_proj.weight.grad is not None
    # A cast replaces the parameters: the packed tensor is stale and must not be used.
    calls.clear()
    as_fp32 = model.float()
    assert torch.equal(_forward(as_fp32, seqs), _forward(unpacked.float(), seqs))
    assert not any(w.data_ptr() == attn.packed.weight.data_ptr() for w in calls)
    assert reference_logits.dtype == torch.float32


def test_trainer_with_packed_compute_weights_steps_like_an_unpacked_one():
    """The bf16 compute copy stores its weights transposed (pack_weights): their gradients must
    still reach the fp32 master element for element (the fused AdamW pairs them by memory order)."""
    from rzero.rollout.record import Rollout
    from rzero.train.trainer import Trainer, TrainerSettings

    cls, config = PRESETS["tiny-dense"]
    base = cls(config)
    base.init_weights(0)
    batch = [Rollout([5 + i, 6, 7, 8], [9, 10 + i, 2], [0.0] * 3, [0] * 3, 0.0) for i in range(8)]
    packed = Trainer(copy.deepcopy(base), torch.bfloat16, TrainerSettings(lr=1e-2))
    plain = Trainer(copy.deepcopy(base), torch.bfloat16, TrainerSettings(lr=1e-2))
    plain.compute = copy.deepcopy(plain.master).to(torch.bfloat16)  # the same weights, not packed
    assert packed.compute.model.layers[0].mlp.down_proj.weight.stride() != plain.compute.model.layers[0].mlp.down_proj.weight.stride()
    for trainer in (packed, plain):
        trainer.supervised_step(batch)
    for (name, a), b in zip(packed.master.named_parameters(), plain.master.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(packed.master.model.layers[0].mlp.down_proj.weight, base.model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize("K,N", [(1024, 1024), (1024, 3072), (3072, 1024)])
def test_fp32_linear_one_tile_is_a_tile_among_others_on_two_threads(K, N):
    """On two threads MKL splits a one-tile fp32 GEMM over both (other bits from K = 1024 on);
    the invariant linear runs such a tile beside a zero tile, so its bits are those of any batch
    and of one thread."""
    x, weight = grouping_probe(64, K, N, seed=1)
    x, weight = x.float(), weight.float()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = ops.INVARIANT.linear(x[:16], weight)
        torch.set_num_threads(2)
        for m in (1, 5, 16, 64):
            assert torch.equal(ops.INVARIANT.linear(x[:m], weight)[:16], one_thread[:m]), m
    finally:
        torch.set_num_threads(threads)


def test_prepacked_decode_linear_keeps_the_bits_and_follows_weight_loads(monkeypatch):
    """Decode-size inputs on a K = 1024 bf16 weight run on oneDNN's prepacked copy where the probe
    proves it (`invariant.prepack_proven`): the 16-row mm tiles' bits, a copy rebuilt after an
    in-place load, none where a gradient is wanted. Negative control: a prepacked GEMM that
    gives other bits is refused by the probe, and the linear keeps the mm tiles' bits."""
    K, N = 1024, 3072
    x, weight = grouping_probe(48, K, N, seed=17)
    _, other = grouping_probe(1, K, N, seed=18)
    threads = torch.get_num_threads()

    def mm_tiles(w):
        return torch.cat([t @ w.t() for t in x.split(16)])

    invariant.prepack_proven.cache_clear()
    try:
        proven = invariant.prepack_proven(K, N, threads)
        assert torch.equal(ops.INVARIANT.linear(x, weight), mm_tiles(weight))
        assert (id(weight) in weight_copies.PREPACKED) == proven
        with torch.no_grad():
            weight.copy_(other)  # an engine weight update
        assert torch.equal(ops.INVARIANT.linear(x, weight), mm_tiles(other))
        trained = other.clone().requires_grad_()
        ops.INVARIANT.linear(x, trained).float().sum().backward()  # the trainer's path
        assert id(trained) not in weight_copies.PREPACKED and trained.grad is not None

        def off_by_one(a, packed):  # any other bits than the mm tiles'
            return torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "") + 1

        monkeypatch.setattr(invariant, "_onednn_tile", off_by_one)
        invariant.prepack_proven.cache_clear()
        assert not invariant.prepack_proven(K, N, threads)
        fresh = other.clone()
        assert torch.equal(ops.INVARIANT.linear(x, fresh), mm_tiles(other))
        assert id(fresh) not in weight_copies.PREPACKED
    finally:
        invariant.prepack_proven.cache_clear()


def assert_bits_on_every_path(x, weight, expected, row_counts, threads):
    """The bf16 linear of x's first m rows is expected[:m] on 1, 2 and `threads` threads, for the
    weight, a packed view of it and a weight that wants a gradient; then after an in-place load of
    the packed view (its cached fp32 copy must follow it). Leaves one thread set."""
    fused, (view,) = ops.packed([weight.clone()])
    for t in sorted({1, 2, threads}):
        torch.set_num_threads(t)
        for m in row_counts:
            assert torch.equal(ops.INVARIANT.linear(x[:m], weight), expected[:m]), (m, t)
            assert torch.equal(ops.INVARIANT.linear(x[:m], view), expected[:m]), (m, t)
            w = weight.clone().requires_grad_()
            assert torch.equal(ops.INVARIANT.linear(x[:m], w), expected[:m]), (m, t)
    torch.set_num_threads(1)
    with torch.no_grad():
        view.copy_(-weight)
    assert torch.equal(ops.INVARIANT.linear(x, view), -expected)


@pytest.mark.parametrize("K,N", [(128, 512), (1024, 3072)])
def test_bf16_linear_on_the_fp32_gemm_is_the_widened_fp32_linear(K, N, monkeypatch):
    """`bf16_gemm() == "fp32"` (CPUs without AMX): a bf16 linear is the fp32 invariant linear of the
    exactly widened values, rounded to bf16, whatever the row count, the thread count, the packing
    and whether a gradient is wanted; a weight load (in place) is followed."""
    monkeypatch.setattr(invariant, "bf16_gemm", lambda: "fp32")
    monkeypatch.setattr(invariant, "PANEL_MIN", 1 << 62)  # K x N of a 0.6B layer too, on the (N, K) route
    x, weight = grouping_probe(160, K, N, seed=K + N)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = ops.INVARIANT.linear(x.float(), weight.float()).bfloat16()
        assert_bits_on_every_path(x, weight, expected, (1, 5, 16, 48, 160), threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("K,N", [(1024, 1100), (3072, 1024), (4096, 300)])
def test_large_bf16_weights_on_the_fp32_gemm_run_in_column_panels_with_one_thread_bits(K, N, monkeypatch):
    """From PANEL_MIN elements on, the fp32 route multiplies 512-column panels of the widened weight
    by one bmm (N = 1100: a zero-padded last panel; N = 300: one panel, with a zero one beside it
    so that the batched GEMM still runs it on one thread). Every row gets the bits of a one-thread fp32
    GEMM of a 16-row tile on the whole row-major weight, whatever the row count (tiles of up to
    PANEL_ROWS), the thread count, the packing and whether a gradient is wanted; an in-place load is
    followed; the gradients are the plain GEMMs' on the widened values."""
    monkeypatch.setattr(invariant, "bf16_gemm", lambda: "fp32")
    assert K * N >= invariant.PANEL_MIN
    x, weight = grouping_probe(300, K, N, seed=K + 3 * N)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = weight.float().t().contiguous()
        expected = torch.cat([torch.mm(tile, whole) for tile in x.float().split(ROW_TILE)]).bfloat16()
        assert_bits_on_every_path(x, weight, expected, (1, 5, 16, 48, 128, 160, 300), threads)
        leaf, w = (x[:40] / 64).requires_grad_(), (weight / 64).requires_grad_()
        upstream = torch.randn(40, N, generator=torch.Generator().manual_seed(1)).bfloat16()
        ops.INVARIANT.linear(leaf, w).backward(upstream)
        g, xc, wc = upstream.float(), (x[:40] / 64).float(), (weight / 64).float()
        assert torch.equal(leaf.grad, (g @ wc).bfloat16())
        assert torch.equal(w.grad, (g.t() @ xc).bfloat16())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("gemm", ["bf16", "fp32"])
def test_training_gradients_through_the_invariant_linear_are_the_plain_linears(gemm, monkeypatch):
    """The backward multiplies the forward's operands (on the fp32 route, the widened copies): the
    gradients are F.linear's on the same values, computed in the GEMM's dtype."""
    monkeypatch.setattr(invariant, "bf16_gemm", lambda: gemm)
    x, weight = grouping_probe(853, 128, 256, seed=7)  # 853 rows: a zero-padded last tile
    x, weight = x / 64, (weight / 64).requires_grad_()
    leaf = x.clone().requires_grad_()
    upstream = torch.randn(853, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    ops.INVARIANT.linear(leaf, weight).backward(upstream)
    compute = torch.float32 if gemm == "fp32" else torch.bfloat16
    g, xc, wc = upstream.to(compute), x.to(compute), weight.detach().to(compute)
    assert torch.equal(leaf.grad, (g @ wc).bfloat16())
    assert torch.equal(weight.grad, (g.t() @ xc).bfloat16())


def test_an_input_of_another_dtype_than_the_weight_is_refused():
    x, weight = grouping_probe(20, 128, 256, seed=9)
    with pytest.raises(TypeError, match="must be of one dtype"):
        ops.INVARIANT.linear(x.float(), weight)


def test_the_bf16_gemm_rule_can_be_forced_and_refuses_a_misspelt_one(monkeypatch):
    monkeypatch.undo()  # the real rule, not this module's fixture
    for route in invariant.BF16_GEMMS:
        monkeypatch.setenv("RZERO_BF16_GEMM", route)
        invariant.bf16_gemm.cache_clear()
        assert invariant.bf16_gemm() == route
    monkeypatch.setenv("RZERO_BF16_GEMM", "bf15")
    invariant.bf16_gemm.cache_clear()
    with pytest.raises(ValueError, match="RZERO_BF16_GEMM='bf15': use one of bf16, fp32"):
        invariant.bf16_gemm()
    monkeypatch.delenv("RZERO_BF16_GEMM")
    invariant.bf16_gemm.cache_clear()
    assert invariant.bf16_gemm() in invariant.BF16_GEMMS


def test_the_kept_one_mm_decision_follows_the_bf16_route(monkeypatch):
    """A decode-size linear keeps its one-mm decision per shape; the decision is keyed by the bf16
    route too, so a route switched afterwards (RZERO_BF16_GEMM, these tests) is not bypassed."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen).bfloat16()
    weight = torch.randn(256, 128, generator=gen).bfloat16()
    invariant._linear_forward(x, weight, may_prepack=True)  # decided (and kept) on the bf16 GEMM
    widened = []
    real = weight_copies.widened
    monkeypatch.setattr(weight_copies, "widened", lambda w, may_cache: widened.append(w) or real(w, may_cache))
    monkeypatch.setattr(invariant, "bf16_gemm", lambda: "fp32")
    out = invariant._linear_forward(x, weight, may_prepack=True)
    assert widened  # the fp32 route ran
    invariant._ONE_MM.clear()
    assert torch.equal(out, invariant._linear_forward(x, weight, may_prepack=True))


# ------------------------------------------- small bf16 weights on our own GEMM (bf16_kernel)

@needs_bf16_gemm
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_small_bf16_weights_run_on_our_gemm_in_engine_and_trainer_alike(preset, monkeypatch):
    """Where bf16_kernel() holds, every tiny-preset weight (packed row-major for the engine, joined
    for training, unpacked in a checkpoint) gives the kernel's bits for any rows; a weight of
    KERNEL_MAX elements or more, or with an odd K, stays on bf16_gemm()'s route."""
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    gen = torch.Generator().manual_seed(3)
    config = PRESETS[preset][1]
    hidden, widths = config.hidden_size, {config.intermediate_size, config.num_attention_heads * config.head_dim}
    if preset == "tiny-moe":
        widths.add(config.moe_intermediate_size)
    shapes = [(width, hidden) for width in widths] + [(hidden, width) for width in widths] + [(config.vocab_size, hidden)]
    for N, K in shapes:
        weight = torch.randn(N, K, generator=gen).bfloat16()
        x = torch.randn(37, K, generator=gen).bfloat16()
        expected = cpu_kernel.bf16_gemm(x, cpu_kernel.bf16_pack(weight), N)
        row_major = weight.t().contiguous().t()
        for w in (weight, row_major):
            assert torch.equal(ops.INVARIANT.linear(x, w), expected)
            assert torch.equal(ops.INVARIANT.linear(x[5:6], w), expected[5:6])
            trained = w.clone().requires_grad_()
            assert torch.equal(ops.INVARIANT.linear(x, trained), expected)
    calls = []
    real = cpu_kernel.bf16_gemm
    monkeypatch.setattr(cpu_kernel, "bf16_gemm", lambda *args: calls.append(args) or real(*args))
    weight, x = torch.randn(256, 128, generator=gen).bfloat16(), torch.randn(16, 128, generator=gen).bfloat16()
    ops.INVARIANT.linear(x, weight)
    assert len(calls) == 1
    monkeypatch.setattr(gemm_route, "KERNEL_MAX", weight.numel())
    ops.INVARIANT.linear(x, weight)
    odd = torch.randn(64, 127, generator=gen).bfloat16()
    ops.INVARIANT.linear(torch.randn(16, 127, generator=gen).bfloat16(), odd)
    assert len(calls) == 1 and not gemm_route.on_kernel(weight) and not gemm_route.on_kernel(odd)


@needs_bf16_gemm
def test_the_engines_kept_gemm_layout_follows_weight_loads(monkeypatch):
    """The engine keeps each weight's kernel layout; an in-place load (Engine.update_weights, the
    optimizer) moves the weight's version and the next call packs it again."""
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(128, 64, generator=gen).bfloat16()
    x = torch.randn(16, 64, generator=gen).bfloat16()
    with torch.no_grad():
        before = ops.INVARIANT.linear(x, weight)
        weight.copy_(torch.randn(128, 64, generator=gen).bfloat16())
        after = ops.INVARIANT.linear(x, weight)
    assert not torch.equal(before, after)
    assert torch.equal(after, cpu_kernel.bf16_gemm(x, cpu_kernel.bf16_pack(weight), 128))


@needs_bf16_gemm
def test_training_gradients_through_our_gemm_are_the_plain_linears(monkeypatch):
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: True)
    x, weight = grouping_probe(853, 128, 256, seed=7)
    x, weight = x / 64, (weight / 64).requires_grad_()
    leaf = x.clone().requires_grad_()
    upstream = torch.randn(853, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    ops.INVARIANT.linear(leaf, weight).backward(upstream)
    assert torch.equal(leaf.grad, upstream @ weight.detach())
    assert torch.equal(weight.grad, upstream.t() @ x)


def test_the_bf16_kernel_rule_can_be_forced_and_refuses_a_misspelt_one(monkeypatch):
    monkeypatch.undo()  # the real rule, not this module's fixture
    try:
        monkeypatch.setenv("RZERO_BF16_KERNEL", "0")
        invariant.bf16_kernel.cache_clear()
        assert invariant.bf16_kernel() is False
        monkeypatch.setenv("RZERO_BF16_KERNEL", "yes")
        invariant.bf16_kernel.cache_clear()
        with pytest.raises(ValueError, match="RZERO_BF16_KERNEL='yes': use 0"):
            invariant.bf16_kernel()
        monkeypatch.setenv("RZERO_BF16_KERNEL", "1")
        monkeypatch.setattr(cpu_kernel, "bf16_gemm_built", lambda lib=None: False)
        invariant.bf16_kernel.cache_clear()
        with pytest.raises(RuntimeError, match="needs a CPU with avx512_bf16"):
            invariant.bf16_kernel()
    finally:
        monkeypatch.undo()
        invariant.bf16_kernel.cache_clear()
