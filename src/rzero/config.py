"""Typed run configuration: pydantic models loaded from TOML, with `--set section.key=value`.

Unknown keys and invalid values are rejected before anything starts, with a message that names
them. The resolved config is written to every run directory.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

LossName = Literal["reinforce_is", "ppo_clip", "tis", "icepop", "seq_is", "on_policy"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    path: str = ""  # a Hugging Face model directory; empty: build `preset` and warm-start it
    preset: Literal["tiny-dense", "tiny-moe"] = "tiny-dense"
    dtype: Literal["fp32", "bf16"] = "bf16"
    numerics: Literal["invariant", "standard"] = "invariant"


class WarmStartSection(Section):
    """Supervised warm start of a freshly built model on the task's reference answers."""

    steps: int = Field(200, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)


class EnvSection(Section):
    name: Literal["arithmetic"] = "arithmetic"
    digits: int = Field(1, ge=1, le=6)
    operations: list[Literal["+", "-", "*"]] = ["+"]
    rollout_delay_s: float = Field(0.0, ge=0)  # artificial per-rollout latency (a stand-in for slow tools)


class RolloutSection(Section):
    mode: Literal["async", "sync"] = "async"
    max_lag: int = Field(2, ge=0)
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_tokens: int = Field(8, ge=1)
    # Above 1 on purpose for the default job: the warm-started model knows most sums but samples
    # them with too much entropy; RL has to find and sharpen the right answers.
    temperature: float = Field(1.6, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    workers: int = Field(1, ge=1)
    recompute_on_update: bool = True

    @model_validator(mode="after")
    def _sync_has_no_lag(self) -> RolloutSection:
        if self.mode == "sync" and self.max_lag != 0:
            raise ValueError("rollout.mode = 'sync' requires rollout.max_lag = 0")
        return self


class TrainSection(Section):
    steps: int = Field(400, ge=1)
    loss: LossName = "reinforce_is"
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)  # clips the gradient norm (never the ratios)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["constant", "cosine"] = "cosine"
    micro_batch_tokens: int = Field(4096, ge=1)
    advantage_std_norm: bool = False
    leave_one_out: bool = False
    # Controls: ppo_clip epsilon, tis truncation C, icepop band [alpha, beta]
    clip_eps: float = Field(0.2, gt=0)
    tis_cap: float = Field(2.0, gt=0)
    icepop_low: float = Field(0.5, gt=0)
    icepop_high: float = Field(2.0, gt=0)


class DiagnosticsSection(Section):
    decompose: bool = True  # keep the last max_lag + 1 weight versions to split log w


class RunSection(Section):
    seed: int = 0
    checkpoint_every: int = Field(20, ge=1)
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "rzero"


class RunConfig(Section):
    model: ModelSection = ModelSection()
    warm_start: WarmStartSection = WarmStartSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    train: TrainSection = TrainSection()
    diagnostics: DiagnosticsSection = DiagnosticsSection()
    run: RunSection = RunSection()


class ConfigError(ValueError):
    """A config problem, phrased for the user (file, key, what is wrong)."""


def _format(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    """`--set` values are TOML values; bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from err
        source = str(path)
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        key, value = item.split("=", 1)
        section, _, name = key.strip().partition(".")
        if not isinstance(data.setdefault(section, {}), dict):
            raise ConfigError(f"--set {item!r}: {section} is not a section")
        data[section][name] = _parse_value(value.strip())
    if overrides:
        source += " with --set " + " ".join(overrides)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, source)) from None


def config_to_toml(config: RunConfig) -> str:
    import tomli_w

    return tomli_w.dumps(json.loads(config.model_dump_json()))
