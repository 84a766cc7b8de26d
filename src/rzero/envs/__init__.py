"""Tasks and tools the rollouts run in (the interface is in base.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rzero.envs.base import Env, GraderTimeout, Reference, Task


def _arithmetic(section, seed: int) -> Env:
    from rzero.envs.arithmetic import ArithmeticEnv

    return ArithmeticEnv(section.digits, tuple(section.operations), seed=seed)


def _math(section, seed: int) -> Env:
    from rzero.envs.math import MathEnv

    return MathEnv(
        section.data,
        question_key=section.question_key,
        answer_key=section.answer_key,
        answer_pattern=section.answer_pattern or None,
        prompt_template=section.prompt_template,
        grader_timeout_s=section.grader_timeout_s,
        seed=seed,
    )


def _tool_calc(section, seed: int) -> Env:
    from rzero.envs.tool_calc import ToolCalcEnv
    from rzero.envs.tools import Latency, calculator, python_tool

    builders = {"calculator": calculator, "python": python_tool}
    tools = [
        builders[name](
            latency=Latency(t.latency, t.latency_s, t.latency_low_s, t.latency_high_s, t.latency_sigma),
            failure_rate=t.failure_rate,
            timeout_s=t.timeout_s,
        )
        for name, t in section.tools.items()
    ]
    return ToolCalcEnv(
        (section.digits, section.digits),
        tools,
        max_turns=section.max_turns,
        tool_fraction=section.tool_fraction,
        show_tools=section.show_tools,
        seed=seed,
    )


@dataclass(frozen=True)
class EnvSpec:
    build: Callable[..., Env]  # (the [env] config section, seed) -> Env
    keys: frozenset[str]  # the [env] keys it reads, besides `name` and the keys every env shares
    synthetic: bool  # generates its problems (an eval suite says how many) rather than reading a dataset


# The one registry of environments; rzero.config and the eval suites take their choices from here.
ENVS: dict[str, EnvSpec] = {
    "arithmetic": EnvSpec(_arithmetic, frozenset({"digits", "operations"}), synthetic=True),
    "math": EnvSpec(
        _math,
        frozenset({"data", "question_key", "answer_key", "answer_pattern", "prompt_template", "grader_timeout_s"}),
        synthetic=False,
    ),
    "tool_calc": EnvSpec(
        _tool_calc, frozenset({"digits", "max_turns", "tool_fraction", "show_tools", "tools"}), synthetic=True
    ),
}
ENV_NAMES = tuple(ENVS)


def make_env(section, seed: int = 0) -> Env:
    """The environment an `[env]` config section describes (rzero.config.EnvSection)."""
    if section.name not in ENVS:
        raise ValueError(f"unknown env {section.name!r}; choose one of {', '.join(ENV_NAMES)}")
    return ENVS[section.name].build(section, seed)


__all__ = ["ENVS", "ENV_NAMES", "Env", "EnvSpec", "GraderTimeout", "Reference", "Task", "make_env"]
