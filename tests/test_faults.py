"""Faults during training: non-finite updates are skipped, failing rewards are counted, and a full
disk while checkpointing leaves the previous checkpoint valid and says why the run stopped."""

import errno
import json
from pathlib import Path

import pytest
import torch

from rzero.config import load_config
from rzero.envs.arithmetic import ArithmeticEnv
from rzero.model.presets import init_model
from rzero.model.io import load_model
from rzero.run import checkpoint as checkpoint_module
from rzero.run import loop as run_module
from rzero.run.checkpoint import latest_checkpoint
from rzero.run.loop import train
from rzero.rollout.record import Rollout
from rzero.train.trainer import Trainer, TrainerSettings


class FlakyEnv(ArithmeticEnv):
    """Every third task's reward function raises; the others reward a completion of even length."""

    def reward(self, task, completion):
        if task.index % 3 == 0:
            raise RuntimeError("grader crashed")
        return 1.0 if len(completion) % 2 == 0 else 0.0


def config(*overrides):
    return load_config(
        None,
        ["warm_start.steps=0", "rollout.prompts_per_step=3", "rollout.group_size=2", "rollout.max_tokens=4",
         "run.tensorboard=false", *overrides],
    )


def rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_nonfinite_update_is_skipped_and_counted(tmp_path):
    model_dir = init_model("tiny-dense", tmp_path / "m")
    trainer = Trainer(load_model(model_dir), torch.float32, TrainerSettings(max_lag=1))
    before = {n: p.detach().clone() for n, p in trainer.master.named_parameters()}

    def group(mu):
        return [Rollout([5, 6, 7], [8, 9], [mu, -1.0], [0, 0], r) for r in (1.0, 0.0)]

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
    real_save = checkpoint_module.save_model
    calls = {"n": 0}

    def save_then_fill_disk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint hits a full disk mid-write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save_model", save_then_fill_disk)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"no space left on device while writing checkpoint step 4 .*the previous checkpoint \(step_2\) is intact"):
        train(config("train.steps=6", "run.checkpoint_every=2"), run_dir, progress=False, env=FlakyEnv(),
              log=lambda *a: None)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_2"
    assert not list((run_dir / "checkpoints").glob(".*partial"))
    load_model(ckpt / "model")  # still a valid HF model directory

    monkeypatch.setattr(checkpoint_module, "save_model", real_save)
    train(config("train.steps=6", "run.checkpoint_every=2"), run_dir, resume=True, progress=False, env=FlakyEnv(),
          log=lambda *a: None)
    assert [m["step"] for m in rows(run_dir)] == list(range(6))


# ------------------------------------------------- issue 8: nothing lost, nothing silent


def quiet(*args):
    pass


def test_moe_warm_start_in_bf16_handles_experts_without_gradient(tmp_path):
    """An expert no token was routed to has no gradient; the warm start used to crash on it."""
    from rzero.run.loop import prepare_base_model

    cfg = load_config(None, ["model.preset=tiny-moe", "model.dtype=bf16", "warm_start.steps=3", "warm_start.batch_size=2"])
    base = prepare_base_model(cfg, tmp_path, log=quiet)
    assert all(torch.isfinite(p).all() for p in load_model(base).parameters())


def test_diverging_warm_start_stops_with_a_clear_error(tmp_path):
    from rzero.run.loop import prepare_base_model

    cfg = load_config(None, ["warm_start.steps=5", "warm_start.lr=1e30", "warm_start.batch_size=2"])
    with pytest.raises(RuntimeError, match="warm start diverged"):
        prepare_base_model(cfg, tmp_path, log=quiet)
    assert not (tmp_path / "base_model").exists()  # no NaN model saved as the run's base


