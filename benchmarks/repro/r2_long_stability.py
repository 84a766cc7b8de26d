"""R2: plain unclipped IS stays stable for a long asynchronous run (docs/reproduction.md).

    python benchmarks/repro/r2_long_stability.py run --steps 20000 --control-steps 3000 --runs-dir RUNS
    python benchmarks/repro/r2_long_stability.py summarize --runs-dir RUNS

`run` trains, from one shared warm-started model, the claim and its controls at weight lag 8:

  invariant    reinforce_is, invariant numerics   (the claim; --steps)
  standard     reinforce_is, standard numerics    (kernel mismatch on top of the lag; --steps)
  on_policy    on_policy loss on the same stale data: no correction for the lag (--control-steps)
  ppo_clip     the clipped objective (--control-steps)

Each run is its own `rzero train` process with one thread, `--parallel` of them at a time (two on
the project's two cores), and is evaluated on held-out problems (`rzero eval`, greedy pass@1) at
its start and end. `summarize` reads the runs' metrics.jsonl and eval results and writes
docs/reproduction_r2.json (per-run summaries and the 200-step moving averages of the reward) and
the plot docs/img/r2_reward.png.

Collapse: the 200-step moving average of the reward falls below half of its best value after
that best was reached (best taken over the run so far, and only once it is at least 0.05).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from rzero.config import load_config
from rzero.run.loop import prepare_base_model

REPO = Path(__file__).resolve().parents[2]
TASK = [  # the task: two-digit sums and differences, not solved in the first thousand steps
    "env.name=arithmetic", "env.digits=2", 'env.operations=["+","-"]',
    "rollout.max_lag=8", "rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_tokens=5",
    "rollout.temperature=1.0",     "train.schedule=constant", "train.lr=0.0001", "run.tensorboard=false",
]
WARM_START_STEPS = 1000
RUNS = {  # name -> (overrides, uses --control-steps)
    "invariant": (["model.numerics=invariant", "train.loss=reinforce_is"], False),
    "standard": (["model.numerics=standard", "train.loss=reinforce_is"], False),
    "on_policy": (["model.numerics=invariant", "train.loss=on_policy"], True),
    "ppo_clip": (["model.numerics=invariant", "train.loss=ppo_clip"], True),
}
SUITE = REPO / "configs/eval/arithmetic_2digit.toml"
WINDOW = 200


def run_all(args) -> None:
    runs_dir: Path = args.runs_dir
    runs_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # The shared starting point: one model warm-started on the task.
    base = prepare_base_model(load_config(None, TASK + [f"warm_start.steps={WARM_START_STEPS}"]), runs_dir / "base")
    _evaluate(base, runs_dir / "eval-base", env)
    pending = [name for name in RUNS if name in args.only]
    live: dict[str, tuple[subprocess.Popen, float]] = {}
    while pending or live:
        while pending and len(live) < args.parallel:
            name = pending.pop(0)
            overrides, control = RUNS[name]
            steps = args.control_steps if control else args.steps
            every = max(1, steps // 4)
            cmd = [sys.executable, "-m", "rzero.cli", "train", "--out", str(runs_dir / name),
                   "--set", f'model.path="{base.resolve()}"', "--set", "warm_start.steps=0",
                   "--set", f"train.steps={steps}", "--set", f"run.checkpoint_every={every}",
                   *sum((["--set", o] for o in TASK + overrides), [])]
            log = open(runs_dir / f"{name}.log", "w")
            live[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), time.time())
            print(f"started {name}: {steps} steps", flush=True)
        time.sleep(5)
        for name, (proc, t0) in list(live.items()):
            if proc.poll() is not None:
                del live[name]
                (runs_dir / name / "wall_s").write_text(f"{time.time() - t0:.0f}\n")
                print(f"{name} finished (exit {proc.returncode}) in {time.time() - t0:.0f} s", flush=True)
                last = runs_dir / name / "checkpoints" / "latest"
                if proc.returncode == 0 and last.exists():
                    _evaluate(last.resolve() / "model", runs_dir / f"eval-{name}", env)


def _rzero(argv: list[str], env: dict) -> None:
    subprocess.run([sys.executable, "-m", "rzero.cli", *argv], env=env, check=True)


def _evaluate(model: Path, out: Path, env: dict) -> None:
    if not (out / "results.json").is_file():
        _rzero(["eval", "--model", str(model), "--suite", str(SUITE), "--out", str(out), "--dtype", "bf16"], env)


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def collapse_step(ma: list[float]) -> int | None:
    """The first step where the moving average is below half its best so far (best ≥ 0.05)."""
    best = 0.0
    for i, v in enumerate(ma):
        best = max(best, v)
        if best >= 0.05 and v < 0.5 * best:
            return i
    return None


def pass_at_1(path: Path) -> float | None:
    if not path.is_file():
        return None
    (bench,) = json.loads(path.read_text())["benchmarks"]
    return bench["metrics"]["pass@1"]


def summarize(args) -> None:
    runs_dir: Path = args.runs_dir
    base_pass = pass_at_1(runs_dir / "eval-base" / "results.json")
    summary, curves = {}, {}
    for name in RUNS:
        path = runs_dir / name / "metrics.jsonl"
        if not path.is_file():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rewards = [m["reward/mean"] for m in rows]
        ma = moving_average(rewards)
        taken = [m for m in rows if not math.isnan(m["loss"])]
        wall = runs_dir / name / "wall_s"
        summary[name] = {
            "steps": len(rows),
            "wall_s": int(wall.read_text()) if wall.is_file() else None,
            "reward_ma_first": ma[WINDOW - 1] if len(ma) >= WINDOW else None,
            "reward_ma_best": max(ma),
            "reward_ma_last": ma[-1],
            "collapse_step": collapse_step(ma),
            "is_peak_over_median_max": max((m["is/peak_over_median"] for m in taken), default=None),
            "is_ess_min": min((m["is/ess"] for m in taken), default=None),
            "mismatch_kl_max": max((m["is/mismatch_kl"] for m in taken), default=None),
            "kernel_max_abs_max": max((m["mismatch/kernel_max_abs"] for m in taken), default=None),
            "skipped_updates": sum(int(m["train/skipped_updates"]) for m in rows),
            "nan_losses": len(rows) - len(taken),
            "lag_mean": sum(m["lag/mean"] for m in rows) / len(rows),
            "pass_at_1_start": base_pass,
            "pass_at_1_end": pass_at_1(runs_dir / f"eval-{name}" / "results.json"),
        }
        curves[name] = ma[::50]
        print(name, json.dumps(summary[name]), flush=True)
    out = REPO / "docs/reproduction_r2.json"
    out.write_text(json.dumps({"task": TASK, "warm_start_steps": WARM_START_STEPS, "window": WINDOW,
                               "runs": summary, "reward_ma_every_50_steps": curves}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, ma in curves.items():
        ax.plot([50 * i for i in range(len(ma))], ma, label=name)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(f"reward ({WINDOW}-step moving average)")
    ax.set_title("R2: lag 8, two-digit sums and differences")
    ax.legend()
    fig.tight_layout()
    fig.savefig(REPO / "docs/img/r2_reward.png", dpi=110)
    print(f"wrote {out} and docs/img/r2_reward.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "summarize"])
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/r2"))
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--control-steps", type=int, default=3000)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    run_all(args) if args.action == "run" else summarize(args)


if __name__ == "__main__":
    main()
