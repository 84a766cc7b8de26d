"""`rzero report RUN_DIR`: PNG plots of a run's metrics and a short Markdown summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

PLOTS = [
    ("reward", ["reward/mean"], "reward"),
    ("is_peak_over_median", ["is/peak_over_median"], "IS peak / median"),
    ("ess", ["is/ess"], "IS effective sample size"),
    ("lag", ["lag/mean", "lag/max"], "weight lag (versions)"),
    ("decomposition", ["mismatch/kernel_max_abs", "mismatch/lag_max_abs"], "max |log-ratio part|"),
    ("turns", ["rollout/turns_mean"], "model turns per episode"),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: metrics.jsonl has no steps yet")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    steps = [r["step"] for r in rows]
    images = []
    for name, keys, title in PLOTS:
        present = [k for k in keys if any(k in r for r in rows)]
        if not present or (name == "turns" and all(r.get("rollout/turns_mean", 1) <= 1 for r in rows)):
            continue  # single-turn runs: nothing to plot
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for k in present:
            ax.plot(steps, [r.get(k, math.nan) for r in rows], label=k)
        ax.set_xlabel("trainer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        images.append(name)

    def window(key: str, part: slice) -> float:
        vals = [r[key] for r in rows[part] if key in r and r[key] == r[key]]
        return sum(vals) / len(vals) if vals else math.nan

    n = max(1, min(5, len(rows) // 4 or 1))
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"- steps: {len(rows)} (last step {steps[-1]})",
        f"- reward: {window('reward/mean', slice(0, n)):.3f} (first {n} steps) -> "
        f"{window('reward/mean', slice(-n, None)):.3f} (last {n} steps)",
        f"- IS peak/median: max {max(r.get('is/peak_over_median', math.nan) for r in rows):.4g}",
        f"- ESS: min {min(r.get('is/ess', math.nan) for r in rows):.4g}",
        f"- lag: mean {window('lag/mean', slice(None)):.2f}, max {max(r.get('lag/max', 0) for r in rows):.0f}",
    ]
    if any("mismatch/kernel_max_abs" in r for r in rows):
        kernel = max(r.get("mismatch/kernel_max_abs", 0.0) for r in rows)
        lines.append(f"- kernel-mismatch part of log w: max |.| over the run = {kernel!r}")
    longest = int(max(r.get("train/consecutive_skips", 0) for r in rows))
    lines.append(f"- skipped updates: {int(rows[-1].get('train/skipped_updates', 0))} (longest run in a row: {longest})")
    lines.append(f"- total time: {sum(r.get('time/step', 0) for r in rows):.1f} s")
    lines.append("")
    lines.extend(f"![{name}]({name}.png)" for name in images)
    summary = out / "summary.md"
    summary.write_text("\n".join(lines) + "\n")
    return summary
