"""`rzero train`: a whole run — model, warm start, async RL loop, metrics, checkpoints, resume.

Run directory layout:
  config.toml          the resolved config (numerics mode included)
  metrics.jsonl        one JSON object per trainer step (BRIEF §3 names)
  tb/                  TensorBoard events
  base_model/          the starting model (after the warm start, when one was built)
  checkpoints/step_N/  model/ (HF format: safetensors + config + tokenizer, fp32 master weights),
                       trainer.pt (optimizer, scheduler, ring buffer), orchestrator.pt (rollouts
                       generated but not yet trained on), rng.pt
  checkpoints/latest   name of the newest complete checkpoint (replaced atomically)
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import random
import shutil
import time
from datetime import datetime
from pathlib import Path

import torch

from rzero import ops
from rzero.config import RunConfig, config_to_toml, load_config
from rzero.engine import Engine, SamplingParams
from rzero.envs import make_env as build_env
from rzero.model.io import load_model, parse_dtype, read_tokenizer_files, save_model
from rzero.model.presets import init_model
from rzero.model.tokenizer import load_tokenizer
from rzero.ops import AttentionMeta
from rzero.rollout.orchestrator import LocalBackend
from rzero.train.losses import LossSettings
from rzero.train.trainer import Trainer, TrainerSettings, copy_grads_to_master



def make_env(config: RunConfig):
    return build_env(config.env, seed=config.run.seed)


def new_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


# ------------------------------------------------------------------ warm start


def warm_start(model, tokenizer, env, config: RunConfig, log=print) -> float:
    """Supervised steps on the task's reference answers; returns the last loss."""
    ws = config.warm_start
    dtype = parse_dtype(config.model.dtype)
    trainer_model = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr)
    loss_value = float("nan")
    for step in range(ws.steps):
        # Tasks from a range disjoint from the RL run's (RL uses indices 0, 1, 2, ...).
        tasks = [env.task(10_000_000 + step * ws.batch_size + i) for i in range(ws.batch_size)]
        seqs, rows, labels, offset = [], [], [], 0
        for task in tasks:
            tokens = tokenizer.encode(task.prompt, add_special_tokens=False).ids
            reference = env.reference(task)
            for text, trained in [(reference, True)] if isinstance(reference, str) else reference:
                ids = tokenizer.encode(text, add_special_tokens=False).ids
                if trained:  # environment text (tool responses) is context, not a target
                    rows.extend(range(offset + len(tokens) - 1, offset + len(tokens) - 1 + len(ids)))
                    labels.extend(ids)
                tokens += ids
            seqs.append(tokens)
            offset += len(tokens)
        meta, _ = AttentionMeta.for_sequences([len(s) for s in seqs])
        hidden = trainer_model(torch.tensor([t for s in seqs for t in s]), meta)
        logp = ops.log_softmax(trainer_model.logits(hidden[rows]))
        loss = -logp.gather(1, torch.tensor(labels)[:, None]).mean()
        opt.zero_grad(set_to_none=True)
        trainer_model.zero_grad(set_to_none=True)
        loss.backward()
        if trainer_model is not model:
            copy_grads_to_master(model, trainer_model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if trainer_model is not model:
            with torch.no_grad():
                for mp, cp in zip(model.parameters(), trainer_model.parameters()):
                    cp.copy_(mp)
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise RuntimeError(
                f"warm start diverged at step {step + 1}/{ws.steps} (loss {loss_value}); "
                f"lower warm_start.lr (now {ws.lr}) or set warm_start.steps = 0"
            )
        if step % 50 == 0 or step == ws.steps - 1:
            log(f"warm start {step + 1}/{ws.steps}: loss {loss_value:.3f}")
    return loss_value


# ----------------------------------------------------------------- checkpoints


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: Path, step: int, trainer: Trainer, backend: LocalBackend, tokenizer_files: dict[str, bytes]
) -> Path:
    """Write checkpoints/step_N completely, then point `latest` at it; keep the last two."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(trainer.master, tmp / "model", extra_files=tokenizer_files, dtype="fp32")
        torch.save(trainer.state_dict(), tmp / "trainer.pt")
        torch.save(backend.state_dict(), tmp / "orchestrator.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write_text(root / "latest", final.name + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = run_dir / "checkpoints" / name
    return path if name and path.is_dir() else None


def _checkpoints_newest_first(run_dir: Path) -> list[Path]:
    steps = [p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]), reverse=True)


def load_checkpoint(path: Path) -> dict:
    """Everything a resume needs from one checkpoint, fully loaded (so a damaged file shows here,
    not halfway through the run). Raises ValueError naming the damaged file."""
    state = {"model": load_model(path / "model", "fp32"), "tokenizer_files": read_tokenizer_files(path / "model")}
    for key in ("trainer", "orchestrator", "rng"):
        file = path / f"{key}.pt"
        try:
            state[key] = torch.load(file, weights_only=False)
        except Exception as err:  # truncated or garbage pickles raise many different types
            raise ValueError(f"{file}: cannot be read ({type(err).__name__}: {err})") from None
    return state


def find_resume_checkpoint(run_dir: Path, log=print) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads completely, falling back to older ones (saying so)."""
    for path in _checkpoints_newest_first(run_dir):
        try:
            return path, load_checkpoint(path)
        except (OSError, ValueError) as err:
            log(f"checkpoint {path.name} is unusable ({err}); trying the previous one")
    return None


