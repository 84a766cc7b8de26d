"""Typed run configuration: pydantic models loaded from TOML, with `--set section.key=value`.

Unknown keys and invalid values are rejected before anything starts, with a message that names
them. The resolved config is written to every run directory.
"""

from __future__ import annotations

import json
import tomllib
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rzero.envs import ENV_NAMES, ENVS
from rzero.envs.grading import DEFAULT_TIMEOUT_S as DEFAULT_GRADER_TIMEOUT_S
from rzero.envs.math import DEFAULT_PROMPT_TEMPLATE
from rzero.files import read_toml
from rzero.model.io import DTYPE_NAMES
from rzero.model.presets import PRESETS
from rzero.ops import DEVICE_NAMES, NUMERICS_MODES
from rzero.train.losses import LOSSES

# The choices are the constants the code itself validates against (and the CLI offers).
LossName = Literal[LOSSES]
DtypeName = Literal[DTYPE_NAMES]
PresetName = Literal[tuple(PRESETS)]
NumericsMode = Literal[NUMERICS_MODES]
DeviceName = Literal[DEVICE_NAMES]
EnvName = Literal[ENV_NAMES]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    path: str = ""  # a Hugging Face model directory; empty: build `preset` and warm-start it
    preset: PresetName = "tiny-dense"
    dtype: DtypeName = "bf16"
    numerics: NumericsMode = "invariant"
    # Where the trainer, the rollout engines (KV cache included) and the sampler run. "auto":
    # CUDA when torch sees a GPU. Asking for "cuda" without one is an error, never a CPU run.
    device: DeviceName = "cpu"


class WarmStartSection(Section):
    """Supervised warm start of a freshly built model on the task's reference answers."""

    steps: int = Field(200, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)


class ToolSection(Section):
    """Latency and faults of one tool (`[env.tools.calculator]`)."""

    latency: Literal["none", "fixed", "uniform", "lognormal"] = "none"
    latency_s: float = Field(0.0, ge=0)  # fixed: the delay; lognormal: the median
    latency_low_s: float = Field(0.0, ge=0)  # uniform bounds
    latency_high_s: float = Field(0.0, ge=0)
    latency_sigma: float = Field(1.0, ge=0)  # lognormal: std of log(delay)
    failure_rate: float = Field(0.0, ge=0, le=1)
    timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _uniform_bounds(self) -> ToolSection:
        if self.latency == "uniform" and self.latency_low_s > self.latency_high_s:
            raise ValueError("latency_low_s must be <= latency_high_s")
        return self


class EnvSection(Section):
    name: EnvName = "arithmetic"
    digits: int = Field(1, ge=1, le=6)  # arithmetic and tool_calc: digits of each operand
    operations: list[Literal["+", "-", "*"]] = ["+"]  # arithmetic
    # math: a JSONL or Parquet file of question/answer rows
    data: str = ""
    question_key: str = "question"
    answer_key: str = "answer"
    answer_pattern: str = ""  # a regex with one group; empty: the last \boxed{...}
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    # Wall-clock seconds one symbolic comparison may take before its worker process is killed and
    # the answer scores 0 (counted in reward/grader_timeouts); see rzero.envs.grading.
    grader_timeout_s: float = Field(DEFAULT_GRADER_TIMEOUT_S, gt=0, le=600)
    # tool_calc
    max_turns: int = Field(3, ge=1)
    tool_fraction: float = Field(0.25, ge=0, le=1)  # warm-start answers that go through the tool
    show_tools: bool = False  # put the tools' JSON schemas in a system turn (long for tiny models)
    tools: dict[Literal["calculator", "python"], ToolSection] = {"calculator": ToolSection()}
    rollout_delay_s: float = Field(0.0, ge=0)  # artificial latency before each reward (a stand-in for slow envs)

    @model_validator(mode="after")
    def _keys_of_this_env(self) -> EnvSection:
        foreign = set().union(*(spec.keys for spec in ENVS.values())) - ENVS[self.name].keys
        defaults = EnvSection.model_construct()
        changed = sorted(k for k in foreign if getattr(self, k) != getattr(defaults, k))
        if changed:
            raise ValueError(f"{', '.join(changed)} not used by env.name = {self.name!r}")
        if self.name == "math" and not self.data:
            raise ValueError("env.name = 'math' needs env.data (a .jsonl or .parquet file)")
        if self.name == "tool_calc" and not self.tools:
            raise ValueError("env.name = 'tool_calc' needs at least one tool in env.tools")
        return self


