"""The CPU attention kernel against another version of itself, side by side in one process.

    python benchmarks/bench_attention.py [--against REV] [--threads N] [--dtype bf16|fp32]
                                         [--heads 4 --kv-heads 2 --head-dim 32] [--rounds 300]
                                         [--evict MB]

Builds `src/rzero/ops/csrc/kernels.c` as it is in git revision REV (default HEAD) beside the working
tree's, then times `cpu_kernel.attention` on both, alternating every few calls (the machine's speed
drifts; a per-round ratio cancels it), for two batches on a paged cache with shuffled blocks:

- decode: 64 sequences of 17-177 cached positions, one query token each (an engine step of the
  tiny presets' 64 x 128-token benchmark, halfway through);
- prefill: 8 sequences of 64-192 tokens (a trainer's forward: every token attends to its prefix).

It also says whether both builds give the same bits: a kernel change that is only a speed-up must.

`--evict MB` reads MB of other memory before every call (not timed), so that the call finds its
K/V rows in DRAM, not in cache, as in an engine's decode step, where the weights and the other
layers' caches pass through the caches between two calls of one layer. This decode batch in fp32
on one thread here: 117 us with its 3.5 MB of K/V cached, 304 / 399 / 665 us after reading 16 / 32 /
64 MB; the engine's calls average ~420 us in a whole generate (docs/benchmarks.md, eighteenth session).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rzero.ops import AttentionMeta, cpu_kernel

ROOT = Path(__file__).resolve().parents[1]


def paged_batch(q_lens: list[int], ctx_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype, seed: int):
    rng = random.Random(seed)
    counts = [-(-(c + q) // 16) for q, c in zip(q_lens, ctx_lens)]
    blocks = list(range(sum(counts)))
    rng.shuffle(blocks)  # a cache in use: a sequence's blocks are anywhere
    tables, start = [], 0
    for n in counts:
        tables.append(blocks[start : start + n])
        start += n
    meta = AttentionMeta.build(q_lens, ctx_lens, tables, row_tile=16)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(meta.padded_tokens, heads, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(len(blocks), 16, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(len(blocks), 16, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="HEAD", help="git revision whose kernels.c is the baseline")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--calls", type=int, default=5, help="calls per contender per round")
    p.add_argument("--evict", type=int, default=0, metavar="MB", help="read this much other memory before each call")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{args.against}:src/rzero/ops/csrc/kernels.c"],
        capture_output=True, text=True, check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        old_source = Path(tmp) / "kernels.c"
        old_source.write_text(source)
        builds = {
            args.against: cpu_kernel.load(cpu_kernel.OPENMP_FLAGS, cache_dir=Path(tmp), source=old_source),
            "working tree": cpu_kernel.load(cpu_kernel.OPENMP_FLAGS, cache_dir=Path(tmp)),
        }
    evict = torch.ones(args.evict * 2**18) if args.evict else None  # fp32: 2^18 per MB
    rng = random.Random(0)
    batches = {
        "decode": ([1] * 64, [rng.randint(16, 176) for _ in range(64)]),
        "prefill": ([rng.randint(64, 192) for _ in range(8)], [0] * 8),
    }
    print(f"command: python {' '.join(sys.argv)}")
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, heads {args.heads} / kv {args.kv_heads}, "
          f"head_dim {args.head_dim}; median over {args.rounds} alternating rounds of {args.calls} calls"
          + (f", {args.evict} MB read before each" if args.evict else ""))
    print(f"{'batch':8s} {args.against + ' us':>14s} {'working tree us':>16s} {'ratio':>7s}  same bits")
    for name, (q_lens, ctx_lens) in batches.items():
        q, k_cache, v_cache, meta = paged_batch(q_lens, ctx_lens, args.heads, args.kv_heads, args.head_dim, dtype, seed=1)
        scale = args.head_dim**-0.5
        outs = [cpu_kernel.attention(q, k_cache, v_cache, meta, scale, lib=lib) for lib in builds.values()]
        same = torch.equal(outs[0].float().view(torch.int32), outs[1].float().view(torch.int32))
        times: dict[str, list[float]] = {label: [] for label in builds}
        for r in range(args.rounds):
            for label, lib in builds.items() if r % 2 == 0 else reversed(builds.items()):
                elapsed = 0.0
                for _ in range(args.calls):
                    if evict is not None:
                        evict.sum()
                    start = time.perf_counter()
                    cpu_kernel.attention(q, k_cache, v_cache, meta, scale, lib=lib)
                    elapsed += time.perf_counter() - start
                times[label].append(elapsed / args.calls * 1e6)
        old, new = times.values()
        ratio = statistics.median(a / b for a, b in zip(old, new))
        print(f"{name:8s} {statistics.median(old):14.1f} {statistics.median(new):16.1f} {ratio:6.2f}x  {same}")


if __name__ == "__main__":
    main()
