"""Continuous-batching inference engine: `Engine(model_dir).generate(prompts, SamplingParams(...))`."""

from rzero.engine.engine import Engine
from rzero.engine.sequence import RequestOutput, SamplingParams, StepOutput

__all__ = ["Engine", "RequestOutput", "SamplingParams", "StepOutput"]
