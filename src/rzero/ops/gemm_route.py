"""Which GEMM a bf16 linear runs on this CPU: rules of the machine (its CPU flags, the kernels'
build) that every process of a run on it shares, so engine and trainer agree
(rzero/ops/invariant.py applies them; docs/numerics.md says why each)."""

from __future__ import annotations

import functools
import os

import torch

from rzero.ops import cpu_kernel

BF16_GEMMS = ("bf16", "fp32")


@functools.lru_cache(maxsize=None)
def bf16_gemm() -> str:
    """How a bf16 linear multiplies on this CPU, one of BF16_GEMMS:
    "bf16": oneDNN's bf16 GEMM on bf16 operands (CPUs with amx_bf16, and AMD CPUs with avx512_bf16
      such as Zen 4, where it runs at ~2.3x the fp32 rate and, on the engine's row-major weights,
      takes 0.3-0.45x the fp32 panels' time at a 0.6B model's shapes from 16 to 1024 rows;
      docs/benchmarks.md, eleventh session);
    "fp32": the fp32 invariant GEMM on the bf16 values widened exactly to fp32, the result rounded
      to bf16 (other CPUs: without AMX, Intel's oneDNN bf16 GEMM runs at about half the fp32 rate,
      docs/benchmarks.md, fifth session); from PANEL_MIN weight elements in column panels.
    Both are invariant; they give different bits, so every process of a run must pick the same
    (they do: same machine, same environment). RZERO_BF16_GEMM overrides."""
    forced = os.environ.get("RZERO_BF16_GEMM", "")
    if forced:
        if forced not in BF16_GEMMS:
            raise ValueError(f"RZERO_BF16_GEMM={forced!r}: use one of {', '.join(BF16_GEMMS)}")
        return forced
    flags, amd = _cpu_flags()
    return "bf16" if "amx_bf16" in flags or (amd and "avx512_bf16" in flags) else "fp32"


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> tuple[frozenset[str], bool]:
    """(this CPU's feature flags, whether it is AMD's), from /proc/cpuinfo (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = cpuinfo.readlines()
    except OSError:
        lines = []
    flags = next((line for line in lines if line.startswith("flags")), "").split()
    return frozenset(flags), any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in lines)


@functools.lru_cache(maxsize=None)
def bf16_kernel() -> bool:
    """Whether small bf16 weights (KERNEL_MAX) multiply on our own GEMM (csrc/kernels.c,
    rz_bf16_gemm): on CPUs with avx512_bf16 and without AMX, when the kernels are built for them.
    Its bits are its own definition (each output one fixed-order sum, independent of the rows and
    threads; rzero/ops/cpu_kernel.py), not oneDNN's; at an engine step's shapes it runs at the
    instruction's rate where oneDNN pays ~12 us a call (docs/benchmarks.md, fourteenth session).
    A rule of the machine and the weight's shape, so trainer and engine agree.
    RZERO_BF16_KERNEL=0 turns it off, =1 insists on it (an error where it cannot run)."""
    forced = os.environ.get("RZERO_BF16_KERNEL", "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"RZERO_BF16_KERNEL={forced!r}: use 0 (off) or 1 (on)")
    if forced == "0":
        return False
    built = cpu_kernel.bf16_gemm_built()
    if forced == "1":
        if not built:
            raise RuntimeError(
                f"RZERO_BF16_KERNEL=1, but the bf16 GEMM is not available here (kernels: {cpu_kernel.kernel_status()}; "
                "it needs a CPU with avx512_bf16)"
            )
        return True
    flags, _ = _cpu_flags()
    return built and "avx512_bf16" in flags and "amx_bf16" not in flags


# Small bf16 weights (below KERNEL_MAX elements, every weight of the tiny presets) with an even K
# run on our own bf16 GEMM where `bf16_kernel()`; larger ones keep `bf16_gemm()`'s route.
KERNEL_MAX = 1 << 20


def on_kernel(weight: torch.Tensor) -> bool:
    """Whether this bf16 weight's linear runs on our own GEMM (see bf16_kernel)."""
    return weight.numel() < KERNEL_MAX and weight.shape[1] % 2 == 0 and weight.is_cpu and bf16_kernel()