def test_run_stops_after_consecutive_skipped_updates(tmp_path, monkeypatch):
    from rzero.train import trainer as trainer_module

    real = trainer_module.policy_loss
    monkeypatch.setattr(trainer_module, "policy_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(RuntimeError, match="3 updates in a row were skipped"):
        train(config("train.steps=10", "train.max_consecutive_skips=3"), tmp_path / "run", progress=False, log=quiet)
    assert [m["train/consecutive_skips"] for m in rows(tmp_path / "run")] == [1.0, 2.0, 3.0]


def test_every_checkpoint_keeps_its_tokenizer_across_resumes(tmp_path):
    from rzero.model.tokenizer import load_tokenizer

    run_dir = tmp_path / "run"
    train(config("train.steps=3", "run.checkpoint_every=1"), run_dir, progress=False, log=quiet)
    # Retention deletes step_1 (the resumed-from checkpoint's neighbour) while the resume writes more.
    train(config("train.steps=6", "run.checkpoint_every=1"), run_dir, resume=True, progress=False, log=quiet)
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_5", "step_6"]
    for ckpt in ckpts:
        load_tokenizer(ckpt / "model")
        load_model(ckpt / "model")
    train(config("train.steps=7", "run.checkpoint_every=1"), run_dir, resume=True, progress=False, log=quiet)
    assert [m["step"] for m in rows(run_dir)] == list(range(7))


def test_resume_falls_back_past_a_damaged_checkpoint_and_drops_its_metrics(tmp_path):
    run_dir = tmp_path / "run"
    train(config("train.steps=4", "run.checkpoint_every=2"), run_dir, progress=False, log=quiet)
    trainer_pt = run_dir / "checkpoints" / "step_4" / "trainer.pt"
    trainer_pt.write_bytes(trainer_pt.read_bytes()[:100])  # truncated
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')  # a torn last line
    said = []
    train(config("train.steps=5", "run.checkpoint_every=2"), run_dir, resume=True, progress=False, log=said.append)
    assert any("step_4 is unusable" in s and "trainer.pt" in s for s in said)
    assert any("resuming from" in s and s.endswith("step_2") for s in said)
    assert [m["step"] for m in rows(run_dir)] == list(range(5))


def test_resume_follows_checkpoints_not_a_stale_latest_pointer(tmp_path):
    run_dir = tmp_path / "run"
    train(config("train.steps=2", "run.checkpoint_every=2"), run_dir, progress=False, log=quiet)
    (run_dir / "checkpoints" / "latest").write_text("step_99\n")  # names a missing directory
    said = []
    train(config("train.steps=3", "run.checkpoint_every=1"), run_dir, resume=True, progress=False, log=said.append)
    assert any(s.endswith("step_2") for s in said)
    assert [m["step"] for m in rows(run_dir)] == [0, 1, 2]


def test_resume_without_any_checkpoint_says_so_and_does_not_duplicate_metrics(tmp_path):
    run_dir = tmp_path / "run"
    train(config("train.steps=3", "run.checkpoint_every=100"), run_dir, progress=False, log=quiet)
    import shutil

    shutil.rmtree(run_dir / "checkpoints")  # as if killed before the first checkpoint
    said = []
    train(config("train.steps=3", "run.checkpoint_every=100"), run_dir, resume=True, progress=False, log=said.append)
    assert any("no intact checkpoint" in s for s in said)
    assert [m["step"] for m in rows(run_dir)] == [0, 1, 2]


def test_cli_resume_rejects_a_config_file_and_records_overrides(tmp_path, capsys):
    from rzero.cli import main

    run_dir = tmp_path / "run"
    train(config("train.steps=2", "run.checkpoint_every=2"), run_dir, progress=False, log=quiet)
    assert main(["train", "configs/lag8.toml", "--resume", str(run_dir)]) == 2
    assert "uses the run's own config.toml" in capsys.readouterr().err
    run_module.train(load_config(run_dir / "config.toml", ["train.steps=3"]), run_dir, resume=True,
                     overrides=["train.steps=3"], progress=False, log=quiet)
    assert json.loads((run_dir / "overrides.jsonl").read_text()) == {"step": 2, "set": ["train.steps=3"]}


def test_cli_out_paths_that_are_not_usable_give_one_line_errors(tmp_path, capsys):
    from rzero.cli import main

    a_file = tmp_path / "file"
    a_file.write_text("mine")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    cases = [
        (["init-model", "--preset", "tiny-dense", "--out", str(a_file)], "not a directory"),
        (["init-model", "--preset", "tiny-dense", "--out", str(a_file / "sub")], "not a directory"),
        (["init-model", "--preset", "tiny-dense", "--out", str(tmp_path / "notes")], "not a model directory"),
        (["train", "--out", str(tmp_path / "notes"), "--steps", "1"], "not an empty directory"),
        (["train", "--out", str(a_file), "--steps", "1"], "not an empty directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (argv, err)
    assert a_file.read_text() == "mine" and (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_init_model_overwrites_a_model_directory_only_with_force_and_keeps_other_files(tmp_path, capsys):
    from rzero.cli import main

    out = tmp_path / "m"
    assert main(["init-model", "--preset", "tiny-dense", "--out", str(out)]) == 0
    (out / "README.md").write_text("my notes")
    assert main(["init-model", "--preset", "tiny-dense", "--out", str(out), "--seed", "1"]) == 2
    assert "--force" in capsys.readouterr().err
    before = load_model(out).model.embed_tokens.weight.clone()
    assert main(["init-model", "--preset", "tiny-dense", "--out", str(out), "--seed", "1", "--force"]) == 0
    assert not torch.equal(load_model(out).model.embed_tokens.weight, before)
    assert (out / "README.md").read_text() == "my notes"
