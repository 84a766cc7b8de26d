"""Run configs: TOML + --set overrides; bad keys and values are rejected with their names."""

from pathlib import Path

import pytest

from rzero.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["default.toml", "lag8.toml", "sync.toml", "tool_calc_lag64.toml", "tool_calc_sync.toml", "ray.toml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.train.loss == "reinforce_is"


def test_tool_calc_sync_config_differs_from_lag64_only_in_lag():
    lag64, sync = load_config(CONFIGS / "tool_calc_lag64.toml"), load_config(CONFIGS / "tool_calc_sync.toml")
    assert (lag64.rollout.max_lag, sync.rollout.max_lag) == (64, 0)
    sync.rollout = lag64.rollout
    assert sync == lag64


def test_overrides_reach_nested_tables():
    config = load_config(CONFIGS / "tool_calc_lag64.toml", ["env.tools.calculator.latency_s=2.5"])
    calculator = config.env.tools["calculator"]
    assert calculator.latency_s == 2.5 and calculator.latency == "lognormal"  # the rest of the table is kept
    with pytest.raises(ConfigError, match=r"env\.digits is not a section"):
        load_config(CONFIGS / "tool_calc_lag64.toml", ["env.digits.x=1"])


def test_default_toml_matches_builtin_defaults():
    assert load_config(CONFIGS / "default.toml") == load_config(None)


def test_sync_config_is_the_synchronous_baseline():
    config = load_config(CONFIGS / "sync.toml")
    assert config.rollout.max_lag == 0


def test_removed_rollout_mode_key_is_dropped_when_it_agrees():
    """Run configs written before rollout.mode was removed still load (so old runs resume)."""
    with pytest.warns(UserWarning, match="rollout.mode is no longer used"):
        config = load_config(None, ["rollout.mode=sync", "rollout.max_lag=0"])
    assert config.rollout.max_lag == 0 and "mode" not in config.rollout.model_dump()
    with pytest.warns(UserWarning):
        assert load_config(None, ["rollout.mode=async"]) == load_config(None)


def test_choices_come_from_the_code_constants():
    from rzero.cli import build_parser
    from rzero.envs import ENV_NAMES
    from rzero.model.presets import PRESETS
    from rzero.ops import NUMERICS_MODES
    from rzero.train.losses import LOSSES

    for key, values in [("model.numerics", NUMERICS_MODES), ("model.preset", tuple(PRESETS)), ("train.loss", LOSSES), ("env.name", ENV_NAMES)]:
        for value in values:
            extra = ["env.data=x.jsonl"] if value == "math" else []
            assert load_config(None, [f"{key}={value}", *extra]) is not None
    choices = {a.dest: a.choices for sub in build_parser()._subparsers._group_actions[0].choices.values() for a in sub._actions}
    assert tuple(choices["numerics"]) == NUMERICS_MODES and tuple(choices["preset"]) == tuple(PRESETS)


def test_overrides_parse_toml_values():
    config = load_config(None, ["rollout.max_lag=8", "train.loss=tis", "env.operations=['+', '*']", "train.lr=1e-4"])
    assert config.rollout.max_lag == 8 and config.train.loss == "tis"
    assert config.env.operations == ["+", "*"] and config.train.lr == 1e-4


@pytest.mark.parametrize(
    "override, message",
    [
        (["rollout.bogus=1"], r"rollout\.bogus: unknown key"),
        (["nosuch.key=1"], r"nosuch: unknown key"),
        (["train.lr=-1"], r"train\.lr: Input should be greater than 0"),
        (["train.loss=ppo"], r"train\.loss: Input should be"),
        (["rollout.mode=sync"], r"rollout\.mode = 'sync' \(a removed key\) requires rollout\.max_lag = 0"),
        (["model.numerics=fast"], r"model\.numerics"),
        (["justakey"], r"expected section\.key=value"),
    ],
)
def test_bad_values_are_rejected_with_names(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


def test_bad_files_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nstep = 3\n")
    with pytest.raises(ConfigError, match=r"train\.step: unknown key"):
        load_config(unknown)


def test_cli_reports_config_errors_before_starting(tmp_path, capsys):
    from rzero.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), "--set", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    from rzero.run.loop import train

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match=r"run\.wandb = true needs the wandb package"):
        train(load_config(None, ["run.wandb=true"]), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_shipped_eval_suite_loads():
    from rzero.eval.suite import load_suite

    (plan,) = load_suite(CONFIGS / "eval" / "tool_calc.toml")
    assert plan.task == "tool_calc" and plan.num_tasks == 100 and plan.sampling.k == 4

