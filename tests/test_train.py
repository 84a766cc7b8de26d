"""End-to-end RL runs: exact IS ratios under invariant numerics, the standard-numerics control,
and kill -9 resume that is bitwise identical in sync mode."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rzero.config import load_config
from rzero.envs.arithmetic import ArithmeticEnv
from rzero.run.loop import prepare_base_model, train

# Keys whose values depend on wall-clock time or thread timing rather than on the computation.
NONDETERMINISTIC = ("time/", "tokens/s", "rollout/queued_groups", "rollout/in_flight_groups")


class EvenLengthEnv(ArithmeticEnv):
    """Reward 1 for a completion of an even number of characters: about half of a random model's
    completions (only 1 of the tiny tokenizer's 1024 tokens holds a 7, so a "contains 7" rule left
    whole runs at reward 0), so every step has nonzero advantages and the weights really change
    between versions."""

    def reward(self, task, completion):
        return 1.0 if len(completion) % 2 == 0 else 0.0


def small_config(tmp_path, *overrides):
    return load_config(
        None,
        [
            "warm_start.steps=0",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_tokens=6",
            "train.lr=0.01",
            "run.tensorboard=false",
            *overrides,
        ],
    )


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_invariant_sync_run_has_unit_ratios(tmp_path, dtype):
    config = small_config(tmp_path, "rollout.max_lag=0", "train.steps=3", f"model.dtype={dtype}")
    rows = metrics(train(config, tmp_path / "run", progress=False, env=EvenLengthEnv(), log=lambda *a: None))
    assert len(rows) == 3
    for m in rows:
        assert m["is/peak_over_median"] == 1.0 and m["is/peak"] == 1.0 and m["is/ess"] == 1.0
        assert m["mismatch/kernel_max_abs"] == 0.0 and m["lag/max"] == 0.0
    assert any(m["grad_norm"] > 0 for m in rows)  # the weights did change between versions


def test_invariant_async_run_has_zero_kernel_mismatch(tmp_path):
    config = small_config(tmp_path, "rollout.max_lag=2", "train.steps=5")
    rows = metrics(train(config, tmp_path / "run", progress=False, env=EvenLengthEnv(), log=lambda *a: None))
    assert all(m["mismatch/kernel_max_abs"] == 0.0 for m in rows)
    assert all(m["lag/max"] <= 2 for m in rows)
    lagged = [m for m in rows if m["lag/max"] > 0]
    assert lagged, "an async run at max_lag 2 trains on lagged tokens"
    # With lag, log w is all weight lag: nonzero, and exactly what the ratio shows.
    assert any(m["mismatch/lag_max_abs"] > 0 for m in lagged)


def test_weight_update_interval_loads_weights_less_often_and_stays_exact(tmp_path):
    config = small_config(tmp_path, "rollout.max_lag=3", "rollout.weight_update_interval=3", "train.steps=6")
    rows = metrics(train(config, tmp_path / "run", progress=False, env=EvenLengthEnv(), log=lambda *a: None))
    # Versions 0..6 are published; engines load version 0 and then only every third: at most 3.
    assert rows[-1]["rollout/weight_loads"] <= 3
    assert all(m["mismatch/kernel_max_abs"] == 0.0 and m["lag/max"] <= 3 for m in rows)


def test_weight_update_interval_beyond_max_lag_is_rejected():
    from rzero.config import ConfigError

    with pytest.raises(ConfigError, match="weight_update_interval"):
        load_config(None, ["rollout.max_lag=2", "rollout.weight_update_interval=3"])


def test_standard_numerics_show_kernel_mismatch(tmp_path):
    config = small_config(tmp_path, "model.numerics=standard", "model.dtype=fp32", "train.steps=2")
    rows = metrics(train(config, tmp_path / "run", progress=False, env=EvenLengthEnv(), log=lambda *a: None))
    assert all(m["mismatch/kernel_max_abs"] > 0 for m in rows)
    assert any(m["is/peak_over_median"] > 1.0 for m in rows)


@pytest.fixture(scope="module")
def warm_base(tmp_path_factory):
    """A briefly warm-started model on one-digit sums: some answers right, so rewards vary."""
    root = tmp_path_factory.mktemp("base")
    config = load_config(None, ["env.digits=1", "warm_start.steps=40", "warm_start.batch_size=32"])
    return prepare_base_model(config, root, log=lambda *a: None)


def _comparable(rows):
    return [{k: v for k, v in m.items() if not k.startswith(NONDETERMINISTIC)} for m in rows]


def test_kill9_resume_is_bitwise_identical_in_sync_mode(tmp_path, warm_base):
    cfg = tmp_path / "sync.toml"
    cfg.write_text(
        f'[model]\npath = "{warm_base}"\n[env]\ndigits = 1\n'
        "[rollout]\nmode = \"sync\"\nmax_lag = 0\nprompts_per_step = 4\ngroup_size = 4\nmax_tokens = 4\n"
        "[train]\nsteps = 8\nlr = 0.003\n[run]\ncheckpoint_every = 2\ntensorboard = false\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference = tmp_path / "reference"
    subprocess.run([sys.executable, "-m", "rzero.cli", "train", str(cfg), "--out", str(reference)], check=True, env=env,
                   capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "rzero.cli", "train", str(cfg), "--out", str(killed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once a checkpoint exists and the run has gone past it
        path = killed / "metrics.jsonl"
        if (killed / "checkpoints" / "latest").exists() and path.exists() and len(path.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics(killed)) < 8, "the run finished before it could be killed"

    subprocess.run([sys.executable, "-m", "rzero.cli", "train", "--resume", str(killed)], check=True, env=env,
                   capture_output=True)
    ref_rows, resumed_rows = metrics(reference), metrics(killed)
    assert [m["step"] for m in resumed_rows] == list(range(8))
    assert _comparable(resumed_rows) == _comparable(ref_rows)
    assert any(m["grad_norm"] > 0 for m in ref_rows) and len({m["reward/mean"] for m in ref_rows}) > 1


def test_engines_in_another_dtype_show_the_kernel_mismatch(tmp_path):
    """The common-stack control (rollout.engine_dtype): engines sampling in bf16 for a trainer
    scoring in fp32 give w != 1 at lag 0, and the decomposition puts it all in the kernel part."""
    config = small_config(tmp_path, "model.dtype=fp32", "rollout.engine_dtype=bf16", "rollout.max_lag=0", "train.steps=2")
    train(config, tmp_path / "run", progress=False, env=EvenLengthEnv(), log=lambda *a: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["lag/max"] == 0 and m["mismatch/lag_max_abs"] == 0.0 for m in rows)
    assert all(m["mismatch/kernel_max_abs"] > 1e-4 and m["is/peak"] != 1.0 for m in rows)


def test_run_threads_by_model_size_and_restored_after_train(tmp_path, monkeypatch):
    """run.threads = 0 gives tiny models one intra-op thread (a second one only costs fork/join
    there), larger models PyTorch's default; an explicit count wins; the caller's count is back
    after train(), also when it ran on another."""
    import torch

    from rzero.run import loop

    assert loop.run_threads(small_config(tmp_path)) == 1  # tiny-dense: hidden 128
    assert loop.run_threads(small_config(tmp_path, "run.threads=3")) == 3
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({"hidden_size": 1024}))
    assert loop.run_threads(small_config(tmp_path, f'model.path="{big}"')) == torch.get_num_threads()
    # fp32 under invariant numerics stays on one thread at K >= 1024 (two threads change its bits)
    assert loop.run_threads(small_config(tmp_path, f'model.path="{big}"', "model.dtype=fp32")) == 1
    assert loop.run_threads(small_config(tmp_path, f'model.path="{big}"', "model.dtype=fp32", "model.numerics=standard")) == torch.get_num_threads()

    seen = []
    monkeypatch.setattr(loop, "_train", lambda config, run_dir, **kw: seen.append(torch.get_num_threads()) or run_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loop.train(small_config(tmp_path), tmp_path / "run")
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
