"""Faults during training: non-finite updates are skipped, failing rewards are counted, and a full
disk while checkpointing leaves the previous checkpoint valid and says why the run stopped."""

import errno
import json
from pathlib import Path

import pytest
import torch

from rzero import ops
from rzero.config import load_config
from rzero.envs.arithmetic import ArithmeticEnv
from rzero.model.presets import init_model
from rzero.model.io import load_model
from rzero.train import run as run_module
from rzero.train.run import latest_checkpoint, train
from rzero.train.trainer import Rollout, Trainer, TrainerSettings


class FlakyEnv(ArithmeticEnv):
    """Every third task's reward function raises; the others reward any 7 in the completion."""

    def reward(self, task, completion):
        if task.index % 3 == 0:
            raise RuntimeError("grader crashed")
        return 1.0 if "7" in completion else 0.0


def config(*overrides):
    return load_config(
        None,
        ["warm_start.steps=0", "rollout.prompts_per_step=3", "rollout.group_size=2", "rollout.max_tokens=4",
         "run.tensorboard=false", *overrides],
    )


def rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_nonfinite_update_is_skipped_and_counted(tmp_path):
    ops.set_numerics("invariant")
    model_dir = init_model("tiny-dense", tmp_path / "m")
    trainer = Trainer(load_model(model_dir), torch.float32, TrainerSettings(max_lag=1))
    before = {n: p.detach().clone() for n, p in trainer.master.named_parameters()}

    def group(mu):
        return [Rollout(0, [5, 6, 7], [8, 9], [mu, -1.0], [0, 0], r) for r in (1.0, 0.0)]

    metrics = trainer.train_step([group(float("nan"))])
    assert metrics["train/skipped_updates"] == 1 and metrics["loss"] != metrics["loss"]
    assert all(torch.equal(p, before[n]) for n, p in trainer.master.named_parameters())
    metrics = trainer.train_step([group(-1.0)])  # the run goes on
    assert metrics["train/skipped_updates"] == 1 and metrics["grad_norm"] > 0
    assert any(not torch.equal(p, before[n]) for n, p in trainer.master.named_parameters())


def test_failing_reward_function_counts_and_scores_zero(tmp_path):
    out = train(config("train.steps=3"), tmp_path / "run", progress=False, env=FlakyEnv(), log=lambda *a: None)
    metrics = rows(out)
    assert len(metrics) == 3
    assert metrics[-1]["rollout/reward_failures"] >= 2


def test_full_disk_while_checkpointing_keeps_previous_checkpoint(tmp_path, monkeypatch):
    real_save = run_module.save_model
    calls = {"n": 0}

    def save_then_fill_disk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint hits a full disk mid-write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(run_module, "save_model", save_then_fill_disk)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"checkpoint at step 4 failed .*No space left.*previous checkpoint is intact"):
        train(config("train.steps=6", "run.checkpoint_every=2"), run_dir, progress=False, env=FlakyEnv(),
              log=lambda *a: None)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_2"
    assert not list((run_dir / "checkpoints").glob(".*partial"))
    load_model(ckpt / "model")  # still a valid HF model directory

    monkeypatch.setattr(run_module, "save_model", real_save)
    train(config("train.steps=6", "run.checkpoint_every=2"), run_dir, resume=True, progress=False, env=FlakyEnv(),
          log=lambda *a: None)
    assert [m["step"] for m in rows(run_dir)] == list(range(6))
