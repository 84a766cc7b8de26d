"""RL step throughput: rzero vs TRL's GRPOTrainer, same tiny model and batch, CPU (target >= 5x:
docs/benchmarks.md).

    pip install -e '.[bench]'          # trl (+ datasets, accelerate); keeps torch==2.13.0
    python benchmarks/bench_trl.py [--prompts 8] [--group 8] [--steps 12] [--skip 2] [--rounds 2]
                                   [--threads N] [--numerics invariant] [--contenders rzero-sync,rzero-async,trl]

Workload, identical for every contender: the tiny-dense preset (`rzero.model.presets.init_model`,
random init, no warm start), written once to a temp HF-format dir that both load (offline), fp32
weights and compute; P prompts per step (1-digit `a+b=` prompts of ArithmeticEnv(digits=1), as
plain text, no chat template), G samples per prompt, at most `--max-tokens` (8) new tokens,
temperature 1.0 (no top-k / top-p), the exact-answer arithmetic reward (a plain Python function
for TRL), lr 6e-4 constant, grad-norm clip 1.0, one optimizer step per batch of P*G completions.

Contenders (each run in its own subprocess, same cores: T torch threads, `--threads`):
  rzero-sync   rzero.run.loop.train, rollout.max_lag = 0 (generate with version s, then train);
               its rollout worker process and its trainer take turns, T threads each
  rzero-async  the same with rollout.max_lag = 2 (generation overlaps training); worker and
               trainer run at once and get max(1, T // 2) threads each (at T = 1: two cores)
  trl          trl.GRPOTrainer, GRPOConfig(per_device_train_batch_size=P*G, num_generations=G,
               gradient_accumulation_steps=1, beta=0 (no reference model), use_cpu, fp32),
               generation with transformers `generate` (TRL's default, no vLLM)

Timing: wall time between consecutive step ends (rzero: metrics.jsonl writes, hooked in-process;
TRL: TrainerCallback.on_step_end), so each interval is one full RL step (generate + reward +
score + backward + optimizer + weight publish / logging). The first `--skip` steps of each run are
warm-up and dropped; the number is the median over all kept steps of all rounds. rzero's own
`time/step` metric is reported beside it as a cross-check. Rounds interleave the contenders and
reverse their order every other round, so drifts in machine load hit all alike. Still, on a
shared 2-core box another busy process inflates TRL's steps far more than rzero's (TRL's many small
multi-threaded ops stall when a core is taken; seen: 0.18 s/step quiet, 1-5 s/step beside a pytest
run), which would flatter the ratio: run it on a quiet machine, and cross-check with `--threads 1`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTENDERS = ("rzero-sync", "rzero-async", "trl")
LR = 6e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G, TRL num_generations)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (N)")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps dropped from each run")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every contender")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, every contender")
    p.add_argument("--numerics", choices=("invariant", "standard"), default="invariant", help="rzero numerics")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--model", default=None, help="HF model dir (default: build tiny-dense in a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    # internal: one contender in this process, results as JSON to --json-out
    p.add_argument("--worker", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------- workers


def run_rzero(args, max_lag: int) -> dict:
    import torch

    # rzero's rollout worker is a process of its own: in sync mode it and the trainer take turns,
    # so each may use all T threads; in async mode they run at once, so they share the T cores
    # (at T = 1 each still gets one thread: async then uses two cores where TRL uses one).
    threads = args.threads if max_lag == 0 else max(1, args.threads // 2)
    torch.set_num_threads(threads)
    import rzero.run.loop as run_mod
    from rzero.config import RunConfig
    from rzero.run.metrics_log import MetricsLog

    config = RunConfig.model_validate(
        {
            "model": {"path": args.model, "dtype": "fp32", "numerics": args.numerics},
            "warm_start": {"steps": 0},
            "env": {"digits": 1},
            "rollout": {
                "max_lag": max_lag,
                "prompts_per_step": args.prompts,
                "group_size": args.group,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
            },
            "train": {"steps": args.steps, "lr": LR, "grad_clip": 1.0},
            # the thread count asked for (per process), not run.threads' choice by model size
            "run": {"seed": args.seed, "tensorboard": False, "checkpoint_every": 10**9, "threads": threads},
        }
    )
    stamps: list[float] = []
    original_write = MetricsLog.write

    def write(self, metrics):  # step-end timestamp, same place TRL's on_step_end fires
        stamps.append(time.perf_counter())
        return original_write(self, metrics)

    MetricsLog.write = write
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_mod.train(config, Path(tmp) / "run", progress=False, log=lambda *a, **k: None)
        total = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "start": t0,
        "stamps": stamps,
        "metric_step_s": [r["time/step"] for r in rows],
        "wait_s": [r["time/wait_rollouts"] for r in rows],
        "train_s": [r["time/train"] for r in rows],
        "completion_tokens": [r["train/completion_tokens"] for r in rows],
        "reward_mean": [r["reward/mean"] for r in rows],
        "total_s": total,
        "threads": torch.get_num_threads(),
    }


def run_trl(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rzero.envs.arithmetic import ArithmeticEnv
    from rzero.envs.base import Task

    env = ArithmeticEnv(digits=1, seed=args.seed)
    tasks = [env.task(i) for i in range(args.prompts * (args.steps + 2))]
    dataset = Dataset.from_list([{"prompt": t.prompt, "answer": t.answer} for t in tasks])

    def arithmetic_reward(prompts, completions, answer, **kwargs):
        """Exact-answer reward, the same function rzero's environment applies."""
        return [env.reward(Task(0, p, a), c) for p, c, a in zip(prompts, completions, answer)]

    stamps: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            stamps.append(time.perf_counter())

    log_rows: list[dict] = []

    class LogKeeper(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs:
                log_rows.append(dict(logs))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        config = trl.GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=args.prompts * args.group,  # completions per step
            num_generations=args.group,
            gradient_accumulation_steps=1,
            max_completion_length=args.max_tokens,
            max_steps=args.steps,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            fp16=False,
            disable_tqdm=True,
            seed=args.seed,
            dataloader_num_workers=0,
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=arithmetic_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimer(), LogKeeper()],
        )
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
        dtype = str(next(trainer.model.parameters()).dtype)
    return {
        "start": t0,
        "stamps": stamps,
        "completion_tokens": [
            row.get("completions/mean_length", float("nan")) * args.prompts * args.group
            for row in log_rows
            if "loss" in row
        ],
        "reward_mean": [row.get("reward", float("nan")) for row in log_rows if "loss" in row],
        "total_s": total,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
    }


