"""The results table (terminal and Markdown) and the result files, each written atomically.

  results.json   the run's settings, each benchmark's resolved settings and metrics, the average
  samples.jsonl  one line per problem: prompt, reference answer, every sample's text and reward
  results.md     the table in Markdown
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from rzero.files import atomic_write_text

if TYPE_CHECKING:
    from rzero.eval.run import BenchmarkResult

HEADER = ["benchmark", "problems", "n", "k", "pass@1", "pass@k", "tokens", "failures", "timeouts"]
LEGEND = (
    "pass@1, pass@k in %; n: samples per problem; tokens: mean completion tokens per sample; "
    "failures: samples whose env raised (scored 0); timeouts: samples whose grader gave up (scored 0); "
    "average: unweighted mean over benchmarks"
)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def table_rows(results: list[BenchmarkResult], average: dict) -> list[list[str]]:
    rows = []
    for r in results:
        m = r.metrics
        rows.append([
            r.plan.name,
            str(m["problems"]),
            str(r.plan.sampling.samples),
            str(m["k"]),
            _percent(m["pass@1"]),
            _percent(m["pass@k"]),
            f"{m['mean_completion_tokens']:.1f}",
            str(m["reward_failures"]),
            str(m["grader_timeouts"]),
        ])
    k = "-" if average["k"] is None else str(average["k"])
    rows.append(["average", str(average["problems"]), "", k, _percent(average["pass@1"]),
                 _percent(average["pass@k"]), "", str(average["reward_failures"]), str(average["grader_timeouts"])])
    return rows


def results_table(results: list[BenchmarkResult], average: dict) -> Table:
    table = Table(title="rzero eval", caption=LEGEND)
    for i, name in enumerate(HEADER):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=i == 0)
    rows = table_rows(results, average)
    for row in rows[:-1]:
        table.add_row(*row)
    table.add_row(*rows[-1], style="bold", end_section=True)
    return table


def results_markdown(config: dict, results: list[BenchmarkResult], average: dict) -> str:
    lines = [
        "# rzero eval",
        "",
        (
            f"model `{config['model']}`, suite `{config['suite']}`, numerics {config['numerics']}, "
            f"dtype {config['dtype']}, seed {config['seed']}"
        ),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(HEADER))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results, average)]
    lines += ["", LEGEND + ".", ""]
    return "\n".join(lines)


def write_results(out: Path, config: dict, results: list[BenchmarkResult], average: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": config,
        "benchmarks": [
            {
                "name": r.plan.name,
                "task": r.plan.task,
                "data": r.plan.data,
                "num_tasks": r.plan.num_tasks,
                "env_seed": r.plan.env_seed,
                "sampling": r.plan.sampling.model_dump(),
                "metrics": r.metrics,
            }
            for r in results
        ],
        "average": average,
    }
    records = [
        {"benchmark": r.plan.name, "num_correct": p.num_correct, **asdict(p)} for r in results for p in r.problems
    ]
    files = {
        "results.json": json.dumps(summary, indent=2) + "\n",
        "samples.jsonl": "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records),
        "results.md": results_markdown(config, results, average),
    }
    for name, text in files.items():
        atomic_write_text(out / name, text)
    return [out / name for name in files]
