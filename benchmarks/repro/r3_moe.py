"""R3: a mixture-of-experts model learns with async RL (docs/reproduction.md).

    python benchmarks/repro/r3_moe.py [--runs-dir runs/r3] [--parallel 2] [--tasks default r2task]

On two tasks, each from a model warm-started on it:
  default   the embedded default job (one-digit sums, lag 2, 400 steps)
  r2task    R2's task (two-digit sums and differences, lag 8, lr 1e-4, 1000 steps)
it trains tiny-moe with invariant numerics (the claim), tiny-dense with the same budget, and tiny-moe
with standard numerics (where a flipped routing choice is kernel mismatch IS cannot correct);
each is evaluated greedily (pass@1) before and after, and docs/reproduction_r3.json and
docs/img/r3_reward.png are written. The one-digit task has only 100 distinct problems, so its
"held-out" suite is the training distribution itself; R2's task has 20,000 and its suite is
held out (another seed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import REPO, evaluate, final_model, pass_at_1, reward_curve, run_parallel, summarize_run, train_argv, write_results

from rzero.config import load_config
from rzero.run.loop import prepare_base_model

TASKS = {  # name -> (overrides, eval suite, RL steps)
    "default": ([], REPO / "configs/eval/arithmetic_1digit.toml", 400),
    "r2task": (["env.digits=2", 'env.operations=["+","-"]', "rollout.max_lag=8", "rollout.prompts_per_step=4",
                "rollout.max_tokens=5", "rollout.temperature=1.0", "train.schedule=constant", "train.lr=0.0001",
                "warm_start.steps=1000"], REPO / "configs/eval/arithmetic_2digit.toml", 1000),
}
MODELS = {  # name -> (preset, numerics)
    "moe-invariant": ("tiny-moe", "invariant"),
    "dense-invariant": ("tiny-dense", "invariant"),
    "moe-standard": ("tiny-moe", "standard"),
}
WINDOW = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/r3"))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    args = parser.parse_args()
    runs_dir = args.runs_dir
    runs_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    runs, suites = {}, {}
    for task in args.tasks:
        overrides, suite, steps = TASKS[task]
        for preset in ("tiny-moe", "tiny-dense"):
            base = prepare_base_model(load_config(None, [f"model.preset={preset}", *overrides]), runs_dir / f"base-{task}-{preset}")
            evaluate(base, suite, runs_dir / f"eval-base-{task}-{preset}")
            for name, (model_preset, numerics) in MODELS.items():
                if model_preset == preset:
                    runs[f"{task}-{name}"] = train_argv(
                        runs_dir / f"{task}-{name}", None,
                        [*overrides, f'model.path="{base.resolve()}"', "warm_start.steps=0", f"model.numerics={numerics}",
                         f"train.steps={steps}", "run.tensorboard=false", f"run.checkpoint_every={steps}"])
                    suites[f"{task}-{name}"] = suite
    run_parallel(runs, runs_dir, args.parallel,
                 after=lambda name: evaluate(final_model(runs_dir / name), suites[name], runs_dir / f"eval-{name}"))
    summary, curves = {}, {}
    for name in runs:
        task, model = name.split("-", 1)
        preset = MODELS[model][0]
        summary[name] = {**summarize_run(runs_dir / name, WINDOW),
                         "pass_at_1_start": pass_at_1(runs_dir / f"eval-base-{task}-{preset}"),
                         "pass_at_1_end": pass_at_1(runs_dir / f"eval-{name}")}
        curves[name] = reward_curve(runs_dir / name, WINDOW, 10)
        print(name, json.dumps(summary[name]), flush=True)
    write_results("r3", summary, curves, 10, "R3: tiny-moe vs tiny-dense, invariant vs standard", WINDOW)


if __name__ == "__main__":
    main()
