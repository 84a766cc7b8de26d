"""The CPU's own invariant kernels, in C (`csrc/kernels.c`): causal attention over the paged KV
cache (forward and training backward) and RMSNorm, compiled on first use with the system's C
compiler and loaded with ctypes.

Why a kernel of our own: built from stock ops, invariant attention must gather every sequence's
K and V out of the paged cache into fp32 matmul layout, once per layer and step, and fold P @ V
in 16-key GEMMs; at decode that is most of a step. The kernel reads the cache blocks in place and
computes each (token, KV head) on its own, in one fixed order, so its bits cannot depend on the
batch (see the C file's header). The trainer's forward runs the same kernel; its backward is
plain softmax-attention math, in C as well. RMSNorm, log_softmax and the sampler's draw are one
pass per row instead of several tensor ops (on short rows mostly dispatch). On CPUs with AVX-512
BF16, a bf16 GEMM for small weights (`bf16_gemm`; where: rzero/ops/gemm_route.py, bf16_kernel).

The shared library is built once per source, flags and CPU (`-march=native`: the kernel's bits
do not depend on it, fmaf is exact by definition, only its speed does) into the cache directory
`$RZERO_KERNEL_CACHE` (default `~/.cache/rzero/kernels`), atomically, so concurrent worker
processes may race to build it. Without a compiler, or with `RZERO_CPU_KERNELS=0`, the CPU falls
back to the stock-op attention: other bits, so every process of a run must make the same choice
(they share the environment and the machine, so they do). `kernel_status()` says which is in use.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from rzero.ops.attention_meta import AttentionMeta
from rzero.ops.scratch import scratch

SOURCE = Path(__file__).with_name("csrc") / "kernels.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing", "-fPIC", "-shared", "-pthread")
# With OpenMP the kernels run on the threads of the libgomp.so.1 torch has loaded (csrc/kernels.c,
# run_parallel); without it (no -fopenmp in this compiler), on threads of their own.
OPENMP_FLAGS = (*FLAGS, "-fopenmp")
_NOT_IN_USE: list[str] = []  # why library() returned None


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("RZERO_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rzero" / "kernels"


def _build(compiler: str, flags: tuple[str, ...], target: Path, source: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}:\n{result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a racing process sees no library or the whole of it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load(
    flags: tuple[str, ...] = FLAGS, compiler: str | None = None, cache_dir: Path | None = None, source: Path = SOURCE
) -> ctypes.CDLL:
    """Build (once per source, flags, compiler and CPU) and load the kernel library. Raises
    RuntimeError or OSError if it cannot; `library()` turns that into the stock-op fallback.
    `source`: another version of csrc/kernels.c (benchmarks/bench_attention.py compares them)."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), " ".join(flags).encode(), compiler.encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    name = f"rzero_kernels_{key}.so"
    target = (cache_dir or _cache_dir()) / name
    if not target.exists():
        try:
            _build(compiler, flags, target, source)
        except OSError:  # an unwritable cache directory: build into this user's temporary one
            target = Path(tempfile.gettempdir()) / f"rzero-kernels-{os.getuid()}" / name
            if not target.exists():
                _build(compiler, flags, target, source)
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p  # every function returns int, ctypes' default restype
    lib.rz_attention.argtypes = [ptr, ctypes.c_int, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr,
                                 i64, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    lib.rz_attention_backward.argtypes = [ptr, ctypes.c_int, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64,
                                          ptr, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, ptr, ctypes.c_int,
                                          ctypes.c_int]
    lib.rz_rms_norm.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
    lib.rz_rms_norm_backward.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, i64, ptr, ctypes.c_float, ptr, ptr, ptr,
                                         ctypes.c_int]
    lib.rz_rotary.argtypes = [ptr, ctypes.c_int, ptr, ptr, i64, i64, i64, ptr]
    lib.rz_rotary_backward.argtypes = [ptr, ctypes.c_int, ptr, ptr, i64, i64, i64, ptr]
    lib.rz_cached_attention.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ctypes.c_float, ptr, ptr,
                                        ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                        ctypes.c_float, ptr, ctypes.c_int]
    lib.rz_inverse_cdf.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.rz_bf16_pack.argtypes = [ptr, i64, i64, i64, i64, ptr]
    lib.rz_bf16_gemm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_int]
    return lib


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The kernel library this process uses, or None for the stock-op fallback (`kernel_status` says why)."""
    if os.environ.get("RZERO_CPU_KERNELS", "1") == "0":
        _NOT_IN_USE.append("disabled by RZERO_CPU_KERNELS=0")
        return None
    if not sys.platform.startswith("linux"):
        _NOT_IN_USE.append(f"built on Linux only (this is {sys.platform})")
        return None
    try:
        return load(OPENMP_FLAGS)
    except (OSError, RuntimeError):
        pass
    try:
        return load()
    except (OSError, RuntimeError) as error:
        _NOT_IN_USE.append(str(error))
        warnings.warn(f"rzero: the CPU attention kernel is not in use, stock ops instead (slower): {error}", stacklevel=2)
        return None


def kernel_status() -> str:
    """"c kernel" when the compiled kernel is in use, else "stock ops (<why>)"."""
    return "c kernel" if library() is not None else f"stock ops ({'; '.join(_NOT_IN_USE) or 'not built'})"


def _token_index(meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block tables, sequence and position of each real query token), once per meta (every layer's)."""
    index = meta.__dict__.get("_kernel_index")
    if index is None:
        index = meta.__dict__["_kernel_index"] = (
            meta.block_tables.contiguous(), meta.token_seq.contiguous(), meta.positions[: meta.num_tokens].contiguous()
        )
    return index


