"""What the reproduction scripts share: runs as `rzero train` processes with one thread each,
held-out evaluation with `rzero eval`, and the summary of a run's metrics.jsonl.

Collapse (docs/reproduction.md): the 200-step moving average of the reward falls below half of
its best value so far, once that best is at least 0.05.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WINDOW = 200
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def rzero(argv: list[str], log: Path | None = None) -> None:
    out = open(log, "w") if log else None
    subprocess.run([sys.executable, "-m", "rzero.cli", *argv], env=ONE_THREAD, check=True, stdout=out,
                   stderr=subprocess.STDOUT if out else None)


def train_argv(out: Path, config: str | None, overrides: list[str]) -> list[str]:
    return ["train", *([config] if config else []), "--out", str(out), *sum((["--set", o] for o in overrides), [])]


def run_parallel(runs: dict[str, list[str]], runs_dir: Path, parallel: int, after=None) -> None:
    """Run each `rzero` argv as its own one-thread process, `parallel` at a time; a run whose
    directory already holds `wall_s` is done and skipped. `after(name)` runs when one ends well
    (and for the runs done before; it must be idempotent)."""
    pending = [n for n in runs if not (runs_dir / n / "wall_s").is_file()]
    for name in runs:
        if name not in pending and after:
            after(name)  # done by an earlier call: `after` (an evaluation) may still be missing
    live: dict[str, tuple[subprocess.Popen, float]] = {}
    while pending or live:
        while pending and len(live) < parallel:
            name = pending.pop(0)
            log = open(runs_dir / f"{name}.log", "w")
            cmd = [sys.executable, "-m", "rzero.cli", *runs[name]]
            live[name] = (subprocess.Popen(cmd, env=ONE_THREAD, stdout=log, stderr=subprocess.STDOUT), time.time())
            print(f"started {name}", flush=True)
        time.sleep(2)
        for name, (proc, t0) in list(live.items()):
            if proc.poll() is None:
                continue
            del live[name]
            print(f"{name} finished (exit {proc.returncode}) in {time.time() - t0:.0f} s", flush=True)
            if proc.returncode == 0:
                (runs_dir / name / "wall_s").write_text(f"{time.time() - t0:.0f}\n")
                if after:
                    after(name)


def evaluate(model: Path, suite: Path, out: Path) -> None:
    if not (out / "results.json").is_file():
        rzero(["eval", "--model", str(model), "--suite", str(suite), "--out", str(out), "--dtype", "bf16"], log=out.with_suffix(".log"))


def final_model(run_dir: Path) -> Path:
    return (run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip() / "model").resolve()


def pass_at_1(results_dir: Path) -> float | None:
    path = results_dir / "results.json"
    if not path.is_file():
        return None
    benches = json.loads(path.read_text())["benchmarks"]
    return sum(b["metrics"]["pass@1"] for b in benches) / len(benches)


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def collapse_step(ma: list[float], start: int = 0) -> int | None:
    """First step where the moving average is below half its best so far, counting from `start`
    (the first full window: a partial window's average of a few steps is no baseline)."""
    best = 0.0
    for i, v in enumerate(ma[start:], start):
        best = max(best, v)
        if best >= 0.05 and v < 0.5 * best:
            return i
    return None


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize_run(run_dir: Path, window: int = WINDOW, limit: int | None = None) -> dict:
    """The run's figures over its first `limit` steps (all when None)."""
    rows = metrics(run_dir)[:limit]
    rewards = [m["reward/mean"] for m in rows]
    ma = moving_average(rewards, window)
    full = min(window, len(ma)) - 1  # the first step whose moving average covers a full window
    taken = [m for m in rows if not math.isnan(m["loss"])]
    wall = run_dir / "wall_s"
    return {
        "steps": len(rows),
        "wall_s": int(wall.read_text()) if wall.is_file() else None,
        "reward_first": sum(rewards[:window]) / len(rewards[:window]),
        "reward_last": sum(rewards[-window:]) / len(rewards[-window:]),
        "reward_ma_best": max(ma[full:]),
        "collapse_step": collapse_step(ma, full),
        "is_peak_over_median_max": max((m["is/peak_over_median"] for m in taken), default=None),
        "is_ess_min": min((m["is/ess"] for m in taken), default=None),
        "mismatch_kl_max": max((m["is/mismatch_kl"] for m in taken), default=None),
        "kernel_max_abs_max": max((m.get("mismatch/kernel_max_abs", float("nan")) for m in taken), default=None),
        "skipped_updates": int(rows[-1]["train/skipped_updates"]),
        "nan_losses": len(rows) - len(taken),
        "lag_mean": sum(m["lag/mean"] for m in taken) / max(len(taken), 1),
    }


def plot_curves(curves: dict[str, list[float]], every: int, path: Path, title: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, ys in curves.items():
        ax.plot([every * i for i in range(len(ys))], ys, label=name)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reward_curve(run_dir: Path, window: int, every: int, limit: int | None = None) -> list[float]:
    """The run's reward, as a `window`-step moving average, every `every` steps."""
    return moving_average([m["reward/mean"] for m in metrics(run_dir)[:limit]], window)[::every]


def write_results(claim: str, summary: dict, curves: dict[str, list[float]], every: int, title: str, window: int) -> None:
    """docs/reproduction_<claim>.json and docs/img/<claim>_reward.png."""
    (REPO / f"docs/reproduction_{claim}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_curves(curves, every, REPO / f"docs/img/{claim}_reward.png", title, f"reward ({window}-step moving average)")
    print(f"wrote docs/reproduction_{claim}.json and docs/img/{claim}_reward.png")
