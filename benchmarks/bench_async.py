"""Async vs sync wall time for the same work on a slow-tool workload.

Both modes start from the same warm-started model and train the same number of steps with the
same prompts and samples per step; only `rollout.max_lag` and `rollout.weight_update_interval`
differ (sync: max_lag 0, weights loaded every step, so every step waits for its own rollouts and
their slowest tool call; async: the config's values). Runs are interleaved and the ratio is
printed from medians.

    python benchmarks/bench_async.py [--config configs/tool_calc_lag64.toml] [--steps 40] [--reps 1]
                                     [--set KEY=VALUE ...]

The default config is tool_calc with log-normal calculator latency (median 1 s) at max_lag 64.
An artificial per-rollout delay on the arithmetic task works too:
`--config configs/default.toml --set env.rollout_delay_s=0.5 --set rollout.max_lag=4`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from rzero.config import load_config
from rzero.run.loop import prepare_base_model, train


def run_once(base: Path, out: Path, mode: str, args) -> tuple[float, list[dict]]:
    overrides = [*args.set, f'model.path="{base}"', "warm_start.steps=0", f"train.steps={args.steps}",
                 "run.tensorboard=false", f"run.checkpoint_every={args.steps}"]
    if mode == "sync":  # the synchronous twin: no lag, weights loaded every step
        overrides += ["rollout.max_lag=0", "rollout.weight_update_interval=1"]
    config = load_config(args.config, overrides)
    start = time.perf_counter()
    train(config, out, progress=False, log=lambda *a: None)
    elapsed = time.perf_counter() - start
    return elapsed, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tool_calc_lag64.toml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for both modes")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = prepare_base_model(config, tmp / "base", log=lambda *a: None)  # warm start once, shared
        times: dict[str, list[float]] = {"sync": [], "async": []}
        last: dict[str, list[dict]] = {}
        for rep in range(args.reps):  # interleaved: the machine is noisy
            for mode in ("sync", "async"):
                elapsed, last[mode] = run_once(base, tmp / f"{mode}{rep}", mode, args)
                times[mode].append(elapsed)
    r = config.rollout
    print(f"config {args.config} {' '.join(args.set)}")
    print(f"same work: {args.steps} steps x {r.prompts_per_step} prompts x {r.group_size} samples "
          f"= {args.steps * r.prompts_per_step * r.group_size} trained episodes per mode")
    for mode in ("sync", "async"):
        rows = last[mode]
        print(f"{mode:5s} wall time: {statistics.median(times[mode]):7.1f} s   "
              f"(runs: {', '.join(f'{t:.1f}' for t in times[mode])}; reward first/last 5 steps "
              f"{statistics.mean(m['reward/mean'] for m in rows[:5]):.3f} -> "
              f"{statistics.mean(m['reward/mean'] for m in rows[-5:]):.3f}; "
              f"lag mean {statistics.mean(m['lag/mean'] for m in rows):.1f}, max {max(m['lag/max'] for m in rows):.0f})")
    ratio = statistics.median(times["sync"]) / statistics.median(times["async"])
    print(f"async speed-up (sync / async wall time): {ratio:.2f}x   (target >= 3x)")


if __name__ == "__main__":
    main()