def _check(status: int) -> None:
    if status:
        reasons = {
            1: "out of memory", 2: "could not start a thread",
            3: "the bf16 GEMM is not built for this CPU (no AVX-512 BF16)", 4: "the bf16 GEMM needs an even K",
        }
        raise RuntimeError(f"CPU kernel: {reasons.get(status, f'failed ({status})')}")


def _checked_dtypes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    supported = (torch.float32, torch.bfloat16)
    if q.dtype not in supported or k_cache.dtype not in supported or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"CPU attention kernel: q {q.dtype}, K/V {k_cache.dtype}/{v_cache.dtype}; needs fp32 or bf16")


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """Causal attention of q (tokens, H, D; rows past meta.num_tokens are not read) over the paged caches (blocks, ATTN_BLOCK, Hkv, D),
    fp32 inside, returned in q's dtype; padding rows are 0. No autograd (see invariant_attention).
    `lib`: another build of the kernel (tests compare builds); default `library()`."""
    lib = lib or library()
    _checked_dtypes(q, k_cache, v_cache)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, seq, pos = _token_index(meta)
    _, heads, head_dim = q.shape
    out = torch.empty(meta.padded_tokens, heads, head_dim, dtype=torch.float32)
    out[meta.num_tokens :] = 0
    status = lib.rz_attention(
        q.data_ptr(), q.dtype == torch.bfloat16, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype == torch.bfloat16,
        tables.data_ptr(), tables.shape[1], seq.data_ptr(), pos.data_ptr(), meta.num_tokens, heads,
        k_cache.shape[2], head_dim, k_cache.shape[1], scale, out.data_ptr(), torch.get_num_threads(),
    )
    _check(status)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """For each row of logprobs (rows, V) fp32 the sampler's draw at its uniform (csrc/kernels.c,
    rz_inverse_cdf): the first token whose running sum of exp(logprob) passes uniform * the total."""
    lib, logprobs, uniform = lib or library(), logprobs.contiguous(), uniform.contiguous()
    rows, vocab = logprobs.shape
    out = torch.empty(rows, dtype=torch.long)
    threads = torch.get_num_threads()
    prefixes = scratch("inverse_cdf", threads * 4 * vocab)  # each thread's prefix sums of four rows
    _check(lib.rz_inverse_cdf(logprobs.data_ptr(), rows, vocab, uniform.data_ptr(), prefixes.data_ptr(), out.data_ptr(),
                              threads))
    return out


