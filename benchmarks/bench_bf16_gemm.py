"""rzero's own bf16 GEMM (csrc/kernels.c, rz_bf16_gemm) beside torch.mm (oneDNN), per call.

    python benchmarks/bench_bf16_gemm.py [--threads 1] [--calls 2000]

Shapes: a tiny model's decode (64 rows) and training (512-544 rows) linears, and 16 rows. torch.mm
runs on the row-major weight the engine stores; the kernel on its packed panels (packed once, as
the engine keeps them). Both sides in one process, one after the other per shape; wall clock. Needs
a CPU with avx512_bf16 and the kernels built (it says so otherwise). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from rzero.ops import cpu_kernel

SHAPES = [(64, 128, 256), (64, 128, 128), (64, 128, 1024), (64, 512, 128), (16, 128, 1024), (512, 128, 1024), (544, 512, 128)]


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(10, calls // 20)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernel.bf16_gemm_built():
        print(f"the bf16 GEMM is not built here (kernels: {cpu_kernel.kernel_status()}; it needs a CPU with avx512_bf16)")
        return 1
    print(f"torch {torch.__version__}, {args.threads} thread(s), per call, wall clock")
    print(f"{'M x K x N':>16} {'torch.mm us':>12} {'GFLOP/s':>8} {'rzero us':>9} {'GFLOP/s':>8} {'speed-up':>9}")
    gen = torch.Generator().manual_seed(0)
    for M, K, N in SHAPES:
        x = torch.randn(M, K, generator=gen).bfloat16()
        weight = torch.randn(N, K, generator=gen).bfloat16()
        row_major, packed = weight.t().contiguous(), cpu_kernel.bf16_pack(weight)
        t_torch = per_call_us(lambda: torch.mm(x, row_major), args.calls)
        t_ours = per_call_us(lambda: cpu_kernel.bf16_gemm(x, packed, N), args.calls)
        flop = 2 * M * K * N / 1e3
        print(f"{f'{M} x {K} x {N}':>16} {t_torch:12.1f} {flop / t_torch:8.0f} {t_ours:9.1f} {flop / t_ours:8.0f} {t_torch / t_ours:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
