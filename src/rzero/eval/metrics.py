"""pass@1 and pass@k from sampled problems.

pass@k is the chance that at least one of k samples of a problem is correct. With n >= k
samples per problem, c of them correct, the unbiased estimator (Chen et al., 2021, "Evaluating
Large Language Models Trained on Code") is 1 - C(n-c, k) / C(n, k), averaged over problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A sample counts as correct when its reward reaches this (the built-in envs give 0.0 or 1.0).
CORRECT_REWARD = 1.0


@dataclass
class Sample:
    text: str
    reward: float
    tokens: int  # tokens the model generated (environment responses excluded)
    finish_reason: str | None
    failed: bool  # the env raised while stepping or scoring: reward 0
    error: str | None = None
    grader_timeout: bool = False  # the grader gave up on the answer: reward 0

    @property
    def correct(self) -> bool:
        return self.reward >= CORRECT_REWARD


@dataclass
class Problem:
    index: int
    prompt: str
    answer: str
    samples: list[Sample] = field(default_factory=list)

    @property
    def num_correct(self) -> int:
        return sum(s.correct for s in self.samples)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct out of n samples."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per problem, got n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials, no overflow.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def benchmark_metrics(problems: list[Problem], k: int) -> dict[str, float | int]:
    samples = [s for p in problems for s in p.samples]
    if not samples:
        raise ValueError("no samples to score")
    return {
        "problems": len(problems),
        "samples": len(samples),
        "k": k,
        "pass@1": sum(s.correct for s in samples) / len(samples),
        "pass@k": sum(pass_at_k(len(p.samples), p.num_correct, k) for p in problems) / len(problems),
        "mean_reward": sum(s.reward for s in samples) / len(samples),
        "mean_completion_tokens": sum(s.tokens for s in samples) / len(samples),
        "reward_failures": sum(s.failed for s in samples),
        "grader_timeouts": sum(s.grader_timeout for s in samples),
    }


def average_metrics(per_benchmark: list[dict]) -> dict[str, float | int | None]:
    """The macro average: each benchmark weighs the same, whatever its number of problems."""
    ks = {m["k"] for m in per_benchmark}
    k = ks.pop() if len(ks) == 1 else None
    count = len(per_benchmark)
    return {
        "benchmarks": count,
        "problems": sum(m["problems"] for m in per_benchmark),
        "samples": sum(m["samples"] for m in per_benchmark),
        "k": k,
        "pass@1": sum(m["pass@1"] for m in per_benchmark) / count,
        # Averaging pass@k over different k would mix different quantities.
        "pass@k": sum(m["pass@k"] for m in per_benchmark) / count if k is not None else None,
        "reward_failures": sum(m["reward_failures"] for m in per_benchmark),
        "grader_timeouts": sum(m["grader_timeouts"] for m in per_benchmark),
    }
