"""R1: kernel mismatch alone inflates the IS tails (docs/reproduction.md).

    python benchmarks/repro/r1_kernel_mismatch.py [--steps 30] [--out docs/reproduction_r1.json]

Synchronous runs (max_lag 0: no weight lag at all, so every deviation of w from 1 is kernel
mismatch) of the default task for tiny-dense and tiny-moe, in bf16 and fp32, with `invariant`
numerics and with `standard` numerics (the control), plus the common-stack control: the trainer
scores in fp32 while the engines sample in bf16 (`rollout.engine_dtype`). Every run of a preset
starts from the same warm-started model and trains the same steps. Per run it reports the worst
step's IS peak/median, the lowest ESS, the largest mismatch KL and the largest |kernel part of
log w| (`mismatch/kernel_max_abs`), and writes them as JSON and as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rzero.config import load_config
from rzero.run.loop import prepare_base_model, train

CASES = [  # (label, model.dtype, rollout.engine_dtype, numerics)
    ("bf16", "bf16", "", "invariant"),
    ("bf16", "bf16", "", "standard"),
    ("fp32", "fp32", "", "invariant"),
    ("fp32", "fp32", "", "standard"),
    ("trainer fp32, engine bf16", "fp32", "bf16", "invariant"),
    ("trainer fp32, engine bf16", "fp32", "bf16", "standard"),
]


def summarize(rows: list[dict]) -> dict:
    taken = [m for m in rows if "is/peak_over_median" in m]  # steps whose update was taken
    return {
        "steps": len(rows),
        "is_peak_over_median_max": max(m["is/peak_over_median"] for m in taken),
        "is_ess_min": min(m["is/ess"] for m in taken),
        "mismatch_kl_max": max(m["is/mismatch_kl"] for m in taken),
        "kernel_max_abs_max": max(m["mismatch/kernel_max_abs"] for m in taken),
        "reward_first5": sum(m["reward/mean"] for m in rows[:5]) / 5,
        "reward_last5": sum(m["reward/mean"] for m in rows[-5:]) / 5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-start-steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("docs/reproduction_r1.json"))
    args = parser.parse_args()
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for preset in ("tiny-dense", "tiny-moe"):
            base_config = load_config(None, [f"model.preset={preset}", f"warm_start.steps={args.warm_start_steps}"])
            base = prepare_base_model(base_config, tmp / f"base-{preset}", log=lambda *a: None)
            for label, dtype, engine_dtype, numerics in CASES:
                overrides = [f'model.path="{base}"', f"model.dtype={dtype}", f"rollout.engine_dtype={engine_dtype}",
                             f"model.numerics={numerics}", "rollout.max_lag=0", "warm_start.steps=0",
                             f"train.steps={args.steps}", "run.tensorboard=false", f"run.checkpoint_every={args.steps}"]
                out = tmp / f"{preset}-{dtype}-{engine_dtype or dtype}-{numerics}"
                t0 = time.perf_counter()
                train(load_config(None, overrides), out, progress=False, log=lambda *a: None)
                rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                row = {"preset": preset, "setup": label, "numerics": numerics, **summarize(rows),
                       "seconds": round(time.perf_counter() - t0, 1)}
                results.append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"steps": args.steps, "wall_s": round(time.perf_counter() - start), "runs": results}, indent=1) + "\n")
    print("\n| model | setup | numerics | max IS peak/median | min ESS | max mismatch KL | max \\|kernel part of log w\\| |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['preset']} | {r['setup']} | {r['numerics']} | {r['is_peak_over_median_max']:.4g} | {r['is_ess_min']:.6f} | "
              f"{r['mismatch_kl_max']:.3g} | {r['kernel_max_abs_max']:.3g} |")


if __name__ == "__main__":
    main()
