"""The run loop: model, warm start, async RL steps, metrics, checkpoints, resume.

Run directory layout:
  config.toml          the resolved config (numerics mode included)
  overrides.jsonl      `--set` overrides given on resume, with the step they apply from
  metrics.jsonl        one JSON object per trainer step (metric names: docs/design.md)
  rollouts.jsonl       what each step trained on (rzero.run.record): replay and exact resume
  tb/                  TensorBoard events
  base_model/          the starting model (after the warm start, when one was built)
  checkpoints/         see rzero.run.checkpoint
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import math
import os
import random
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from rzero.config import RunConfig, config_to_toml, load_config
from rzero.envs import make_env as build_env
from rzero.files import atomic_write_text
from rzero.model.io import load_model, parse_dtype, read_tokenizer_files, save_model
from rzero.model.presets import PRESETS, init_model
from rzero.model.tokenizer import load_tokenizer
from rzero.ops.device import cpu_threads, intra_op_threads, model_dir_threads
from rzero.rollout.process_backend import discard_spares, prespawn
from rzero.run.backends import EngineFactory, check_backend, make_backend, resolved_backend
from rzero.run.checkpoint import find_resume_checkpoint, latest_checkpoint, save_checkpoint
from rzero.run.cluster import cpus_needed, needs_ray, open_cluster
from rzero.run.metrics_log import MetricsLog
from rzero.run.record import RECORD_FILE, ReplayDiverged, ReplaySource, ReplayThenLive, RolloutRecord, compare_runs
from rzero.run.ranks import TrainerRanks
from rzero.run.warm_start import warm_start
from rzero.train.trainer import Trainer, TrainerSettings


def make_env(config: RunConfig):
    return build_env(config.env, seed=config.run.seed)


def new_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def trainer_settings(config: RunConfig) -> TrainerSettings:
    """The trainer's settings: the [train] section's fields, plus the two it needs from elsewhere."""
    return TrainerSettings.from_values(
        {**config.train.model_dump(), "max_lag": config.rollout.max_lag, "decompose": config.diagnostics.decompose}
    )


def prepare_base_model(config: RunConfig, run_dir: Path, log=print) -> Path:
    """The model RL starts from: the configured directory, or a tiny preset built and warm-started."""
    if config.model.path:
        return Path(config.model.path)
    base = run_dir / "base_model"
    if (base / "config.json").is_file():
        return base
    scratch = run_dir / ".base_model_init"
    init_model(config.model.preset, scratch, seed=config.run.seed)
    if config.warm_start.steps:
        model = load_model(scratch, "fp32")
        warm_start(model, load_tokenizer(scratch), make_env(config), config, log=log)
        save_model(model, base, extra_files=read_tokenizer_files(scratch), dtype="fp32")
        shutil.rmtree(scratch)
    else:
        os.replace(scratch, base)
    return base


def _steps_to_replay(config: RunConfig, record: RolloutRecord, start_step: int, resume: bool,
                     overrides: list[str] | None, replay_of: Path | None) -> dict[int, dict]:
    """The recorded steps to replay from start_step on, in an unbroken run: all of `replay_of`'s
    record; on resume, the run's own steps after the checkpoint (none when the resume changes
    settings, which the recorded steps did not have)."""
    if replay_of is not None:
        entries = RolloutRecord(replay_of).read()
    elif resume and config.rollout.recompute_on_update and all(o.startswith("train.steps=") for o in overrides or []):
        entries = record.read()
    else:
        return {}
    replayed = {}
    while start_step + len(replayed) in entries:
        replayed[start_step + len(replayed)] = entries[start_step + len(replayed)]
    return replayed


def run_threads(config: RunConfig) -> int:
    """The torch intra-op thread count for this run (`run.threads`, 0: by model size)."""
    model = config.model
    if model.path:
        return model_dir_threads(model.path, config.run.threads, model.dtype, model.numerics)
    return cpu_threads(PRESETS[model.preset][1].hidden_size, config.run.threads, model.dtype, model.numerics)


def train(config: RunConfig, run_dir: Path, **kwargs) -> Path:
    """Run (or resume) RL training into run_dir on `run_threads(config)` torch threads (the
    caller's count is restored afterwards); the arguments are `_train`'s."""
    with intra_op_threads(run_threads(config)):
        try:
            return _train(config, run_dir, **kwargs)
        finally:
            discard_spares()


def _train(
    config: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    overrides: list[str] | None = None,
    progress: bool = True,
    env=None,
    log=print,
    replay_of: Path | None = None,
) -> Path:
    """Run (or resume) RL training into run_dir. `env` overrides the configured environment;
    `overrides` (the --set strings of a resume) are recorded in run_dir/overrides.jsonl.

    A resume first replays the recorded steps after its checkpoint (exactly, with invariant
    numerics), then goes on with live rollout workers. `replay_of`: re-execute that run's recorded
    steps into the new run_dir and stop where its record ends (ReplayDiverged where it cannot)."""
    if config.run.wandb:
        try:
            import wandb  # noqa: F401  (optional; checked before anything starts)
        except ImportError:
            raise ValueError("run.wandb = true needs the wandb package (pip install wandb)") from None
    check_backend(config)  # rollout.backend = "ray" without Ray fails here, before anything
    ranks = TrainerRanks(config, run_dir, log=log)  # and so does world_size > 1
    run_dir.mkdir(parents=True, exist_ok=True)
    found = find_resume_checkpoint(run_dir, log=log) if resume else None
    checkpoint, saved = found if found is not None else (None, None)
    if resume and checkpoint is None:
        log(f"no intact checkpoint in {run_dir}: starting from step 0 (metrics of the lost steps are dropped)")
    if not resume:
        atomic_write_text(run_dir / "config.toml", config_to_toml(config))
    elif overrides:  # the record says what ran: overrides given on resume, with the step they apply from
        step = 0 if saved is None else saved["trainer"]["version"]
        with open(run_dir / "overrides.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "set": list(overrides)}) + "\n")
    torch.manual_seed(config.run.seed)
    random.seed(config.run.seed)
    dtype = parse_dtype(config.model.dtype)

    if checkpoint is not None:
        model_dir = checkpoint / "model"
        log(f"resuming from {checkpoint}")
        master, tokenizer_files = saved["model"], saved["tokenizer_files"]
    else:
        if replay_of is None and resolved_backend(config, env) == "process":
            # The worker processes import torch and rzero on another core during the warm start.
            prespawn(config.rollout.workers, torch.get_num_threads())
        model_dir = prepare_base_model(config, run_dir, log=log)
        master = load_model(model_dir, "fp32")
        # Held in memory: every checkpoint gets a complete copy, whatever happens to model_dir later.
        tokenizer_files = read_tokenizer_files(model_dir)
    tokenizer = load_tokenizer(model_dir)
    t = config.train
    trainer = Trainer(master, dtype, trainer_settings(config), numerics=config.model.numerics, device=config.model.device)
    orchestrator_state = None
    if checkpoint is not None:
        trainer.load_state_dict(saved["trainer"])
        orchestrator_state = saved["orchestrator"]
        rng = saved["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    start_step = trainer.version
    record = RolloutRecord(run_dir)
    replay_entries = _steps_to_replay(config, record, start_step, resume, overrides, replay_of)
    if config.run.record_rollouts:
        record.keep_below(start_step + len(replay_entries) if replay_of is None else start_step)

    r = config.rollout
    # Snapshot now: workers build engines (in their threads or actors) while the trainer is stepping.
    engine_template = copy.deepcopy(trainer.compute).requires_grad_(False)
    make_engine = EngineFactory(
        engine_template,
        numerics=config.model.numerics,
        dtype=parse_dtype(r.engine_dtype or config.model.dtype),
        tokenizer=tokenizer,
        recompute_on_update=r.recompute_on_update,
        seed=config.run.seed,
        version=trainer.version,
        decode_steps_per_call=r.decode_steps_per_call,
    )
    resources = contextlib.ExitStack()  # the Ray cluster and the rollout actors' reservation

    def live_backend(state):
        return make_backend(config, make_engine, env, state, resources)

    try:
        if needs_ray(config):  # opened once, sized for every actor; the backend and the ranks join it
            resources.enter_context(open_cluster(config.cluster, cpus_needed(config), "a distributed run"))
        if replay_entries:
            replay = ReplaySource(replay_entries, engine_template, make_engine.dtype, run_seed=config.run.seed,
                                  max_lag=r.max_lag, state=orchestrator_state, earlier_weights=trainer.ring)
            backend = ReplayThenLive(replay, None if replay_of else live_backend, record, log=log)
        else:
            backend = live_backend(orchestrator_state)
    except BaseException:
        resources.close()
        raise
    metrics_log = MetricsLog(run_dir, config, keep_below_step=start_step if resume else None)
    bar = _ProgressBar(t.steps, start_step) if progress else None
    stopped_because = None
    consecutive_skips = 0
    try:
        backend.start(trainer.engine_state_dict(), trainer.version)
        ranks.start(trainer)  # data-parallel ranks 1..K-1 from the trainer's weights and state
        # A replay stops where its record ends.
        for step in range(start_step, t.steps if replay_of is None else start_step + len(replay_entries)):
            t0 = time.perf_counter()
            groups = backend.get_groups(step, r.prompts_per_step)
            t_wait = time.perf_counter() - t0
            rewards = torch.tensor([x.reward for g in groups for x in g])
            m = {"step": step, "version": trainer.version}
            m["reward/mean"] = float(rewards.mean())
            m["reward/std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
            m["rollout/turns_mean"] = sum(x.num_turns() for g in groups for x in g) / rewards.numel()
            t1 = time.perf_counter()
            m.update(ranks.train_step(trainer, groups))
            backend.publish(trainer.engine_state_dict(), trainer.version)
            now = time.perf_counter()
            m["time/train"] = now - t1
            m["time/wait_rollouts"] = t_wait
            m["time/step"] = now - t0
            m["tokens/s"] = m["train/completion_tokens"] / max(m["time/step"], 1e-9)
            stats = backend.stats()  # read once: the record must hold what the metrics row says
            m.update(stats)
            if config.run.record_rollouts:
                record.append(step, backend.last_groups, groups, stats)
            consecutive_skips = consecutive_skips + 1 if math.isnan(m["loss"]) else 0
            m["train/consecutive_skips"] = float(consecutive_skips)
            metrics_log.write(m)
            if consecutive_skips >= t.max_consecutive_skips:
                stopped_because = (
                    f"{consecutive_skips} updates in a row were skipped (non-finite loss or gradient) up to step "
                    f"{step}: the run has diverged; resume from the last checkpoint with a lower train.lr "
                    f"(train.max_consecutive_skips sets this limit)"
                )
                break
            if bar is not None:
                bar.update(m)
            if (step + 1) % config.run.checkpoint_every == 0 or step + 1 == t.steps:
                record.flush()  # the record holds every step the checkpoint has trained
                try:
                    save_checkpoint(run_dir, step + 1, trainer, backend, tokenizer_files)
                except OSError as err:
                    previous = latest_checkpoint(run_dir)
                    kept = f"the previous checkpoint ({previous.name}) is intact" if previous else "no earlier checkpoint exists"
                    what = "no space left on device" if err.errno == errno.ENOSPC else str(err)
                    stopped_because = f"{what} while writing checkpoint step {step + 1} ({err}); {kept}"
                    break
    finally:
        failing = sys.exc_info()[0] is not None
        try:
            backend.stop()
            ranks.close(trainer)
            resources.close()
            metrics_log.close()
            if bar is not None:
                bar.close()
        finally:  # last, and always: a failed record write must not skip the cleanup above
            record.close(raise_error=not failing and sys.exc_info()[0] is None)
    if stopped_because:
        raise RuntimeError(stopped_because)
    return run_dir


class _ProgressBar:
    def __init__(self, total: int, start: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]rl"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        )
        self.task = self.progress.add_task("rl", total=total, completed=start, info="")
        self.progress.start()

    def update(self, m: dict[str, float]) -> None:
        info = (
            f"reward {m['reward/mean']:.3f}  IS peak/median {m.get('is/peak_over_median', float('nan')):.3f}  "
            f"lag {m.get('lag/mean', float('nan')):.2f}/{m.get('lag/max', float('nan')):.0f}  "
            f"{m['tokens/s']:.0f} tok/s"
        )
        self.progress.update(self.task, advance=1, info=info)

    def close(self) -> None:
        self.progress.stop()


def main(args) -> int:
    if args.replay:
        return replay_main(args)
    overrides = list(args.set or [])
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.resume:
        run_dir = Path(args.resume)
        if args.config:
            raise ValueError(
                f"--resume {run_dir} uses the run's own config.toml; drop {args.config} "
                "(change settings with --set, which is recorded in overrides.jsonl)"
            )
        if not (run_dir / "config.toml").is_file():
            raise FileNotFoundError(f"{run_dir}: not a run directory (no config.toml)")
        config = load_config(run_dir / "config.toml", overrides)
    else:
        config = load_config(args.config, overrides)
        run_dir = Path(args.out) if args.out else new_run_dir()
        if (run_dir / "config.toml").exists():
            raise ValueError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise ValueError(f"{run_dir}: exists and is not an empty directory; choose another --out")
    train(config, run_dir, resume=bool(args.resume), overrides=overrides if args.resume else None)
    from rzero.run.report import write_report

    report = write_report(run_dir)
    print(f"run directory: {run_dir}\nreport: {report}")
    return 0


def replay_main(args) -> int:
    """`rzero train --replay RUN_DIR --out NEW`: re-execute a recorded run, then compare."""
    if args.config or args.set or args.steps is not None or args.resume:
        raise ValueError("--replay re-executes the run as recorded: it takes only --out (no config, --set, --steps or --resume)")
    if not args.out:
        raise ValueError("--replay needs --out NEW_RUN_DIR (the original run is never written to)")
    try:
        same, report = replay_run(Path(args.replay), Path(args.out))
    except ReplayDiverged as err:
        print(f"{err}\nthe steps before it are in {args.out}")
        return 1
    print(report)
    return 0 if same else 1


def replay_run(original: Path, new: Path, *, progress: bool = True, log=print) -> tuple[bool, str]:
    """Re-execute `original`'s recorded steps into `new`; (whether it is the same run, a report).
    Raises ReplayDiverged at the first step whose tokens cannot be drawn again."""
    if not (original / "config.toml").is_file():
        raise FileNotFoundError(f"{original}: not a run directory (no config.toml)")
    if not RolloutRecord(original).read():
        raise ValueError(f"{original}: no rollout record ({RECORD_FILE}) to replay (run.record_rollouts was off?)")
    changed = [s for line in _read_lines(original / "overrides.jsonl") for s in json.loads(line)["set"]]
    if any(not s.startswith("train.steps=") for s in changed):
        raise ValueError(f"{original} changed settings on resume ({changed}): a replay cannot re-execute that run")
    config = load_config(original / "config.toml", changed)
    if not config.rollout.recompute_on_update:
        raise ValueError("a replay needs rollout.recompute_on_update = true (with it off, tokens were sampled "
                         "from K/V of older weights, which the record does not hold)")
    if new.exists() and (not new.is_dir() or any(new.iterdir())):
        raise ValueError(f"{new}: exists and is not an empty directory; choose another --out")
    if (original / "base_model").is_dir():
        shutil.copytree(original / "base_model", new / "base_model")
    train(config, new, replay_of=original, progress=progress, log=log)
    return compare_runs(original, new)


def _read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []
