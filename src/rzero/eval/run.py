"""Sampling a suite on one engine, and the `rzero eval` command.

All problems of a benchmark are queued at once and the engine's continuous batching works
through them (at most max_num_seqs at a time). Episodes go through the same EpisodeRunner as RL
rollouts, so multi-turn tasks (tool calls) are evaluated exactly as they are trained.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from rzero.engine import Engine, SamplingParams
from rzero.eval.metrics import Problem, Sample, average_metrics, benchmark_metrics
from rzero.eval.report import results_table, write_results
from rzero.eval.suite import BenchmarkPlan, Sampling, load_suite
from rzero.ops import resolve_device
from rzero.ops.device import intra_op_threads, model_dir_threads
from rzero.rollout.episodes import AsyncLoop, Episode, EpisodeRunner


@dataclass
class BenchmarkResult:
    plan: BenchmarkPlan
    problems: list[Problem]
    metrics: dict


def problem_seed(seed: int, benchmark: str, index: int) -> int:
    """The sampling seed of one problem, from (run seed, benchmark name, problem index) only:
    adding, dropping or reordering benchmarks, or capping one, changes no other problem's samples."""
    digest = hashlib.sha256(f"{seed}/{benchmark}/{index}".encode()).digest()
    # 30 bits: the runner and the engine multiply it further and torch takes 64-bit seeds.
    return int.from_bytes(digest[:4], "big") >> 2


def run_benchmark(
    engine: Engine, loop: AsyncLoop, plan: BenchmarkPlan, seed: int, advance: Callable[[], None] = lambda: None
) -> list[Problem]:
    """Sample every problem of `plan` `sampling.samples` times; `advance` is called per sample."""
    s = plan.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, n=s.samples)
    tasks = [plan.env.task(i) for i in range(plan.num_tasks)]
    problems = [Problem(t.index, t.prompt, t.answer, [None] * s.samples) for t in tasks]
    remaining = len(tasks) * s.samples

    def finished(episode: Episode) -> None:  # on the loop thread
        nonlocal remaining
        sample = Sample(
            episode.text,
            episode.reward,
            sum(episode.mask),
            episode.finish_reason,
            episode.failed,
            episode.error,
            episode.grader_timeout,
        )
        problems[episode.key].samples[episode.sample] = sample
        remaining -= 1
        advance()

    runner = EpisodeRunner(engine, plan.env, loop, finished)
    for task in tasks:
        try:
            runner.add(task.index, task, replace(params, seed=problem_seed(seed, plan.name, task.index)))
        except ValueError as err:  # e.g. a prompt longer than the model's context
            raise ValueError(f"benchmark {plan.name!r}, problem {task.index}: {err}") from None
    runner.run_until(lambda: remaining == 0)
    return problems


def evaluate(engine: Engine, plans: list[BenchmarkPlan], seed: int, progress: bool = True) -> list[BenchmarkResult]:
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not progress,
    )
    loop = AsyncLoop("eval-env-loop")
    results = []
    try:
        with bar:
            for plan in plans:
                row = bar.add_task(plan.name, total=plan.num_tasks * plan.sampling.samples)
                problems = run_benchmark(engine, loop, plan, seed, functools.partial(bar.advance, row))
                results.append(BenchmarkResult(plan, problems, benchmark_metrics(problems, plan.sampling.k)))
    finally:
        loop.close()
    return results


def _command_line_sampling(args) -> Sampling:
    values = {
        "k": args.k,
        "samples": args.samples,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
    }
    try:
        return Sampling(**values)
    except ValidationError as err:
        raise ValueError(
            "; ".join(f"--{str(e['loc'][0]).replace('_', '-')}: {e['msg']}" for e in err.errors())
        ) from None


def main(args) -> int:
    overrides = _command_line_sampling(args)
    plans = load_suite(args.suite, overrides, limit=args.limit)  # every check before the model loads
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: not a model directory (no config.json)")
    device = resolve_device(getattr(args, "device", "cpu"))  # a clear error before the model loads
    # A model directory loads on the CPU by default: name the device only when it is another one.
    placement = {} if device.type == "cpu" else {"device": device}
    with intra_op_threads(model_dir_threads(model_dir, args.threads, args.dtype, args.numerics)):
        engine = Engine(
            model_dir, numerics=args.numerics, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=args.seed, **placement
        )
        results = evaluate(engine, plans, args.seed)
    average = average_metrics([r.metrics for r in results])
    config = {
        "model": str(model_dir),
        "suite": str(args.suite),
        "numerics": args.numerics,
        "dtype": args.dtype,
        "seed": args.seed,
        "limit": args.limit,
        "command_line_sampling": overrides.model_dump(exclude_none=True),
    }
    Console().print(results_table(results, average))
    if args.out:
        for path in write_results(Path(args.out), config, results, average):
            print(f"wrote {path}")
    return 0
