"""The suite file: which benchmarks to run, on which task, with which sampling settings.

A TOML file with an optional `[defaults]` table of sampling settings and one `[[benchmarks]]`
table per benchmark. A benchmark table is flat: `name`, `task` (an env name), any key of that
env's config section (rzero.config.EnvSection), sampling overrides, `num_tasks`, `env_seed`.
Everything is checked, data files included, before a model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from rzero.config import EnvSection, Section
from rzero.files import read_toml
from rzero.envs import ENV_NAMES, ENVS, make_env


class SuiteError(ValueError):
    """A suite file problem, phrased for the user (file, benchmark, key, what is wrong)."""


class Sampling(Section):
    """Sampling settings; None inherits: command line > benchmark > [defaults] > BUILTIN."""

    k: int | None = Field(None, ge=1)  # the k of pass@k
    samples: int | None = Field(None, ge=1)  # samples per problem (n); default k
    temperature: float | None = Field(None, ge=0)  # 0: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)

    def over(self, base: Sampling) -> Sampling:
        """These settings where set, `base`'s elsewhere."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


BUILTIN = Sampling(k=1, temperature=0.6, top_p=1.0, top_k=0, max_tokens=1024)

# Env keys a benchmark may set; the rollout delay is a training stand-in, not a task property.
_ENV_KEYS = set(EnvSection.model_fields) - {"name", "rollout_delay_s"}


class Benchmark(Section):
    name: str = Field(min_length=1)
    env: EnvSection
    sampling: Sampling = Sampling()
    num_tasks: int | None = Field(None, ge=1)  # synthetic tasks: required; data tasks: a cap
    env_seed: int = 0  # the env's seed: which problems a synthetic task generates

    @model_validator(mode="before")
    @classmethod
    def _split_flat_table(cls, data: Any) -> Any:
        """Sort the flat table's keys into the env section and the sampling overrides."""
        if not isinstance(data, dict):
            return data
        for nested in ("env", "sampling"):
            if nested in data:
                raise ValueError(f"unknown key {nested!r}")
        if "task" not in data:
            raise ValueError(f"missing key 'task' ({', '.join(ENV_NAMES)})")
        rest = dict(data)
        env = {"name": rest.pop("task")} | {key: rest.pop(key) for key in list(rest) if key in _ENV_KEYS}
        sampling = {key: rest.pop(key) for key in list(rest) if key in Sampling.model_fields}
        return rest | {"env": env, "sampling": sampling}


class Suite(Section):
    defaults: Sampling = Sampling()
    benchmarks: list[Benchmark] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Suite:
        names = [b.name for b in self.benchmarks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"benchmark names must be unique; repeated: {', '.join(repeated)}")
        return self


@dataclass(frozen=True)
class BenchmarkPlan:
    """One benchmark, resolved: its env built, its problem count and sampling settled."""

    name: str
    task: str
    data: str | None  # the resolved data file of a data task
    env: Any
    num_tasks: int
    env_seed: int
    sampling: Sampling  # every field set; samples >= k


def _describe(err: ValidationError, path: Path, raw: dict) -> str:
    """One line per problem, naming the benchmark (by name where it has one) and the key."""
    lines = [f"invalid suite {path}:"]
    for e in err.errors():
        loc = list(e["loc"])
        where = "suite"
        if loc[:1] == ["benchmarks"] and len(loc) > 1:
            i = loc[1]
            entry = raw["benchmarks"][i] if isinstance(raw.get("benchmarks"), list) else {}
            name = entry.get("name") if isinstance(entry, dict) else None
            where = f"benchmark {name!r}" if name else f"benchmarks[{i}]"
            loc = loc[2:]
        elif loc[:1] == ["defaults"]:
            where, loc = "[defaults]", loc[1:]
        if loc == ["env", "name"]:
            loc = ["task"]
        loc = [str(p) for p in loc if p not in ("env", "sampling")]
        message = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        key = f" key {'.'.join(loc)!r}:" if loc else ""
        lines.append(f"  {where}:{key} {message}")
    return "\n".join(lines)


def _read(path: Path) -> Suite:
    raw = read_toml(path, SuiteError, what="suite file")
    try:
        return Suite.model_validate(raw)
    except ValidationError as err:
        raise SuiteError(_describe(err, path, raw)) from None


def load_suite(path: str | Path, overrides: Sampling | None = None, limit: int | None = None) -> list[BenchmarkPlan]:
    """Validate the suite and build each benchmark's env; `overrides` (the command line's sampling
    settings) win over the suite's, `limit` caps problems per benchmark."""
    if limit is not None and limit < 1:
        raise SuiteError(f"limit must be >= 1, got {limit}")
    path = Path(path)
    suite = _read(path)
    plans = []
    for b in suite.benchmarks:
        where = f"{path}: benchmark {b.name!r}"
        sampling = (overrides or Sampling()).over(b.sampling.over(suite.defaults.over(BUILTIN)))
        sampling = sampling.model_copy(update={"samples": sampling.samples or sampling.k})
        if sampling.samples < sampling.k:
            raise SuiteError(f"{where}: key 'samples': {sampling.samples} samples per problem cannot give pass@{sampling.k}")
        section, data = b.env, None
        if section.name == "math":
            # Relative data paths are relative to the suite file, so a suite travels with its data.
            data_path = path.parent / section.data
            if not data_path.is_file():
                raise SuiteError(f"{where}: key 'data': file {data_path} does not exist")
            data = str(data_path)
            section = section.model_copy(update={"data": data})
        try:
            env = make_env(section, seed=b.env_seed)
        except (ValueError, FileNotFoundError) as err:
            raise SuiteError(f"{where}: {err}") from None
        if ENVS[section.name].synthetic:  # generated problems: the suite says how many
            if b.num_tasks is None:
                raise SuiteError(f"{where}: key 'num_tasks': required for task {section.name!r} (it generates problems)")
            num_tasks = b.num_tasks
        else:
            num_tasks = len(env)
            if b.num_tasks is not None and b.num_tasks > num_tasks:
                raise SuiteError(f"{where}: key 'num_tasks': {b.num_tasks} is more than the {num_tasks} rows of {data}")
            num_tasks = b.num_tasks or num_tasks
        if limit is not None:
            num_tasks = min(num_tasks, limit)
        plans.append(BenchmarkPlan(b.name, section.name, data, env, num_tasks, b.env_seed, sampling))
    return plans
