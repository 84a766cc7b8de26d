"""The CPU's C kernels (rzero/ops/cpu_kernel.py, csrc/kernels.c: attention, RMSNorm, rotary, the
bf16 GEMM): they build where a compiler exists, their bits depend neither on the instruction set they were
compiled for nor on the thread count, and their training backward gives the right gradients.
Batch invariance itself is tested in test_ops.py (prefill vs decode vs chunks, neighbours,
shuffled blocks, rows alone vs in a batch) for the kernels and the stock-op fallback alike."""

from __future__ import annotations

import shutil

import pytest
import torch

from rzero.ops import INVARIANT, AttentionMeta, cpu_kernel, invariant_rows
from rzero.ops.invariant import grouping_probe

COMPILER = shutil.which("cc") or shutil.which("gcc")
# The portable build: baseline x86-64 (no AVX, no FMA instructions: fmaf becomes a libm call).
PORTABLE = tuple(f for f in cpu_kernel.FLAGS if f != "-march=native") + ("-march=x86-64",)

needs_kernel = pytest.mark.skipif(COMPILER is None, reason="no C compiler on this machine")


def random_batch(seed: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """A mixed engine-like batch (decodes and prefill chunks) over a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = [1, 7, 1, 20, 3], [45, 0, 3, 17, 60]
    num_blocks = 40
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n, ctx in zip(q_lens, ctx_lens):
        count = -(-(n + ctx) // 16)
        tables.append(perm[used : used + count])
        used += count
    meta = AttentionMeta.build(q_lens, ctx_lens, tables, row_tile=INVARIANT.row_tile)
    k_cache = (torch.randn(num_blocks, 16, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    v_cache = torch.randn(num_blocks, 16, kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(meta.padded_tokens, heads, head_dim, generator=gen) * 3).to(dtype)
    return q, k_cache, v_cache, meta


@needs_kernel
def test_the_kernel_builds_where_a_compiler_exists():
    assert cpu_kernel.library() is not None, cpu_kernel.kernel_status()
    assert cpu_kernel.kernel_status() == "c kernel"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Odd groups and head dims of 32, 64 and 128 take the register weighted sum on AVX-512 machines.
@pytest.mark.parametrize("group,kv_heads,head_dim", [(1, 1, 16), (2, 2, 32), (2, 1, 16), (2, 1, 64), (4, 1, 24), (3, 1, 64), (2, 2, 128)])
def test_bits_do_not_depend_on_the_instruction_set(dtype, group, kv_heads, head_dim, tmp_path):
    """-march=native (AVX intrinsics, FMA instructions) and baseline x86-64 (portable C, libm fmaf)
    give the same bits: the kernel's order of operations is in its source, not in the compiler's
    choice. head_dim 24 exercises the zero padding to whole 16-lane groups."""
    portable = cpu_kernel.load(PORTABLE, cache_dir=tmp_path)
    q, k_cache, v_cache, meta = random_batch(head_dim, group * kv_heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    native = cpu_kernel.attention(q, k_cache, v_cache, meta, scale)
    baseline = cpu_kernel.attention(q, k_cache, v_cache, meta, scale, lib=portable)
    assert torch.equal(native, baseline)
    assert torch.isfinite(native).all() and native[: meta.num_tokens].abs().sum() > 0


@needs_kernel
def test_bits_do_not_depend_on_the_thread_count():
    q, k_cache, v_cache, meta = random_batch(7, 8, 2, 64, torch.bfloat16)
    saved = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_kernel.attention(q, k_cache, v_cache, meta, 0.125))
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
def test_backward_bits_do_not_depend_on_the_thread_count_with_shared_prompt_blocks():
    """GRPO groups share their prompt's cache blocks, so several sequences add into one dK/dV row:
    the kernel then gives each thread whole KV heads, and every thread count adds in the order of
    one thread (a split by sequence would race on the shared rows)."""
    gen = torch.Generator().manual_seed(3)
    meta = AttentionMeta.for_shared_prompts([(21, [5, 9, 1]), (6, [4, 4])], row_tile=INVARIANT.row_tile)
    heads, kv_heads, head_dim = 4, 2, 32
    q = torch.randn(meta.padded_tokens, heads, head_dim, generator=gen)
    k_cache = torch.randn(meta.num_blocks, 16, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(meta.num_blocks, 16, kv_heads, head_dim, generator=gen)
    grad = torch.randn(meta.padded_tokens, heads, head_dim, generator=gen)
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(cpu_kernel.attention_backward(q, k_cache, v_cache, meta, head_dim**-0.5, grad))
    finally:
        torch.set_num_threads(saved)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], got))
    dq, dk, dv = results[0]
    assert dk[0].abs().sum() > 0 and dv[0].abs().sum() > 0  # the shared prompt block got gradients


def reference(q, k, v, lengths, group):
    """Causal softmax attention per sequence, in the inputs' dtype (fp64 here), autograd-able."""
    outs, start = [], 0
    for n in lengths:
        qs = q[start : start + n].transpose(0, 1)
        ks = k[start : start + n].repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start : start + n].repeat_interleave(group, 1).transpose(0, 1)
        scores = qs @ ks.transpose(-1, -2) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (3, 1, 64), (4, 2, 24)])
