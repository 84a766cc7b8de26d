"""The alignment checklist C0-C10 (docs/checklist.md): `rzero check --model DIR --numerics M --dtype D`.

Each check compares two numbers that trainer-inference invariance says are bitwise equal, and
passes only when the largest difference it sees is exactly 0.0. In `invariant` numerics every check
passes; in `standard` numerics the parity checks fail with their nonzero differences (the negative
control that shows the checks can fail).

The trainer side is `rzero.train.trainer.Trainer` and the engine side `rzero.engine.Engine`, both
built with the requested numerics (check/harness.py); the checks are in engine_checks.py (C2-C6)
and trainer_checks.py (C0, C1, C7-C10). Every input (prompts, batch neighbours, seeds) comes from
`--seed`, so a run is reproducible.

Python API: `run_checks(model_dir, numerics, dtype, seed) -> list[CheckResult]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from rzero.check.engine_checks import (
    c2_prefill_parity,
    c3_decode_parity,
    c4_batch_size_invariance,
    c5_composition_invariance,
    c6_chunk_and_prefix_invariance,
)
from rzero.check.harness import CheckResult, Harness, fmt
from rzero.ops import cpu_layer, resolve_device, train_layer
from rzero.ops.cpu_kernel import kernel_status
from rzero.ops.gemm_route import KERNEL_MAX, bf16_gemm, bf16_kernel
from rzero.ops.device import intra_op_threads, model_dir_threads
from rzero.check.trainer_checks import (
    c0_numerics_audit,
    c1_weight_parity,
    c7_sampler_parity,
    c8_moe_routing_invariance,
    c9_training_forward_parity,
    c10_end_to_end_ratio,
)

CHECKS: list[tuple[str, str]] = [
    ("C0", "numerics audit"),
    ("C1", "weight parity"),
    ("C2", "prefill parity"),
    ("C3", "decode parity"),
    ("C4", "batch-size invariance"),
    ("C5", "composition invariance"),
    ("C6", "chunk and prefix invariance"),
    ("C7", "sampler parity"),
    ("C8", "MoE routing invariance"),
    ("C9", "training-forward parity"),
    ("C10", "end-to-end ratio"),
]

CHECK_FUNCTIONS: dict[str, Callable[[Harness], CheckResult]] = {
    "C0": c0_numerics_audit,
    "C1": c1_weight_parity,
    "C2": c2_prefill_parity,
    "C3": c3_decode_parity,
    "C4": c4_batch_size_invariance,
    "C5": c5_composition_invariance,
    "C6": c6_chunk_and_prefix_invariance,
    "C7": c7_sampler_parity,
    "C8": c8_moe_routing_invariance,
    "C9": c9_training_forward_parity,
    "C10": c10_end_to_end_ratio,
}


# ---------------------------------------------------------------------------------- running


def run_checks(
    model_dir: str | Path,
    numerics: str = "invariant",
    dtype: str = "fp32",
    seed: int = 0,
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> list[CheckResult]:
    """Run the checklist (all of C0-C10, or the ids in `only`) and return one result per check.

    The trainer and the engines are built with `numerics`. A bad model directory raises
    FileNotFoundError/ValueError;
    a check that crashes is reported as failed with max_abs_diff None and the error in its detail.
    """
    ids = [cid for cid, _ in CHECKS if only is None or cid in only]
    unknown = set(only or ()) - {cid for cid, _ in CHECKS}
    if unknown:
        raise ValueError(f"unknown check ids: {', '.join(sorted(unknown))}")
    results = []
    harness = Harness(model_dir, numerics, dtype, seed, device=device)
    for cid in ids:
        if progress:
            progress(cid)
        start = time.perf_counter()
        harness.reseed(cid)
        try:
            result = CHECK_FUNCTIONS[cid](harness)
        except Exception as err:  # a crashing check fails; the others still run
            traceback.print_exc(file=sys.stderr)
            result = CheckResult(cid, dict(CHECKS)[cid], "(crashed)", None, False, f"error: {type(err).__name__}: {err}")
        result.seconds = time.perf_counter() - start
        results.append(result)
    return results


def report(results: list[CheckResult], model_dir: str | Path, numerics: str, dtype: str, seconds: float | None = None) -> dict:
    out = {
        "numerics": numerics,
        "dtype": dtype,
        "model": str(model_dir),
        "cpu_attention": kernel_status(),  # the C kernel, or the stock-op fallback and why
        "cpu_bf16_gemm": bf16_gemm(),  # which GEMM a CPU bf16 linear runs (gemm_route.bf16_gemm)
        "cpu_bf16_kernel": bf16_kernel(),  # small bf16 weights on rzero's own GEMM (gemm_route.bf16_kernel)
        "cpu_decoder_layer_calls": dict(cpu_layer.CALLS),  # engine layers run in one C call (ops/cpu_layer.py)
        "train_layer_calls": dict(train_layer.CALLS),  # training blocks run as one autograd node each (ops/train_layer.py)
        "passed": all(r.passed for r in results),
        "checks": [r.to_json() for r in results],
    }
    if seconds is not None:
        out["seconds"] = round(seconds, 2)
    return out


def print_table(results: list[CheckResult], model_dir, numerics: str, dtype: str, seconds: float, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=max(140, Console().width))
    table = Table(title=f"rzero check  {model_dir}  numerics={numerics}  dtype={dtype}", show_lines=False)
    table.add_column("check", no_wrap=True)
    table.add_column("name", no_wrap=True)
    table.add_column("compared", ratio=1)
    table.add_column("max |Δ|", justify="right", no_wrap=True)
    table.add_column("result", no_wrap=True)
    for r in results:
        diff = r.max_abs_diff
        shown = "error" if diff is None else diff if isinstance(diff, str) else fmt(diff)
        verdict = "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]"
        compared = r.compared + (f"\n[dim]{r.detail}[/dim]" if r.detail else "")
        table.add_row(r.id, r.name, compared, shown, verdict)
    console.print(table)
    small = f", below {KERNEL_MAX} weight elements rzero's own GEMM" if bf16_kernel() else ""
    console.print(f"[dim]CPU attention: {kernel_status()}; CPU bf16 linears: {bf16_gemm()} (RZERO_BF16_GEMM){small} "
                  "(RZERO_BF16_KERNEL)[/dim]")
    passed = sum(r.passed for r in results)
    colour = "green" if passed == len(results) else "red"
    console.print(f"[{colour}]{passed}/{len(results)} checks passed[/{colour}] in {seconds:.1f} s")


def main(args: argparse.Namespace) -> int:
    """`rzero check`: exit 0 iff every check passes, 1 otherwise (the CLI maps bad input to 2)."""
    start = time.perf_counter()
    progress = None
    if not args.json and sys.stderr.isatty():
        progress = lambda cid: print(f"  running {cid} ...", file=sys.stderr, flush=True)  # noqa: E731
    device = str(resolve_device(args.device))  # a clear error before any check runs
    # The thread count a run of this model would get (`run.threads = 0`): the checks judge that.
    with intra_op_threads(model_dir_threads(args.model, 0, args.dtype, args.numerics)):
        results = run_checks(args.model, args.numerics, args.dtype, seed=args.seed, progress=progress, device=device)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(report(results, args.model, args.numerics, args.dtype, seconds)))
    else:
        print_table(results, args.model, args.numerics, args.dtype, seconds)
    return 0 if all(r.passed for r in results) else 1
