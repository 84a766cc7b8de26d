"""R4: tool calling learns at weight lag 64 (docs/reproduction.md).

    python benchmarks/repro/r4_tool_calling.py [--runs-dir runs/r4] [--steps 200]

Trains configs/tool_calc_lag64.toml (async, max_lag 64) and its control configs/tool_calc_sync.toml
(max_lag 0) from one shared warm-started model, side by side as one-thread processes (both wait
mostly on the slow calculator), evaluates the start and both ends on held-out problems
(configs/eval/tool_calc.toml), and writes docs/reproduction_r4.json and docs/img/r4_reward.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import REPO, evaluate, final_model, pass_at_1, reward_curve, run_parallel, summarize_run, train_argv, write_results

from rzero.config import load_config
from rzero.run.loop import prepare_base_model

RUNS = {"lag64": "configs/tool_calc_lag64.toml", "sync": "configs/tool_calc_sync.toml"}
SUITE = REPO / "configs/eval/tool_calc.toml"
WINDOW = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/r4"))
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    runs_dir = args.runs_dir
    runs_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    # Both configs warm-start the same way; one shared model makes the start identical.
    base = prepare_base_model(load_config(REPO / RUNS["lag64"]), runs_dir / "base")
    evaluate(base, SUITE, runs_dir / "eval-base")
    runs = {name: train_argv(runs_dir / name, str(REPO / config),
                             [f'model.path="{base.resolve()}"', "warm_start.steps=0", f"train.steps={args.steps}",
                              "run.tensorboard=false", f"run.checkpoint_every={args.steps}"])
            for name, config in RUNS.items()}
    run_parallel(runs, runs_dir, parallel=2,
                 after=lambda name: evaluate(final_model(runs_dir / name), SUITE, runs_dir / f"eval-{name}"))
    summary = {"base_pass_at_1": pass_at_1(runs_dir / "eval-base"), "runs": {}}
    curves = {}
    for name in RUNS:
        summary["runs"][name] = {**summarize_run(runs_dir / name, WINDOW),
                                 "pass_at_1_end": pass_at_1(runs_dir / f"eval-{name}")}
        curves[name] = reward_curve(runs_dir / name, WINDOW, 1)
        print(name, json.dumps(summary["runs"][name]), flush=True)
    write_results("r4", summary, curves, 1, "R4: tool_calc, lag 64 vs synchronous", WINDOW)


if __name__ == "__main__":
    main()