def worker_main(args) -> int:
    if args.worker == "trl":
        result = run_trl(args)
    else:
        result = run_rzero(args, max_lag=0 if args.worker == "rzero-sync" else 2)
    Path(args.json_out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------- parent


def step_times(result: dict, skip: int) -> list[float]:
    """Per-step wall times from step-end stamps; step i's interval is stamps[i] - stamps[i-1]."""
    edges = [result["start"], *result["stamps"]]
    times = [b - a for a, b in zip(edges, edges[1:])]
    return times[skip:]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.skip >= args.steps:
        raise SystemExit("--skip must be below --steps")
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for c in contenders:
        if c not in CONTENDERS:
            raise SystemExit(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS)}")
    import torch

    tmp = tempfile.TemporaryDirectory()
    if args.model is None:
        from rzero.model.presets import init_model

        args.model = str(init_model("tiny-dense", Path(tmp.name) / "tiny-dense", seed=args.seed, dtype="fp32"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    import rzero

    print(f"rzero from {Path(rzero.__file__).parent}")
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} torch threads per contender; "
        f"P={args.prompts} prompts x G={args.group} samples, max {args.max_tokens} new tokens, "
        f"temperature {args.temperature}, fp32, {args.steps} steps/run (first {args.skip} dropped), "
        f"{args.rounds} rounds; rzero numerics {args.numerics}",
        flush=True,
    )
    times: dict[str, list[float]] = {c: [] for c in contenders}
    round_medians: dict[str, dict[int, float]] = {c: {} for c in contenders}  # contender -> round -> median
    metric_times: dict[str, list[float]] = {c: [] for c in contenders}
    extras: dict[str, dict] = {}
    wall0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    for rnd in range(args.rounds):
        order = contenders if rnd % 2 == 0 else contenders[::-1]
        for c in order:
            out = Path(tmp.name) / f"{c}-{rnd}.json"
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", c, "--json-out", str(out)]
            cmd += ["--model", args.model]
            cmd += ["--prompts", str(args.prompts), "--group", str(args.group), "--steps", str(args.steps)]
            cmd += ["--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature)]
            cmd += ["--threads", str(args.threads), "--numerics", args.numerics, "--seed", str(args.seed)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"[{c}] FAILED (rc {proc.returncode}):\n{proc.stderr[-6000:]}", flush=True)
                continue
            res = json.loads(out.read_text())
            st = step_times(res, args.skip)
            times[c].extend(st)
            round_medians[c][rnd] = statistics.median(st)
            if "metric_step_s" in res:
                metric_times[c].extend(res["metric_step_s"][args.skip :])
            extras[c] = res
            toks = res["completion_tokens"][args.skip :]
            split = ""
            if "wait_s" in res:
                split = (
                    f"; wait for rollouts {statistics.median(res['wait_s'][args.skip:]):.3f} s, "
                    f"train+publish {statistics.median(res['train_s'][args.skip:]):.3f} s"
                )
            print(
                f"round {rnd + 1} {c:12s} median {statistics.median(st):.3f} s/step over {len(st)} steps "
                f"(min {min(st):.3f}, max {max(st):.3f}); completion tokens/step "
                f"{statistics.mean(toks) if toks else float('nan'):.1f}; threads {res['threads']}; "
                f"process {time.perf_counter() - t0:.1f} s{split}",
                flush=True,
            )
    print(f"\ntotal benchmark wall time {time.perf_counter() - wall0:.1f} s")
    print(
        "load average (1 min) at start %.2f, at end %.2f on %d CPUs: well above 0 means other processes shared the "
        "cores and the TRL number is inflated" % (load0, os.getloadavg()[0], os.cpu_count() or 1)
    )
    if "trl" in extras:
        v = extras["trl"]["versions"]
        print(
            f"versions: torch {torch.__version__}, trl {v['trl']}, transformers {v['transformers']}; "
            f"TRL dtype {extras['trl']['dtype']}"
        )
    print("\nseconds per RL step: median of kept steps over all rounds; best round (least disturbed by load):")
    med = {c: statistics.median(t) for c, t in times.items() if t}
    best = {c: min(r.values()) for c, r in round_medians.items() if r}
    for c, m in med.items():
        extra = ""
        if metric_times.get(c):
            extra = f"   (rzero time/step metric: {statistics.median(metric_times[c]):.3f})"
        print(f"  {c:12s} {m:8.3f} s/step  best round {best[c]:.3f}  n={len(times[c])}{extra}")
    if "trl" in med:
        for c in ("rzero-sync", "rzero-async"):
            if c in med:
                ratio, ratio_best = med["trl"] / med[c], best["trl"] / best[c]
                verdict = "PASS" if ratio >= 5 and ratio_best >= 5 else "FAIL"
                print(f"  TRL / {c}: {ratio:.2f}x (best rounds: {ratio_best:.2f}x)  target >= 5x: {verdict}")
                # The two runs of one round are minutes apart at most, so the host's load drifts less
                # between them than across the whole benchmark: the median of the per-round ratios.
                paired = [round_medians["trl"][k] / round_medians[c][k] for k in round_medians[c] if k in round_medians["trl"]]
                if paired:
                    print(f"  TRL / {c}, round by round: median {statistics.median(paired):.2f}x "
                          f"(rounds {', '.join(f'{x:.2f}' for x in paired)})")
    argv_shown = sys.argv[1:] if argv is None else argv
    print("\ncommand: python benchmarks/bench_trl.py " + " ".join(shlex.quote(a) for a in argv_shown))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
