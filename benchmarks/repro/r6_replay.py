"""R6: exact replay of asynchronous runs (docs/reproduction.md).

    python benchmarks/repro/r6_replay.py [--steps 30] [--runs-dir runs/r6] [--also RUN_DIR ...]

Trains the default job at weight lag 4 with long completions (max_tokens 24, so the trainer
publishes new weights while samples are in flight) under `invariant` numerics and, as the control,
under `standard` numerics; then replays each (`rzero train --replay`). Runs given with --also (e.g.
R4's tool-calling run at lag 64) are replayed too. For each it reports whether the replay is the
same run (every metric but the timings, and the final weights) or the step where it diverged, the
in-flight weight switches the record holds, the record's size per step, and the wall times.
Writes docs/reproduction_r6.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from common import REPO, metrics

from rzero.config import load_config
from rzero.run.loop import replay_run, train
from rzero.run.record import RECORD_FILE, ReplayDiverged, RolloutRecord


def replay_row(original: Path, out: Path, label: str) -> dict:
    entries = RolloutRecord(original).read()
    samples = [r for e in entries.values() for g in e["rollouts"] for r in g]
    shutil.rmtree(out, ignore_errors=True)  # this script's own earlier replay
    t0 = time.perf_counter()
    try:
        same, report = replay_run(original, out, progress=False, log=lambda *a: None)
        outcome = "identical" if same else report
    except ReplayDiverged as err:
        outcome = f"diverged at step {err.step}"
    replay_s = time.perf_counter() - t0
    row = {
        "run": label,
        "steps": len(entries),
        "lag_max": max(m["lag/max"] for m in metrics(original)),
        "samples_with_in_flight_switch": sum(len(set(r["versions"])) > 1 for r in samples),
        "samples": len(samples),
        "record_bytes_per_step": round((original / RECORD_FILE).stat().st_size / len(entries)),
        "replay_s": round(replay_s, 1),
        "outcome": outcome,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/r6"))
    parser.add_argument("--also", type=Path, nargs="*", default=[])
    parser.add_argument("--skip-own", action="store_true", help="replay only the --also runs")
    args = parser.parse_args()
    rows = []
    for numerics in () if args.skip_own else ("invariant", "standard"):
        original = args.runs_dir / numerics
        if not (original / "metrics.jsonl").is_file():
            config = load_config(None, [f"model.numerics={numerics}", "rollout.max_lag=4", "rollout.max_tokens=24",
                                        f"train.steps={args.steps}", f"run.checkpoint_every={args.steps}",
                                        "run.tensorboard=false"])
            t0 = time.perf_counter()
            train(config, original, progress=False, log=lambda *a: None)
            (original / "wall_s").write_text(f"{time.perf_counter() - t0:.0f}\n")
        row = replay_row(original, args.runs_dir / f"{numerics}-replay", f"default job, lag 4, {numerics}")
        rows.append({**row, "original_s": int((original / "wall_s").read_text())})
    for run in args.also:
        wall = run / "wall_s"
        rows.append({**replay_row(run, args.runs_dir / f"{run.name}-replay", str(run)),
                     "original_s": int(wall.read_text()) if wall.is_file() else None})
    out = REPO / "docs/reproduction_r6.json"
    if args.skip_own and out.is_file():  # keep the rows of the script's own runs from before
        labels = {r["run"] for r in rows}
        rows = [r for r in json.loads(out.read_text()) if r["run"] not in labels] + rows
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print("wrote docs/reproduction_r6.json")


if __name__ == "__main__":
    main()