def log_softmax(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """log_softmax over the last dim of fp32 x, rzero's own (csrc/kernels.c, rz_log_softmax)."""
    rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel = (lib or library()).rz_log_softmax
    if kernel.argtypes is None:  # bound here: load() also loads older sources (benchmarks/bench_attention.py)
        kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    _check(kernel(rows.data_ptr(), rows.shape[0], x.shape[-1], rows.stride(0), out.data_ptr(), torch.get_num_threads()))
    return out


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """x (tokens, heads, D) with each row's heads contiguous (a view of the fused projection is),
    else a contiguous copy."""
    D = x.shape[-1]
    return x if x.stride(-1) == 1 and x.stride(-2) == D else x.contiguous()


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta,
    scale: float, lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """The engine's attention step in one call (csrc/kernels.c, rz_cached_attention): RMSNorm
    (q_weight, k_weight) and rotary (cos, sin: (tokens, 1, D)) of q (tokens, H, D) and k (tokens,
    Hkv, D), the keys and values written to the caches at meta.slot_mapping, then `attention`;
    returns (padded tokens, H, D) in q's dtype. The bits of those ops run one by one. No autograd.
    Every tensor in one dtype, fp32 or bf16 (the caller checks)."""
    lib = lib or library()
    tokens, heads, head_dim = q.shape
    q, k, v = _heads_view(q), _heads_view(k), _heads_view(v)
    # Every tensor whose pointer the call takes is held here, so no temporary is freed before it.
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    cos, sin = cos.reshape(tokens, head_dim).contiguous(), sin.reshape(tokens, head_dim).contiguous()
    tables, seq, pos = _token_index(meta)
    q_rot = torch.empty(meta.num_tokens, heads, head_dim, dtype=q.dtype)
    out = torch.empty(meta.padded_tokens, heads, head_dim, dtype=q.dtype)
    _check(lib.rz_cached_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), q.dtype == torch.bfloat16,
        q_weight.data_ptr(), k_weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
        meta.slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q_rot.data_ptr(), tables.data_ptr(),
        tables.shape[1], seq.data_ptr(), pos.data_ptr(), meta.num_tokens, meta.padded_tokens, heads, k_cache.shape[2],
        head_dim, k_cache.shape[1], scale, out.data_ptr(), torch.get_num_threads(),
    ))
    return out