def test_training_forward_and_gradients_match_the_reference(heads, kv_heads, head_dim):
    """The trainer's path (private cache built out of place, autograd through it): forward equals
    the no-grad kernel bit for bit; gradients of q, k and v match fp64 autograd."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 19, 33]
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, generator=gen, requires_grad=True)
    k = torch.randn(total, kv_heads, head_dim, generator=gen, requires_grad=True)
    v = torch.randn(total, kv_heads, head_dim, generator=gen, requires_grad=True)
    meta, num_blocks = AttentionMeta.for_sequences(lengths, row_tile=INVARIANT.row_tile)
    shape = (num_blocks * 16, kv_heads, head_dim)
    k_cache = k.new_zeros(shape).index_copy(0, meta.slot_mapping, k).view(num_blocks, 16, kv_heads, head_dim)
    v_cache = v.new_zeros(shape).index_copy(0, meta.slot_mapping, v).view(num_blocks, 16, kv_heads, head_dim)
    q_padded = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, meta.padded_tokens - total))
    out = INVARIANT.attention(q_padded, k_cache, v_cache, meta, head_dim**-0.5)[:total]
    with torch.no_grad():
        no_grad = cpu_kernel.attention(q_padded, k_cache, v_cache, meta, head_dim**-0.5)[:total]
    assert torch.equal(out.detach(), no_grad)
    weights = torch.randn(out.shape, generator=gen)
    (out * weights).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference(q64, k64, v64, lengths, heads // kv_heads)
    torch.testing.assert_close(out.detach().double(), expected.detach(), rtol=1e-5, atol=1e-5)
    (expected * weights.double()).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_a_failed_build_is_reported_not_hidden(tmp_path):
    """A compiler that fails is an error naming it; the library is never half-written."""
    with pytest.raises(RuntimeError, match="false failed"):
        cpu_kernel.load(cpu_kernel.FLAGS, compiler=shutil.which("false") or "/bin/false", cache_dir=tmp_path)
    assert not list(tmp_path.glob("*.so"))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [24, 32, 128, 1000])
def test_rms_norm_bits_do_not_depend_on_the_instruction_set_or_the_layout(dtype, width, tmp_path):
    """Native and portable builds agree bit for bit; a strided (tokens, heads, head_dim) view of a
    wider projection, read in place, gives the bits of its contiguous copy."""
    portable = cpu_kernel.load(PORTABLE, cache_dir=tmp_path)
    gen = torch.Generator().manual_seed(width)
    fused = (torch.randn(37, 3 * width, generator=gen) * 4).to(dtype)
    x = fused[:, width : 3 * width].view(37, 2, width)  # rows of stride 3 * width
    weight = (1 + torch.randn(width, generator=gen) * 0.1).to(dtype)
    native = cpu_kernel.rms_norm(x, weight, 1e-6)
    assert native.is_contiguous() and native.shape == x.shape
    assert torch.equal(native, cpu_kernel.rms_norm(x, weight, 1e-6, lib=portable))
    assert torch.equal(native, cpu_kernel.rms_norm(x.contiguous(), weight, 1e-6))
    expected = weight.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(native.double(), expected, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_splits_big_calls_over_threads_without_changing_a_bit(dtype):
    """A call of many rows runs on several threads (rows are independent): the forward and the
    input gradient have the one-thread bits; the weight gradient adds the threads' sums in order,
    equal to the one-thread sum up to rounding."""
    gen = torch.Generator().manual_seed(5)
    fused = (torch.randn(853, 3 * 64, generator=gen) * 3).to(dtype)
    x = fused[:, 64:].view(853, 2, 64)  # strided rows, 109k elements: above the split threshold
    weight = (1 + torch.randn(64, generator=gen) * 0.1).to(dtype)
    grad = torch.randn(853, 2, 64, generator=gen)
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((cpu_kernel.rms_norm(x, weight, 1e-6), *cpu_kernel.rms_norm_backward(x, weight, 1e-6, grad, True, True)))
    finally:
        torch.set_num_threads(saved)
    for out, grad_x, grad_w in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(grad_x, results[0][1])
        torch.testing.assert_close(grad_w.float(), results[0][2].float(), rtol=1e-4, atol=1e-3)


@needs_kernel
def test_rms_norm_gradients_match_the_reference():
    """Training through the kernel: forward bits equal the no-grad kernel's, gradients match fp64."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(50, 3, 64, generator=gen) * 2).requires_grad_()
    weight = (1 + torch.randn(64, generator=gen) * 0.1).requires_grad_()
    out = INVARIANT.rms_norm(x, weight, 1e-6)
    assert torch.equal(out.detach(), cpu_kernel.rms_norm(x.detach(), weight.detach(), 1e-6))
    upstream = torch.randn(out.shape, generator=gen)
    (out * upstream).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    (reference * upstream.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def rotary_inputs(dtype: torch.dtype, T: int, H: int, D: int, seed: int):
    """x with ordinary, huge, tiny (subnormal), infinite and NaN values; cos and sin of a real table."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D, generator=gen) * 3
    flat = x.view(-1)
    flat[::37] = 3e38
    flat[5::41] = 1e-40
    flat[7::53] = float("inf")
    flat[11::59] = float("nan")
    angles = torch.rand(T, 1, D, generator=gen) * 1000
    return x.to(dtype), angles.cos().to(dtype), angles.sin().to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2), (853, 4, 32), (7, 16, 128), (5, 3, 24)])
def test_rotary_has_the_torch_expressions_bits_on_every_instruction_set(dtype, shape, tmp_path):
    """The one-pass kernel rounds like x * cos + rotate_half(x) * sin in torch (each product and
    the sum in the tensor's dtype), infinities and subnormals included, native and portable."""
    from rzero.ops import standard

    x, cos, sin = rotary_inputs(dtype, *shape, seed=sum(shape))
    expected = standard.apply_rotary(x, cos, sin)

    def same_bits(got: torch.Tensor) -> bool:
        """Every element's bits, except a NaN's payload and sign (torch's vector and scalar paths
        disagree on those among themselves)."""
        as_bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
        return bool(((got.view(as_bits) == expected.view(as_bits)) | (got.isnan() & expected.isnan())).all())

    if x.numel() > 64:
        assert expected.isnan().any() and expected.isinf().any()  # the special values reach the output
    assert same_bits(cpu_kernel.rotary(x, cos, sin))
    assert same_bits(cpu_kernel.rotary(x, cos, sin, lib=cpu_kernel.load(PORTABLE, cache_dir=tmp_path)))
    assert same_bits(INVARIANT.apply_rotary(x, cos, sin))
    assert not same_bits(standard.apply_rotary(x, sin, cos))  # a wrong table is caught


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_training_gives_the_expressions_output_and_gradient_bit_for_bit(dtype):
    from rzero.ops import standard

    x, cos, sin = rotary_inputs(dtype, 40, 4, 32, seed=3)
    x = x.clamp(-1e3, 1e3).nan_to_num(0.0)  # finite gradients to compare
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    results = []
    for op in (INVARIANT.apply_rotary, standard.apply_rotary):
        leaf = x.clone().requires_grad_()
        out = op(leaf, cos, sin)
        out.backward(upstream)
        results.append((out.detach(), leaf.grad))
    assert results[0][0].grad_fn is None and torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@needs_kernel
def test_rotary_with_an_odd_head_dim_is_refused_by_the_kernel_and_runs_as_the_expression():
    from rzero.ops import standard

    x, cos, sin = rotary_inputs(torch.float32, 6, 2, 5, seed=5)
    x = x.nan_to_num(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="head_dim 5 is odd"):
        cpu_kernel.rotary(x, cos, sin)
    assert torch.equal(INVARIANT.apply_rotary(x, cos, sin), standard.apply_rotary(x, cos, sin))


@needs_kernel
def test_an_unwritable_cache_directory_falls_back_to_the_temporary_one(tmp_path):
    import tempfile
    from pathlib import Path

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    lib = cpu_kernel.load(PORTABLE, cache_dir=blocker / "kernels")  # mkdir under a file fails
    assert Path(lib._name).parent.parent == Path(tempfile.gettempdir())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (3, 1, 64), (2, 2, 24), (16, 8, 128)])
