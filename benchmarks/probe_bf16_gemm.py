"""Feasibility probe: would a bf16 GEMM of our own beat torch.mm (oneDNN) at the tiny model's shapes?

    python benchmarks/probe_bf16_gemm.py [--threads 1]

Needs a C compiler and a CPU with avx512_bf16 (it says so and exits otherwise). It compiles, into
a temp dir, a plain AVX-512 BF16 kernel (`vdpbf16ps`, 8 rows x 32 columns of fp32 accumulators,
the weight prepacked in k-pairs, one fixed k order per output, rounded to bf16), times it beside
`torch.mm` on the row-major weight the engine stores, and measures the instruction's own rate
(a register-only loop of 24 independent accumulators) as the ceiling. Not used by rzero: its
result (docs/benchmarks.md, fourteenth session) decided against a new numerics design for it.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

KERNEL = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
void pack(const uint16_t *W, int64_t N, int64_t K, uint16_t *out) {  /* (N, K) -> [panel][k/2][32][2] */
    int64_t panels = (N + 31) / 32, pairs = K / 2;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < pairs; kk++)
            for (int64_t j = 0; j < 32; j++) {
                int64_t n = p * 32 + j;
                uint16_t *dst = out + ((p * pairs + kk) * 32 + j) * 2;
                dst[0] = n < N ? W[n * K + 2 * kk] : 0;
                dst[1] = n < N ? W[n * K + 2 * kk + 1] : 0;
            }
}
static void tile(const uint16_t *A, int64_t K, int64_t rows, const uint16_t *B, int64_t pairs, uint16_t *C,
                 int64_t ldc, int64_t cols) {
    __m512 acc[8][2];
    for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < pairs; kk++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + kk * 64), b1 = (__m512bh)_mm512_loadu_si512(B + kk * 64 + 32);
        for (int r = 0; r < 8; r++)
            if (r < rows) {
                int32_t a;
                memcpy(&a, A + r * K + 2 * kk, 4);
                __m512bh av = (__m512bh)_mm512_set1_epi32(a);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
            }
    }
    for (int r = 0; r < rows; r++) {
        uint16_t t[32];
        _mm256_storeu_si256((__m256i *)t, (__m256i)_mm512_cvtneps_pbh(acc[r][0]));
        _mm256_storeu_si256((__m256i *)(t + 16), (__m256i)_mm512_cvtneps_pbh(acc[r][1]));
        memcpy(C + r * ldc, t, cols * 2);
    }
}
void gemm(const uint16_t *A, int64_t M, int64_t K, const uint16_t *B, int64_t N, uint16_t *C) {
    int64_t pairs = K / 2;
    for (int64_t p = 0; p < (N + 31) / 32; p++)
        for (int64_t m = 0; m < M; m += 8)
            tile(A + m * K, K, M - m < 8 ? M - m : 8, B + p * pairs * 64, pairs, C + m * N + p * 32, N,
                 N - p * 32 < 32 ? N - p * 32 : 32);
}
double instruction_gflops(void) {  /* vdpbf16ps on registers only: the ceiling */
    __m512 a[24];
    for (int j = 0; j < 24; j++) a[j] = _mm512_setzero_ps();
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x00010001);
    long n = 20000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        for (int j = 0; j < 24; j++) a[j] = _mm512_dpbf16_ps(a[j], x, y);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    float sink = 0;
    for (int j = 0; j < 24; j++) sink += _mm512_reduce_add_ps(a[j]);
    double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9 + (sink == 12345.f);
    return n * 24.0 * 64 / s / 1e9;
}
"""

SHAPES = [(64, 128, 256), (64, 128, 128), (64, 128, 1024), (64, 512, 128), (16, 128, 1024), (512, 128, 1024), (544, 512, 128)]


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the probe kernel runs on one)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    compiler = shutil.which("cc") or shutil.which("gcc")
    if "avx512_bf16" not in flags or compiler is None:
        print("needs a CPU with avx512_bf16 and a C compiler; this machine has " + ("no C compiler" if compiler is None else "no avx512_bf16"))
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        src, lib_path = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
        src.write_text(KERNEL)
        subprocess.run([compiler, "-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", str(src), "-o", str(lib_path)], check=True)
        lib = ctypes.CDLL(str(lib_path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pack.argtypes = [ptr, i64, i64, ptr]
    lib.gemm.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.instruction_gflops.restype = ctypes.c_double
    print(f"vdpbf16ps on registers, one core: {lib.instruction_gflops():.1f} GFLOP/s (the probe's ceiling)")
    print(f"torch {torch.__version__}, torch.mm on {args.threads} thread(s), probe kernel on one; per call, wall clock")
    print(f"{'M x K x N':>16} {'torch.mm us':>12} {'GFLOP/s':>8} {'probe us':>9} {'GFLOP/s':>8} {'torch/probe':>11} {'max |err|':>10}")
    gen = torch.Generator().manual_seed(0)
    for M, K, N in SHAPES:
        x = torch.randn(M, K, generator=gen).bfloat16()
        w = torch.randn(N, K, generator=gen).bfloat16()
        packed = torch.empty(-(-N // 32) * 32 * K, dtype=torch.bfloat16)
        lib.pack(w.data_ptr(), N, K, packed.data_ptr())
        out = torch.empty(M, N, dtype=torch.bfloat16)
        row_major = w.t().contiguous()

        def probe():
            lib.gemm(x.data_ptr(), M, K, packed.data_ptr(), N, out.data_ptr())

        probe()
        err = (out.float() - x.float() @ w.float().t()).abs().max().item()  # bf16 rounding of the result only
        t_torch = per_call_us(lambda: torch.mm(x, row_major))
        t_probe = per_call_us(probe)
        flop = 2 * M * K * N / 1e3
        print(f"{f'{M} x {K} x {N}':>16} {t_torch:12.1f} {flop / t_torch:8.0f} {t_probe:9.1f} {flop / t_probe:8.0f} "
              f"{t_torch / t_probe:10.2f}x {err:10.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