class RolloutSection(Section):
    # Where rollout workers run, each with its own engine and environment: "process", a process
    # per worker (the engine does not take turns on the GIL with the trainer); "local",
    # threads of the trainer's process; "ray", one Ray actor per worker (docs/distributed.md);
    # "auto" (the default), "process" for a CPU model and "local" for a GPU one.
    backend: Literal["auto", "process", "local", "ray"] = "auto"
    max_lag: int = Field(2, ge=0)  # 0: the synchronous baseline
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_tokens: int = Field(8, ge=1)
    # Above 1 on purpose for the default job: the warm-started model knows most sums but samples
    # them with too much entropy; RL has to find and sharpen the right answers.
    temperature: float = Field(1.6, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    workers: int = Field(1, ge=1)
    # The rollout engines' dtype; empty: model.dtype. A different one is the common-stack control
    # (engines sample in bf16 while the trainer scores in fp32): a kernel mismatch IS cannot fix.
    engine_dtype: Literal["", *DTYPE_NAMES] = ""
    cpus_per_worker: float = Field(1.0, ge=0)  # Ray resources of each rollout actor
    gpus_per_worker: float = Field(0.0, ge=0)
    recompute_on_update: bool = True
    # Decode steps an engine may run in one model call when every running sequence only decodes
    # (Engine.decode_steps_per_call; the same tokens and logprobs as one step at a time). Weights
    # load between calls, so a load can wait this many decode steps.
    decode_steps_per_call: int = Field(16, ge=1)
    # Engines load new weights once they are this many versions behind the trainer. Each load
    # recomputes the K/V of every sequence in flight (exact μ), so in async runs with many long
    # episodes a larger interval buys throughput for a little lag (at most max_lag).
    weight_update_interval: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _updates_within_lag(self) -> RolloutSection:
        if self.weight_update_interval > max(1, self.max_lag):
            raise ValueError(
                f"rollout.weight_update_interval ({self.weight_update_interval}) must be <= max(1, max_lag) "
                f"({max(1, self.max_lag)}): rollouts sampled with older weights could never be trained on"
            )
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
    share_prompts: bool = True  # a group's prompt runs once in the trainer's forward, not once per sample
    gradient_checkpointing: bool = False  # recompute each layer in backward: less memory, more time
    advantage_std_norm: bool = False
    leave_one_out: bool = False
    # Controls: ppo_clip epsilon, tis truncation C, icepop band [alpha, beta]
    clip_eps: float = Field(0.2, gt=0)
    tis_cap: float = Field(2.0, gt=0)
    icepop_low: float = Field(0.5, gt=0)
    icepop_high: float = Field(2.0, gt=0)
    # Data-parallel trainer processes (Ray actors; torch.distributed gloo on CPU). "ordered" sums the
    # micro-batch gradients in global micro-batch order: bitwise the same run for any world_size.
    # "allreduce" is the fast, non-exact option (docs/distributed.md).
    world_size: int = Field(1, ge=1)
    grad_reduce: Literal["ordered", "allreduce"] = "ordered"
    gpus_per_rank: float = Field(0.0, ge=0)
    # Stop the run when this many updates in a row were skipped (non-finite loss or gradient):
    # the model has diverged and every further step only burns the budget.
    max_consecutive_skips: int = Field(10, ge=1)


class DiagnosticsSection(Section):
    decompose: bool = True  # keep the last max_lag + 1 weight versions to split log w


class RunSection(Section):
    seed: int = 0
    checkpoint_every: int = Field(20, ge=1)
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "rzero"
    # rollouts.jsonl: what each step trained on, for `rzero train --replay` and exact resume
    # (rzero.run.record; docs/design.md gives its size per step).
    record_rollouts: bool = True
    # Torch intra-op threads of the run's process. 0: by model size, one below hidden size 1024
    # (faster on tiny models) else PyTorch's default, but one for invariant fp32, whose bits need
    # it from hidden size 1024 on (rzero.ops.device.cpu_threads).
    threads: int = Field(0, ge=0)


class ClusterSection(Section):
    # Empty: a private local Ray instance, started for the run and shut down after it. "auto" or
    # "ray://host:port": join an existing cluster (docs/distributed.md).
    address: str = ""
    connect_timeout_s: float = Field(30.0, gt=0)


class RunConfig(Section):
    model: ModelSection = ModelSection()
    warm_start: WarmStartSection = WarmStartSection()
    env: EnvSection = EnvSection()
    rollout: RolloutSection = RolloutSection()
    train: TrainSection = TrainSection()
    diagnostics: DiagnosticsSection = DiagnosticsSection()
    run: RunSection = RunSection()
    cluster: ClusterSection = ClusterSection()

    @model_validator(mode="after")
    def _distributed_needs_ray(self) -> RunConfig:
        if self.rollout.backend != "ray" and (self.rollout.gpus_per_worker or self.rollout.cpus_per_worker != 1.0):
            raise ValueError("rollout.cpus_per_worker / gpus_per_worker are Ray resources: set rollout.backend = 'ray'")
        if self.model.device != "cpu" and (self.rollout.backend in ("ray", "process") or self.train.world_size > 1):
            # Not built yet: the Ray actors, worker processes and trainer ranks place their models on the CPU.
            raise ValueError(
                f"model.device = {self.model.device!r} runs in one process only: "
                "use rollout.backend = 'local' (or 'auto') and train.world_size = 1, or model.device = 'cpu'"
            )
        return self


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


def _drop_removed_keys(data: dict[str, Any]) -> None:
    """Keys older versions wrote into run configs: accepted (so old runs resume) when they agree
    with today's meaning, and dropped."""
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and "mode" in rollout:
        mode = rollout.pop("mode")
        if mode == "sync" and rollout.get("max_lag", RolloutSection.model_fields["max_lag"].default) != 0:
            raise ConfigError("rollout.mode = 'sync' (a removed key) requires rollout.max_lag = 0; set max_lag = 0 instead")
        warnings.warn("rollout.mode is no longer used and was ignored: rollout.max_lag = 0 is the synchronous baseline", stacklevel=3)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        data, source = read_toml(Path(path), ConfigError), str(path)
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        key, value = item.split("=", 1)
        *tables, name = key.strip().split(".")  # nested tables too: env.tools.calculator.latency_s
        node = data
        for depth, table in enumerate(tables):
            node = node.setdefault(table, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(tables[: depth + 1])} is not a section")
        node[name] = _parse_value(value.strip())
    if overrides:
        source += " with --set " + " ".join(overrides)
    _drop_removed_keys(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, source)) from None


def config_to_toml(config: RunConfig) -> str:
    import tomli_w

    return tomli_w.dumps(json.loads(config.model_dump_json()))
