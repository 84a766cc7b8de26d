"""Ray vs local step time at equal worker count, and async vs sync on Ray, in one run.

    python benchmarks/bench_distributed.py [--steps 20] [--reps 1] [--workloads default,tool_calc]
    python benchmarks/bench_distributed.py --memory-steps 200     # peak RSS of driver and actors

For each workload (the default job; tool_calc_lag64, whose calculator has a log-normal latency with
a 1 s median) it trains the same steps from the same warm-started model with `rollout.backend =
local` and `= ray` (same `rollout.workers`), interleaved, and prints the median step time of each
and their ratio (target: Ray overhead <= 1.15x). Then, on Ray, the slow-tool workload's async run
against its synchronous twin (max_lag 0; target >= 3x, as local). Steps are timed from the
metrics (`time/step`), skipping the first steps (actor start-up, first weight load).

`--memory-steps N` instead runs configs/ray.toml (2 rollout actors, 2 trainer ranks) for N steps
and samples the resident memory of the driver and of every actor process once a second (Linux
/proc), printing each process kind's RSS at 10 %, 50 % and 100 % of the run and its peak: flat
memory means back-pressure holds (actors never keep more than max_lag + 1 steps of groups).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rzero.config import load_config
from rzero.run.loop import prepare_base_model, train

WORKLOADS = {
    "default": ("configs/default.toml", ["rollout.workers=2"]),
    "tool_calc": ("configs/tool_calc_lag64.toml", ["rollout.workers=2"]),
}


def run(config_path: str, base: Path, out: Path, overrides: list[str], steps: int) -> tuple[float, list[dict]]:
    overrides = [*overrides, f'model.path="{base}"', "warm_start.steps=0", f"train.steps={steps}",
                 "run.tensorboard=false", f"run.checkpoint_every={steps}"]
    start = time.perf_counter()
    train(load_config(config_path, overrides), out, progress=False, log=lambda *a: None)
    wall = time.perf_counter() - start
    return wall, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_time(rows: list[dict], skip: int) -> float:
    return statistics.median(r["time/step"] for r in rows[skip:])


def rss_by_kind() -> dict[str, float]:
    """MiB resident, summed per process kind: the driver, and Ray actors by their process title."""
    out = {"driver": _rss_mib(os.getpid())}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        for kind in ("RolloutWorker", "RankActor"):
            if title.startswith(f"ray::{kind}"):
                out[kind] = out.get(kind, 0.0) + _rss_mib(int(pid))
    return out


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def memory(steps: int) -> None:
    samples: list[tuple[float, dict[str, float]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            samples.append((time.perf_counter(), rss_by_kind()))

    with tempfile.TemporaryDirectory() as tmp:
        sampler = threading.Thread(target=sample, daemon=True)
        start = time.perf_counter()
        sampler.start()
        train(load_config("configs/ray.toml", [f"train.steps={steps}", "run.tensorboard=false"]), Path(tmp) / "run",
              progress=False, log=lambda *a: None)
        done.set()
        sampler.join()
    wall = time.perf_counter() - start
    print(f"configs/ray.toml, {steps} steps, {wall:.0f} s; resident memory (MiB) sampled every second")
    kinds = sorted({k for _, s in samples for k in s})
    for kind in kinds:
        series = [s.get(kind, 0.0) for _, s in samples if s.get(kind)]
        at = lambda f: series[min(len(series) - 1, int(f * len(series)))]  # noqa: E731
        print(f"  {kind:13s} at 10% {at(0.1):7.0f}   50% {at(0.5):7.0f}   100% {series[-1]:7.0f}   peak {max(series):7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the step time")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--workloads", default="default,tool_calc")
    parser.add_argument("--memory-steps", type=int, help="measure memory over a run of this many steps instead")
    args = parser.parse_args()
    if args.memory_steps:
        memory(args.memory_steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.workloads.split(","):
            path, extra = WORKLOADS[name]
            base = prepare_base_model(load_config(path, extra), tmp / f"base-{name}", log=lambda *a: None)
            cases = {"local": [*extra, "rollout.backend=local"], "ray": [*extra, "rollout.backend=ray"]}
            if name == "tool_calc":
                cases["ray sync"] = [*extra, "rollout.backend=ray", "rollout.max_lag=0", "rollout.weight_update_interval=1"]
            times: dict[str, list[float]] = {c: [] for c in cases}
            walls: dict[str, list[float]] = {c: [] for c in cases}
            parts: dict[str, tuple[float, float]] = {}
            for rep in range(args.reps):  # interleaved: the machine is noisy
                for case, overrides in cases.items():
                    wall, rows = run(path, base, tmp / f"{name}-{case.replace(' ', '_')}-{rep}", overrides, args.steps)
                    times[case].append(step_time(rows, args.skip))
                    walls[case].append(wall)
                    parts[case] = tuple(statistics.median(r[k] for r in rows[args.skip:]) for k in ("time/train", "time/wait_rollouts"))
            print(f"\n{name} ({path} {' '.join(extra)}; {args.steps} steps, step time = median time/step after {args.skip})")
            for case in cases:
                train_s, wait_s = parts[case]
                print(f"  {case:9s} step {statistics.median(times[case]):6.3f} s (train {train_s:.3f}, waiting for "
                      f"rollouts {wait_s:.3f})   wall {statistics.median(walls[case]):6.1f} s")
            ratio = statistics.median(times["ray"]) / statistics.median(times["local"])
            print(f"  Ray / local step time: {ratio:.2f}x   (target <= 1.15x)")
            if "ray sync" in cases:
                speedup = statistics.median(walls["ray sync"]) / statistics.median(walls["ray"])
                print(f"  Ray async speed-up (sync / async wall time): {speedup:.2f}x   (target >= 3x)")


if __name__ == "__main__":
    main()