# ------------------------------------------------------------------------ run


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a torn or garbled line (a kill mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLog:
    def __init__(self, run_dir: Path, config: RunConfig, keep_below_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if keep_below_step is not None and self.path.exists():
            # On resume, drop steps after the checkpoint: they are computed again.
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) is not None]
            kept = [line for line in kept if _step_of(line) < keep_below_step]
            _atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")
        self.tb = None
        if config.run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        self.wandb = None
        if config.run.wandb:
            import wandb  # optional: only when the user asks for it

            self.wandb = wandb.init(project=config.run.wandb_project, dir=str(run_dir), config=config.model_dump())

    def write(self, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        step = int(metrics["step"])
        if self.tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


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


def train(
    config: RunConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    overrides: list[str] | None = None,
    progress: bool = True,
    env=None,
    log=print,
) -> Path:
    """Run (or resume) RL training into run_dir. `env` overrides the configured environment;
    `overrides` (the --set strings of a resume) are recorded in run_dir/overrides.jsonl."""
    ops.set_numerics(config.model.numerics)
    if config.run.wandb:
        try:
            import wandb  # noqa: F401  (optional; checked before anything starts)
        except ImportError:
            raise ValueError("run.wandb = true needs the wandb package (pip install wandb)") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    found = find_resume_checkpoint(run_dir, log=log) if resume else None
    checkpoint, saved = found if found is not None else (None, None)
    if resume and checkpoint is None:
        log(f"no intact checkpoint in {run_dir}: starting from step 0 (metrics of the lost steps are dropped)")
    if not resume:
        _atomic_write_text(run_dir / "config.toml", config_to_toml(config))
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
        model_dir = prepare_base_model(config, run_dir, log=log)
        master = load_model(model_dir, "fp32")
        # Held in memory: every checkpoint gets a complete copy, whatever happens to model_dir later.
        tokenizer_files = read_tokenizer_files(model_dir)
    tokenizer = load_tokenizer(model_dir)
    t = config.train
    settings = TrainerSettings(
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=tuple(t.betas),
        grad_clip=t.grad_clip,
        warmup_steps=t.warmup_steps,
        schedule=t.schedule,
        total_steps=t.steps,
        micro_batch_tokens=t.micro_batch_tokens,
        leave_one_out=t.leave_one_out,
        advantage_std_norm=t.advantage_std_norm,
        decompose=config.diagnostics.decompose,
        max_lag=config.rollout.max_lag,
        loss=LossSettings(t.loss, t.clip_eps, t.tis_cap, t.icepop_low, t.icepop_high),
    )
    trainer = Trainer(master, dtype, settings)
    orchestrator_state = None
    if checkpoint is not None:
        trainer.load_state_dict(saved["trainer"])
        orchestrator_state = saved["orchestrator"]
        rng = saved["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    start_step = trainer.version

    r = config.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens)
    # Snapshot now: workers build engines in their own threads while the trainer is stepping.
    engine_template = copy.deepcopy(trainer.compute).requires_grad_(False)

    def make_engine() -> Engine:
        return Engine(
            engine_template,  # each engine takes its own copy
            dtype=dtype,
            tokenizer=tokenizer,
            recompute_on_update=r.recompute_on_update,
            seed=config.run.seed,
            version=trainer.version,
        )

    backend = LocalBackend(
        make_engine,
        env if env is not None else make_env(config),
        prompts_per_step=r.prompts_per_step,
        group_size=r.group_size,
        max_lag=r.max_lag,
        sampling=sampling,
        seed=config.run.seed,
        workers=r.workers,
        weight_update_interval=r.weight_update_interval,
        rollout_delay_s=config.env.rollout_delay_s,
        state=orchestrator_state,
    )
    metrics_log = MetricsLog(run_dir, config, keep_below_step=start_step if resume else None)
    bar = _ProgressBar(t.steps, start_step) if progress else None
    backend.start(trainer.engine_state_dict(), trainer.version)
    stopped_because = None
    consecutive_skips = 0
    try:
        for step in range(start_step, t.steps):
            t0 = time.perf_counter()
            groups = backend.get_groups(step, r.prompts_per_step)
            t_wait = time.perf_counter() - t0
            rewards = torch.tensor([x.reward for g in groups for x in g])
            m = {"step": step, "version": trainer.version}
            m["reward/mean"] = float(rewards.mean())
            m["reward/std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
            m["rollout/turns_mean"] = sum(x.num_turns() for g in groups for x in g) / rewards.numel()
            t1 = time.perf_counter()
            m.update(trainer.train_step(groups))
            backend.publish(trainer.engine_state_dict(), trainer.version)
            now = time.perf_counter()
            m["time/train"] = now - t1
            m["time/wait_rollouts"] = t_wait
            m["time/step"] = now - t0
            m["tokens/s"] = m["train/completion_tokens"] / max(m["time/step"], 1e-9)
            m.update(backend.stats())
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
                try:
                    save_checkpoint(run_dir, step + 1, trainer, backend, tokenizer_files)
                except OSError as err:
                    previous = latest_checkpoint(run_dir)
                    kept = f"the previous checkpoint ({previous.name}) is intact" if previous else "no earlier checkpoint exists"
                    what = "no space left on device" if err.errno == errno.ENOSPC else str(err)
                    stopped_because = f"{what} while writing checkpoint step {step + 1} ({err}); {kept}"
                    break
    finally:
        backend.stop()
        metrics_log.close()
        if bar is not None:
            bar.close()
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
    from rzero.train.report import write_report

    report = write_report(run_dir)
    print(f"run directory: {run_dir}\nreport: {report}")
    return 0
