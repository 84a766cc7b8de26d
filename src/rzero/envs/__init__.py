"""Tasks and tools the rollouts run in (the interface is in base.py)."""

from __future__ import annotations

from rzero.envs.base import Env, GraderTimeout, Reference, Task


def make_env(section, seed: int = 0) -> Env:
    """The environment an `[env]` config section describes (rzero.config.EnvSection)."""
    if section.name == "arithmetic":
        from rzero.envs.arithmetic import ArithmeticEnv

        return ArithmeticEnv(section.digits, tuple(section.operations), seed=seed)
    if section.name == "math":
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
    if section.name == "tool_calc":
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
    raise ValueError(f"unknown env {section.name!r}")


__all__ = ["Env", "GraderTimeout", "Reference", "Task", "make_env"]