def attention_backward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMeta, scale: float, grad: torch.Tensor,
    lib: ctypes.CDLL | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (fp32) of q, k_cache and v_cache for the output gradient `grad` (tokens, H, D):
    plain softmax-attention math, probabilities recomputed, rows past meta.num_tokens get 0."""
    lib = lib or library()
    _checked_dtypes(q, k_cache, v_cache)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    grad = grad.float().contiguous()
    tables, seq, pos = _token_index(meta)
    starts, distinct = _backward_index(meta, k_cache.shape[1])
    dq = torch.zeros(q.shape[0], *q.shape[1:], dtype=torch.float32)
    dk = torch.zeros(k_cache.shape, dtype=torch.float32)
    dv = torch.zeros(v_cache.shape, dtype=torch.float32)
    _check(lib.rz_attention_backward(
        q.data_ptr(), q.dtype == torch.bfloat16, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.dtype == torch.bfloat16,
        tables.data_ptr(), tables.shape[1], seq.data_ptr(), pos.data_ptr(), starts.data_ptr(), len(meta.q_lens),
        grad.data_ptr(), q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), torch.get_num_threads(), not distinct,
    ))
    return dq, dk, dv


def _backward_index(meta: AttentionMeta, block: int) -> tuple[torch.Tensor, bool]:
    """(each sequence's first token and the end, whether no two sequences share a cache block), once
    per meta. Threads split the work by (KV head, sequence), each writing its sequence's dK/dV rows;
    where sequences share blocks (a GRPO group's prompt) each thread takes whole KV heads instead."""
    index = meta.__dict__.setdefault("_backward_index", {})
    if block not in index:
        starts = torch.tensor([0, *meta.q_lens], dtype=torch.int64).cumsum(0)
        used = [t[: -(-n // block)] for t, n in zip(meta.block_tables.tolist(), meta.kv_lens.tolist())]
        index[block] = starts, len({b for t in used for b in t}) == sum(len(t) for t in used)
    return index[block]


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """x as rows of its last dim: (tensor, (outer, inner, outer stride, inner stride)). A 2-D or 3-D
    view whose last dim is contiguous (a column slice of a fused projection) is read in place."""
    n = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous().view(-1, n)
    if x.dim() == 1:
        x = x.view(1, n)
    return x, ((1, x.shape[0], 0, x.stride(0)) if x.dim() == 2 else (x.shape[0], x.shape[1], x.stride(0), x.stride(1)))


def _norm_dtypes(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
        raise TypeError(f"CPU rms_norm kernel: x {x.dtype}, weight {weight.dtype}; needs both fp32 or both bf16")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (fp32 or bf16; weight of the same dtype), in one fixed order
    per row (csrc/kernels.c); the output is contiguous."""
    lib = lib or library()
    _norm_dtypes(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, layout = _row_layout(x)
    weight = weight.contiguous()
    _check(lib.rz_rms_norm(rows.data_ptr(), x.dtype == torch.bfloat16, *layout, x.shape[-1], weight.data_ptr(), eps,
                           out.data_ptr(), torch.get_num_threads()))
    return out


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor, want_x: bool, want_w: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients (in x's and weight's dtypes) of RMSNorm for the output gradient `grad`."""
    _norm_dtypes(x, weight)
    rows, layout = _row_layout(x)
    weight = weight.contiguous()
    grad = grad.float().contiguous()
    grad_x = torch.empty(x.shape, dtype=torch.float32) if want_x else None
    grad_w = torch.zeros(x.shape[-1], dtype=torch.float32) if want_w else None
    _check(library().rz_rms_norm_backward(
        rows.data_ptr(), x.dtype == torch.bfloat16, *layout, x.shape[-1], weight.data_ptr(), eps, grad.data_ptr(),
        None if grad_x is None else grad_x.data_ptr(), None if grad_w is None else grad_w.data_ptr(),
        torch.get_num_threads(),
    ))
    return (None if grad_x is None else grad_x.to(x.dtype)), (None if grad_w is None else grad_w.to(weight.dtype))


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of `rotary`'s x for the output gradient grad (T, H, D): grad * cos plus the
    transposed rotation of grad * sin, with that torch expression's bits (cos, sin as for `rotary`)."""
    T, H, D = grad.shape
    grad, cos, sin = grad.contiguous(), cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
    out = torch.empty_like(grad)
    _check(library().rz_rotary_backward(grad.data_ptr(), grad.dtype == torch.bfloat16, cos.data_ptr(), sin.data_ptr(),
                                        T, H, D, out.data_ptr()))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x (T, H, D) and cos, sin (T, 1, D), all of one dtype (fp32
    or bf16): the bits of that torch expression, in one pass (csrc/kernels.c)."""
    lib = lib or library()
    if x.dtype not in (torch.float32, torch.bfloat16) or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise TypeError(f"CPU rotary kernel: x {x.dtype}, cos {cos.dtype}, sin {sin.dtype}; needs all fp32 or all bf16")
    T, H, D = x.shape
    if D % 2:
        raise ValueError(f"CPU rotary kernel: head_dim {D} is odd; rotate-half needs an even one")
    x, cos, sin = x.contiguous(), cos.reshape(T, D).contiguous(), sin.reshape(T, D).contiguous()
    out = torch.empty_like(x)
    _check(lib.rz_rotary(x.data_ptr(), x.dtype == torch.bfloat16, cos.data_ptr(), sin.data_ptr(), T, H, D, out.data_ptr()))
    return out


GEMM_COLUMNS = 32  # a packed weight's panel width (csrc/kernels.c, GEMM_COLS)


def bf16_gemm_built(lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build of the kernels has the bf16 GEMM (compiled for a CPU with AVX-512 BF16)."""
    lib = lib or library()
    return lib is not None and bool(lib.rz_bf16_gemm_built())


def bf16_pack(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """A bf16 weight (N, K), any strides, K even, in the bf16 GEMM's layout: panels of 32 columns
    with the k-pairs interleaved (csrc/kernels.c, rz_bf16_pack), zero columns past N."""
    lib = lib or library()
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise TypeError(f"bf16 GEMM: the weight must be a 2-D bf16 tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    out = torch.empty(-(-n // GEMM_COLUMNS) * GEMM_COLUMNS * k, dtype=torch.bfloat16)
    _check(lib.rz_bf16_pack(weight.data_ptr(), n, k, weight.stride(0), weight.stride(1), out.data_ptr()))
    return out


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x (M, K) bf16 (rows may be strided, each contiguous) times the weight `bf16_pack` packed into
    `packed`, whose N is `n`: (M, n) bf16, each element's bits independent of M and the threads."""
    lib = lib or library()
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError(f"bf16 GEMM: x must be a 2-D bf16 tensor, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if packed.numel() != -(-n // GEMM_COLUMNS) * GEMM_COLUMNS * k:
        raise ValueError(f"bf16 GEMM: a packed weight of {packed.numel()} elements is not ({n}, {k})")
    out = torch.empty(m, n, dtype=torch.bfloat16)
    _check(lib.rz_bf16_gemm(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, out.data_ptr(), torch.get_num_threads()))
    return out
