"""Sync vs async wall time for the same number of trained samples, with slow environment steps.

Until the tool-calling workload exists, slowness is an artificial per-rollout delay
(`env.rollout_delay_s`, slept in the environment thread after a group finishes generating).
Both modes train the same number of steps on the same groups-per-step; runs are interleaved and
the ratio is printed from medians.

    python benchmarks/bench_async.py [--delay 0.5] [--steps 12] [--max-lag 4] [--reps 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rzero.config import load_config
from rzero.model.presets import init_model
from rzero.train.run import train


def run_once(model_dir: Path, out: Path, mode: str, max_lag: int, args) -> float:
    config = load_config(
        None,
        [
            f'model.path="{model_dir}"',
            "warm_start.steps=0",
            f"rollout.mode={mode}",
            f"rollout.max_lag={max_lag}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}",
            "rollout.max_tokens=8",
            f"env.rollout_delay_s={args.delay}",
            f"train.steps={args.steps}",
            "run.tensorboard=false",
            f"run.checkpoint_every={args.steps}",
        ],
    )
    start = time.perf_counter()
    train(config, out, progress=False, log=lambda *a: None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay", type=float, default=0.5, help="seconds of environment latency per rollout group")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-lag", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = init_model("tiny-dense", tmp / "model")
        times: dict[str, list[float]] = {"sync": [], "async": []}
        for rep in range(args.reps):  # interleaved: the machine is noisy
            times["sync"].append(run_once(model_dir, tmp / f"sync{rep}", "sync", 0, args))
            times["async"].append(run_once(model_dir, tmp / f"async{rep}", "async", args.max_lag, args))
    sync, asyn = statistics.median(times["sync"]), statistics.median(times["async"])
    samples = args.steps * args.prompts * args.group
    print(f"same work: {args.steps} steps x {args.prompts} prompts x {args.group} samples = {samples} trained samples")
    print(f"per-rollout-group delay {args.delay}s, async max_lag {args.max_lag}")
    print(f"sync  wall time: {sync:7.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times['sync'])})")
    print(f"async wall time: {asyn:7.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times['async'])})")
    print(f"async speed-up (sync / async): {sync / asyn:.2f}x   (target >= 3x)")


if __name__ == "__main__":
    main()