def test_the_one_call_attention_step_has_the_bits_of_its_ops_one_by_one(dtype, heads, kv_heads, head_dim, tmp_path):
    """rz_cached_attention (norms, rotary, cache writes, attention, output rounding in one call)
    against the same ops run one by one, on views of one fused projection as the model passes
    them, for a mixed batch of decodes and prefill chunks; native and portable builds. The caches
    it writes must match too, slot for slot."""
    q_full, k_cache, v_cache, meta = random_batch(head_dim + heads, heads, kv_heads, head_dim, dtype)
    gen = torch.Generator().manual_seed(heads * head_dim)
    rows, width = meta.padded_tokens, (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(rows, width, generator=gen) * 2).to(dtype)
    q, k, v = (part.view(rows, -1, head_dim) for part in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))
    q_weight, k_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(dtype), (torch.rand(head_dim, generator=gen) + 0.5).to(dtype)
    angles = torch.rand(rows, 1, head_dim, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    scale = head_dim**-0.5

    by_ops = (k_cache.clone(), v_cache.clone())
    qn, kn = INVARIANT.rms_norm(q, q_weight, 1e-6), INVARIANT.rms_norm(k, k_weight, 1e-6)
    qn, kn = INVARIANT.apply_rotary(qn, cos, sin), INVARIANT.apply_rotary(kn, cos, sin)
    by_ops[0].view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, kn[: meta.num_tokens])
    by_ops[1].view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v[: meta.num_tokens])
    expected = cpu_kernel.attention(qn, *by_ops, meta, scale)
    assert expected.dtype == dtype and expected[: meta.num_tokens].abs().sum() > 0

    for lib in (None, cpu_kernel.load(PORTABLE, cache_dir=tmp_path)):
        caches = (k_cache.clone(), v_cache.clone())
        got = cpu_kernel.cached_attention(q, k, v, q_weight, k_weight, 1e-6, cos, sin, *caches, meta, scale, lib=lib)
        assert torch.equal(got, expected)
        assert torch.equal(caches[0], by_ops[0]) and torch.equal(caches[1], by_ops[1])
    # The Numerics op (what the model calls) gives the same.
    caches = (k_cache.clone(), v_cache.clone())
    assert torch.equal(INVARIANT.cached_attention(q, k, v, q_weight, k_weight, 1e-6, cos, sin, caches, meta, scale), expected)
    # A wrong eps or table changes the bits (the comparison can fail).
    caches = (k_cache.clone(), v_cache.clone())
    assert not torch.equal(cpu_kernel.cached_attention(q, k, v, q_weight, k_weight, 1e-2, cos, sin, *caches, meta, scale), expected)


