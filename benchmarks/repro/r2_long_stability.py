"""R2: plain unclipped IS stays stable for a long asynchronous run (docs/reproduction.md).

    python benchmarks/repro/r2_long_stability.py run --steps 20000 --control-steps 3000 [--runs-dir runs/r2]
    python benchmarks/repro/r2_long_stability.py summarize [--runs-dir runs/r2] [--max-steps N]

`run` trains, from one shared warm-started model, the claim and its controls at weight lag 8:

  invariant       reinforce_is, invariant numerics   (the claim; --steps)
  invariant_lag2  the same at weight lag 2           (the claim at the seed's other lag; --steps)
  standard        reinforce_is, standard numerics    (kernel mismatch on top of the lag; --steps)
  on_policy       on_policy loss on the same stale data: no correction for the lag (--control-steps)
  ppo_clip        the clipped objective (--control-steps)

Each run is its own `rzero train` process with one thread, `--parallel` of them at a time (two on
the project's two cores), and is evaluated on held-out problems (greedy pass@1) at its start and
end. `summarize` writes docs/reproduction_r2.json and docs/img/r2_reward.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import (REPO, WINDOW, evaluate, final_model, pass_at_1, reward_curve, run_parallel, summarize_run, train_argv,
                    write_results)

from rzero.config import load_config
from rzero.run.loop import prepare_base_model

TASK = [  # two-digit sums and differences: not solved in the first thousand steps
    "env.name=arithmetic", "env.digits=2", 'env.operations=["+","-"]',
    "rollout.max_lag=8", "rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_tokens=5",
    "rollout.temperature=1.0", "train.schedule=constant", "train.lr=0.0001", "run.tensorboard=false",
]
WARM_START_STEPS = 1000
RUNS = {  # name -> (overrides, uses --control-steps)
    "invariant": (["model.numerics=invariant", "train.loss=reinforce_is"], False),
    "standard": (["model.numerics=standard", "train.loss=reinforce_is"], False),
    "on_policy": (["model.numerics=invariant", "train.loss=on_policy"], True),
    "ppo_clip": (["model.numerics=invariant", "train.loss=ppo_clip"], True),
    "invariant_lag2": (["model.numerics=invariant", "train.loss=reinforce_is", "rollout.max_lag=2"], False),
}
SUITE = REPO / "configs/eval/arithmetic_2digit.toml"


def run_all(args) -> None:
    runs_dir: Path = args.runs_dir
    runs_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    base = prepare_base_model(load_config(None, TASK + [f"warm_start.steps={WARM_START_STEPS}"]), runs_dir / "base")
    evaluate(base, SUITE, runs_dir / "eval-base")
    runs = {}
    for name in args.only:
        overrides, control = RUNS[name]
        steps = args.control_steps if control else args.steps
        runs[name] = train_argv(runs_dir / name, None, [
            *TASK, *overrides, f'model.path="{base.resolve()}"', "warm_start.steps=0", f"train.steps={steps}",
            f"run.checkpoint_every={max(1, steps // 4)}"])
    run_parallel(runs, runs_dir, args.parallel,
                 after=lambda name: evaluate(final_model(runs_dir / name), SUITE, runs_dir / f"eval-{name}"))


def summarize(args) -> None:
    runs_dir: Path = args.runs_dir
    summary, curves = {}, {}
    for name in RUNS:
        if (runs_dir / name / "metrics.jsonl").is_file():
            summary[name] = {**summarize_run(runs_dir / name, limit=args.max_steps),
                             "pass_at_1_start": pass_at_1(runs_dir / "eval-base"),
                             "pass_at_1_end": pass_at_1(runs_dir / f"eval-{name}"),
                             "pass_at_1_end_model": (runs_dir / name / "checkpoints" / "latest").read_text().strip()}
            curves[name] = reward_curve(runs_dir / name, WINDOW, 50, args.max_steps)
            print(name, json.dumps(summary[name]), flush=True)
    write_results("r2", {"task": TASK, "warm_start_steps": WARM_START_STEPS, "window": WINDOW, "runs": summary,
                         "reward_ma_every_50_steps": curves}, curves, 50, "R2: two-digit sums and differences, lag 8 (and lag 2)", WINDOW)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "summarize"])
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/r2"))
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--control-steps", type=int, default=3000)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--max-steps", type=int, help="summarize: only the first N steps of each run")
    parser.add_argument("--only", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    run_all(args) if args.action == "run" else summarize(args)


if __name__ == "__main__":
    main()
