"""Math grading throughput on ordinary answers, before and after bounding it, side by side.

before: the unbounded in-process math-verify call the math env used to make
        (rzero.envs.grading.verify_unbounded: parse both, verify, no timeout).
after:  rzero.envs.grading.grade: cheap cases in-process, the rest in worker processes with a
        timeout and a memory limit.

The answers are generated (seeded): integers, fractions (\\frac and a/b), decimals, square roots,
half of them right in another form or verbatim, half wrong. Both paths grade the same answers and
every verdict must agree. Each repetition grades fresh answers, the two paths in alternating
order, after both graded a warm-up set (the first sympy calls of a process are slow). Then a few
hostile answers are graded with a short timeout.

    python benchmarks/bench_grading.py [--answers 3000] [--reps 3] [--threads 1 4] [--hostile-timeout 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from rzero.envs.base import GraderTimeout
from rzero.envs.grading import DEFAULT_TIMEOUT_S, WORKERS, grade, verify_unbounded

HOSTILE = {
    "9^{9^{9^{9}}}": "1",
    "10^{10^{10^{10}}}!": "1",
    "(x+1)^{99}*" * 39 + "(x+1)^{99}": "1",
    "\\cdot".join(["9^{999999}"] * 33): "1",
    "(x+1)^{100000}": "1",
    "\\underbrace{" + "{" * 240 + "x" + "}" * 240 + "}": "1",
}


def answers(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(reference, candidate) pairs; about half of the candidates are right."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        a, b, right = rng.randint(1, 999), rng.randint(2, 97), rng.random() < 0.5
        kind = i % 5
        if kind == 0:  # integers
            pairs.append((str(a), str(a) if right else str(a + rng.choice([-2, -1, 1, 10]))))
        elif kind == 1:  # fractions
            ref = f"\\frac{{{a}}}{{{b}}}"
            pairs.append((ref, rng.choice([ref, f"{a}/{b}", f"\\dfrac{{{2 * a}}}{{{2 * b}}}"]) if right
                          else f"\\frac{{{a + 1}}}{{{b}}}"))
        elif kind == 2:  # decimals
            ref = f"{a / 8:g}"
            pairs.append((ref, rng.choice([ref, f"\\frac{{{a}}}{{8}}", f"{a / 8:.4f}"]) if right
                          else f"{a / 8 + 0.5:g}"))
        elif kind == 3:  # square roots
            ref = f"{a}\\sqrt{{{b}}}"
            pairs.append((ref, rng.choice([ref, f"\\sqrt{{{a * a * b}}}"]) if right else f"{a + 1}\\sqrt{{{b}}}"))
        else:  # negative integers
            pairs.append((f"-{a}", f"-{a}" if right else f"{a}"))
    return pairs


TIMEOUTS = [0]  # ordinary answers the bounded grader gave up on (should stay 0)


def after(reference: str, candidate: str) -> bool:
    try:
        return grade(reference, candidate, DEFAULT_TIMEOUT_S)
    except GraderTimeout:
        TIMEOUTS[0] += 1
        return False


def run(fn, pairs, threads: int) -> tuple[float, list[bool]]:
    start = time.perf_counter()
    if threads == 1:
        verdicts = [fn(r, c) for r, c in pairs]
    else:
        with ThreadPoolExecutor(threads) as ex:
            verdicts = list(ex.map(lambda p: fn(*p), pairs))
    return len(pairs) / (time.perf_counter() - start), verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per row (medians)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4],
                        help="concurrent callers (rewards run on threads)")
    parser.add_argument("--hostile-timeout", type=float, default=1.0)
    args = parser.parse_args()
    warm_up = answers(400, seed=-1)
    run(after, warm_up, max(args.threads))  # starts every worker, and warms them
    run(verify_unbounded, warm_up, 1)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.answers} ordinary answers x {args.reps} reps, "
          f"median answers/s; worker pool: {WORKERS} processes")
    print(f"{'callers':>8} {'before':>10} {'after':>10} {'after/before':>13} {'right':>6} {'agree':>6} {'timeouts':>9}")
    for threads in args.threads:
        rates: dict[str, list[float]] = {"before": [], "after": []}
        right = agree = 0
        TIMEOUTS[0] = 0
        for rep in range(args.reps):
            pairs = answers(args.answers, seed=1000 * threads + rep)  # fresh answers: no warm caches
            order = [("after", after), ("before", verify_unbounded)]
            verdicts = {}
            for name, fn in order[:: 1 if rep % 2 == 0 else -1]:  # interleaved
                rate, verdicts[name] = run(fn, pairs, threads)
                rates[name].append(rate)
            right += sum(verdicts["before"])
            agree += sum(x == y for x, y in zip(verdicts["after"], verdicts["before"]))
        before, bounded = statistics.median(rates["before"]), statistics.median(rates["after"])
        print(f"{threads:>8} {before:>10.0f} {bounded:>10.0f} {bounded / before:>12.2f}x {right:>6} {agree:>6} "
              f"{TIMEOUTS[0]:>9}")
    print(f"hostile answers, timeout {args.hostile_timeout:g} s (before: not run, the first five hang it)")
    for candidate, reference in HOSTILE.items():
        start = time.perf_counter()
        try:
            verdict = str(grade(reference, candidate, args.hostile_timeout))
        except GraderTimeout as err:
            verdict = f"GraderTimeout ({err})"
        label = candidate if len(candidate) <= 24 else f"{candidate[:20]}... ({len(candidate)} chars)"
        print(f"  {label:40} {time.perf_counter() - start:6.2f} s  {verdict}")
    start = time.perf_counter()
    ok = after("\\frac{1}{2}", "\\dfrac{2}{4}")
    print(f"  {'then an ordinary answer':40} {time.perf_counter() - start:6.2f} s  {ok}")


if __name__ == "__main__":
    main()