@needs_kernel
def test_the_samplers_draw_in_c_is_the_inverse_cdf_of_its_own_exp(tmp_path):
    """rz_inverse_cdf on logprobs, on rows with truncated tokens (logprob -inf), a NaN, uniforms at 0
    and near 1, and row counts that do and do not fill its groups of four: the native build (its
    exp sixteen lanes at a time) and the portable one (one by one) give the same tokens, a row gives
    its token alone or in a batch, and the token's prefix brackets uniform * total in torch's exp
    and cumsum (up to the two exps' last bits); never a truncated token."""
    gen = torch.Generator().manual_seed(3)
    portable = cpu_kernel.load(PORTABLE, cache_dir=tmp_path)
    for vocab in (1, 7, 1000, 1024, 151936):
        for rows in (1, 3, 4, 9):
            lp = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 4, -1)
            lp[0, : vocab // 2] = float("-inf")
            if rows > 2:
                lp[2, vocab // 3] = float("nan")
            uniform = torch.rand(rows, generator=gen)
            uniform[0] = 0.0
            uniform[-1] = 1.0 - 2.0**-24
            tokens = cpu_kernel.inverse_cdf(lp, uniform)
            assert torch.equal(cpu_kernel.inverse_cdf(lp, uniform, lib=portable), tokens), (vocab, rows)
            alone = torch.cat([cpu_kernel.inverse_cdf(lp[i : i + 1], uniform[i : i + 1]) for i in range(rows)])
            assert torch.equal(alone, tokens)
            assert rows == 1 or tokens[0] == vocab // 2  # u = 0: the first token with mass
            cumulative = lp.double().exp().cumsum(-1)
            for r, t in enumerate(tokens.tolist()):
                if r == 2 and rows > 2:
                    continue  # the NaN row: wherever its midpoints lead
                threshold = uniform[r].item() * cumulative[r, -1].item()
                assert lp[r, t] > float("-inf")
                assert cumulative[r, t] >= threshold * (1 - 1e-6) and (t == 0 or cumulative[r, t - 1] <= threshold * (1 + 1e-6))
    flat = torch.full((1, 8), -3.0)  # a uniform row: u = 0.5 lands exactly on a prefix, right of it
    assert cpu_kernel.inverse_cdf(flat, torch.tensor([0.5])).item() == 4


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_log_softmax_in_c_is_torchs_to_a_few_ulps_with_the_same_bits_everywhere(threads, tmp_path):
    """rz_log_softmax: within float error of torch's, NaN and -inf where torch has them (a NaN row,
    an all -inf row, truncated tokens); the same bits for a row alone or in a batch, on 1 or 2
    threads, from a strided view, and in the portable build (its exp and sums one element at a
    time); its gradient is torch's."""
    gen = torch.Generator().manual_seed(5)
    portable = cpu_kernel.load(PORTABLE, cache_dir=tmp_path)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for vocab in (1, 7, 17, 1024, 151936):
            x = torch.randn(9, vocab, generator=gen) * 5
            x[1, : vocab // 2] = float("-inf")
            x[2, vocab // 3] = float("nan")
            x[3] = float("-inf")
            out, expected = cpu_kernel.log_softmax(x), torch.log_softmax(x, -1)
            assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out == float("-inf"), expected == float("-inf"))
            finite = expected.isfinite()
            torch.testing.assert_close(out[finite], expected[finite], rtol=1e-6, atol=2e-6)
            bits = out.view(torch.int32)
            assert torch.equal(cpu_kernel.log_softmax(x, lib=portable).view(torch.int32), bits)
            assert torch.equal(torch.cat([cpu_kernel.log_softmax(x[i : i + 1]) for i in range(9)]).view(torch.int32), bits)
            wide = torch.cat((x, torch.zeros(9, 3)), dim=1)[:, :vocab]  # rows 3 elements apart
            assert torch.equal(cpu_kernel.log_softmax(wide).view(torch.int32), bits)
    finally:
        torch.set_num_threads(previous)
    x = (torch.randn(6, 50, generator=gen) * 3).requires_grad_()
    weights = torch.randn(6, 50, generator=gen)
    (ours,) = torch.autograd.grad((invariant_rows.log_softmax(x) * weights).sum(), x)
    (theirs,) = torch.autograd.grad((torch.log_softmax(x, -1) * weights).sum(), x)
    torch.testing.assert_close(ours, theirs)


# ----------------------------------------------------------------------- the bf16 GEMM

needs_bf16_gemm = pytest.mark.skipif(
    not cpu_kernel.bf16_gemm_built(), reason="the kernels are not built for a CPU with AVX-512 BF16 here"
)
FLT_MIN = torch.finfo(torch.float32).tiny


def _flushed(x: torch.Tensor) -> torch.Tensor:
    """fp32 values below the smallest normal in magnitude flushed to (signed) zero."""
    return torch.where(x.abs() < FLT_MIN, x * 0, x)


def bf16_gemm_by_definition(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The bf16 GEMM's bits as csrc/kernels.c defines them, written out in torch: per output, a sum
    over k-pairs in order from 0, the odd product added before the even one, each product exact
    (bf16 x bf16 fits in fp32) and each addition rounded to fp32, inputs and results flushed to zero
    when denormal; the sum rounded to bf16."""
    xs, ws = _flushed(x.float()), _flushed(weight.float())
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(0, x.shape[1], 2):
        for j in (k + 1, k):
            product = _flushed((xs[:, j, None].double() * ws[None, :, j].double()).float())
            acc = _flushed(acc + product)
    return acc.to(torch.bfloat16)


def wide_range(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values over most of the exponent range, denormals included, none that overflow a sum."""
    mantissa = torch.rand(*shape, generator=gen) - 0.5
    exponent = torch.randint(-132, 30, shape, generator=gen).float()
    return (mantissa * torch.exp2(exponent)).bfloat16()


@needs_bf16_gemm
@pytest.mark.parametrize("M, K, N", [(1, 2, 1), (5, 64, 40), (19, 128, 96), (8, 30, 33)])
def test_the_bf16_gemm_has_the_bits_of_its_definition(M, K, N):
    gen = torch.Generator().manual_seed(M * 1000 + K + N)
    for x, weight in ((wide_range(gen, M, K), wide_range(gen, N, K)), grouping_probe(M, K, N, seed=K + N)):
        got = cpu_kernel.bf16_gemm(x, cpu_kernel.bf16_pack(weight), N)
        assert torch.equal(got, bf16_gemm_by_definition(x, weight))
        assert got.float().abs().sum() > 0


@needs_bf16_gemm
def test_the_bf16_gemm_gives_a_row_the_same_bits_alone_in_any_batch_and_on_any_threads():
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(70, 256, generator=gen).bfloat16(), torch.randn(200, 256, generator=gen).bfloat16()
    packed = cpu_kernel.bf16_pack(weight)
    # The engine's row-major weight (a transposed view) packs to the same panels.
    assert torch.equal(cpu_kernel.bf16_pack(weight.t().contiguous().t()), packed)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full = cpu_kernel.bf16_gemm(x, packed, 200)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_kernel.bf16_gemm(x, packed, 200), full)
            for start, stop in ((0, 1), (7, 8), (3, 20), (13, 70)):
                assert torch.equal(cpu_kernel.bf16_gemm(x[start:stop], packed, 200), full[start:stop])
    finally:
        torch.set_num_threads(saved)
    strided = torch.zeros(70, 300, dtype=torch.bfloat16)
    strided[:, 10:266] = x
    assert torch.equal(cpu_kernel.bf16_gemm(strided[:, 10:266], packed, 200), full)  # rows read in place
    torch.testing.assert_close(full.float(), x.float() @ weight.float().t(), rtol=2e-2, atol=0.3)


@needs_bf16_gemm
def test_the_bf16_gemm_refuses_an_odd_k_and_a_mismatched_packing():
    with pytest.raises(RuntimeError, match="even K"):
        cpu_kernel.bf16_pack(torch.ones(4, 3, dtype=torch.bfloat16))
    packed = cpu_kernel.bf16_pack(torch.ones(40, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not \\(40, 6\\)"):
        cpu_kernel.bf16_gemm(torch.ones(2, 6, dtype=torch.bfloat16), packed, 40)
