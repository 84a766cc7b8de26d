"""Record, or compare against a record, everything a refactor must leave bit-for-bit unchanged.

    python benchmarks/behaviour_snapshot.py record benchmarks/baselines/behaviour.json
    python benchmarks/behaviour_snapshot.py compare benchmarks/baselines/behaviour.json

It runs, through the `rzero` command line (so it works on any version of the code):

- `rzero train configs/sync.toml --steps 20`: every metrics.jsonl row, timing fields removed;
- `rzero check --json` for tiny-dense and tiny-moe, fp32 and bf16, invariant and standard numerics:
  every field of every check except the timings.

`compare` exits 1 and prints each difference when the fresh record is not identical. The numbers
are only comparable on the same kind of CPU (the GEMM kernels decide the bits; docs/numerics.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Wall-clock fields, and the queue counts a stats read sees right after a publish: those depend on
# whether a worker process has already taken the next groups.
TIMING_KEYS = {"seconds", "tokens/s", "rollout/queued_groups", "rollout/in_flight_groups"}


def _rzero(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, "-m", "rzero.cli", *args], env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # `rzero check` exits 1 when a check fails (standard numerics)
        raise RuntimeError(f"rzero {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_KEYS and not k.startswith("time/")}


def record(work: Path) -> dict:
    run_dir = work / "sync_run"
    _rzero("train", str(REPO / "configs" / "sync.toml"), "--steps", "20", "--out", str(run_dir), "--set", "run.tensorboard=false")
    rows = [_untimed(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checks = {}
    for preset in ("tiny-dense", "tiny-moe"):
        model_dir = work / preset
        _rzero("init-model", "--preset", preset, "--out", str(model_dir))
        for dtype in ("fp32", "bf16"):
            for numerics in ("invariant", "standard"):
                out = json.loads(_rzero("check", "--model", str(model_dir), "--dtype", dtype, "--numerics", numerics, "--json"))
                out.pop("model")  # a temporary path
                crashed = [c["id"] for c in out["checks"] if c["max_abs_diff"] is None]
                if crashed:
                    raise RuntimeError(f"{preset} {dtype} {numerics}: checks {crashed} crashed: {out['checks']}")
                out = _untimed(out)
                out["checks"] = [_untimed(c) for c in out["checks"]]
                checks[f"{preset}/{dtype}/{numerics}"] = out
                print(f"  {preset} {dtype} {numerics}: passed={out['passed']}", file=sys.stderr)
    return {"train_sync_20": rows, "check": checks}


def differences(old, new, where: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            if key not in old or key not in new:
                out.append(f"{where}/{key}: only in {'new' if key in new else 'old'}")
            else:
                out += differences(old[key], new[key], f"{where}/{key}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{where}: {len(old)} items before, {len(new)} now"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["record", "compare"])
    parser.add_argument("file", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        fresh = record(Path(work))
    if args.action == "record":
        args.file.parent.mkdir(parents=True, exist_ok=True)
        args.file.write_text(json.dumps(fresh, indent=1) + "\n")
        print(f"wrote {args.file}")
        return 0
    diffs = differences(json.loads(args.file.read_text()), fresh)
    for d in diffs:
        print(d)
    print(f"{len(diffs)} differences" if diffs else "identical (all fields but timings)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
