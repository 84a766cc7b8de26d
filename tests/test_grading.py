"""Bounded math grading: hostile answers score 0 within the timeout, the worker pool recovers,
ordinary answers grade exactly as the raw math-verify call does, workers never outlive their
process, and a math RL run whose policy emits hostile answers keeps training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rzero.config import ConfigError, load_config
from rzero.envs import GraderTimeout, make_env
from rzero.envs import grading
from rzero.envs.base import Task
from rzero.envs.grading import astronomical, grade, verify_unbounded
from rzero.envs.math import MathEnv, answers_match
from rzero.eval.suite import load_suite
from rzero.run.loop import train

FIXTURE = Path(__file__).parent / "fixtures" / "math_small.jsonl"
SRC = str(Path(grading.__file__).resolve().parents[2])
TIMEOUT_S = 1.0
# Above the timeout: killing a worker (the kernel frees what it allocated) and, when the call
# lands on a just-replaced worker, that worker's startup on a busy machine.
MARGIN_S = 2.5

TOWER = "9^{9^{9^{9}}}"
SLOW_PRODUCT = "\\cdot".join(["9^{999999}"] * 33)  # 490 characters, no single power too large
HOSTILE = [  # (answer, graded how)
    (TOWER, "refused"),
    ("10^{10^{10^{10}}}!", "refused"),
    ("1000000!", "refused"),
    (SLOW_PRODUCT, "timeout"),
    ("*".join(["(x+1)^{99}"] * 40), "timeout"),
    ("(x+1)^{100000}", "timeout"),
    ("\\underbrace{" + "{" * 3000 + "x" + "}" * 3000 + "}", "zero"),  # over the length cap
    ("\\underbrace{" + "{" * 240 + "x" + "}" * 240 + "}", "zero"),
    ("\\frac{1}{", "zero"),
    ("}{\\sqrt[", "zero"),
    ("\\begin{matrix}", "zero"),
    ("x^^2 @@ \\left(", "zero"),
]


@pytest.fixture(scope="module")
def env() -> MathEnv:
    return MathEnv(FIXTURE, grader_timeout_s=TIMEOUT_S)


def score(env: MathEnv, answer: str, reference: str = "1") -> tuple[float | str, float]:
    start = time.perf_counter()
    try:
        result = env.reward(Task(0, "q", reference), "\\boxed{" + answer + "}")
    except GraderTimeout as err:
        result = "refused" if "refused" in str(err) else "timeout"
    return result, time.perf_counter() - start


@pytest.mark.parametrize("answer, how", HOSTILE, ids=[f"{i}-{how}" for i, (_, how) in enumerate(HOSTILE)])
def test_hostile_answer_scores_zero_within_the_timeout(env, answer, how):
    result, elapsed = score(env, answer)
    # "zero" answers are cheap to reject; on a busy machine one may still run into the timeout.
    assert result in ((0.0, "timeout") if how == "zero" else (how,))
    assert elapsed < TIMEOUT_S + MARGIN_S
    if how != "timeout":  # (one timeout is enough: see below)
        assert answers_match("1", answer, TIMEOUT_S) is False  # the never-raising form
    # The pool recovered: an ordinary symbolic grade right after works.
    assert score(env, "\\sqrt{8}", "2\\sqrt{2}")[0] == 1.0


def test_the_pool_bounds_a_tower_even_without_the_prefilter():
    start = time.perf_counter()
    with pytest.raises(GraderTimeout, match="longer than 1 s"):
        grading.pool().check("1", TOWER, TIMEOUT_S)
    assert time.perf_counter() - start < TIMEOUT_S + MARGIN_S
    assert grading.pool().check("\\frac{1}{2}", "\\dfrac{2}{4}", TIMEOUT_S) is True
    assert answers_match("1", "(x+1)^{100000}", TIMEOUT_S) is False  # a timeout, never raised


def started_pool() -> grading.GradingPool:
    """The pool, every worker past its startup (earlier tests leave fresh replacements)."""
    pool = grading.pool()
    for w in pool._workers:
        w.call("1", "1", 30)
    return pool


def test_a_worker_killed_from_outside_is_replaced():
    pool = started_pool()
    for w in list(pool._workers):
        os.kill(w.process.pid, signal.SIGKILL)
        w.process.wait()
    outcomes = []
    for _ in range(len(pool._workers) + 1):
        try:
            outcomes.append(pool.check("2\\sqrt{2}", "\\sqrt{8}", 30))
        except GraderTimeout as err:
            outcomes.append(str(err))
    assert outcomes[-1] is True and all(o is True or "died" in o for o in outcomes)
    assert all(w.process.poll() is None for w in pool._workers)


def test_workers_have_an_address_space_limit():
    for w in started_pool()._workers:
        limits = Path(f"/proc/{w.process.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
        soft = int(line.split()[3])
        assert grading.WORKER_MEMORY_BYTES < soft < grading.WORKER_MEMORY_BYTES + (1 << 30)


@pytest.mark.parametrize(
    "reference, candidate, expected",
    [
        ("\\frac{1}{2}", "0.5", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1/3", "0.333333", True),  # math-verify's rounding of decimals, kept
        ("\\frac{1}{2}", "\\frac{1}{3}", False),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("2\\sqrt{2}", "\\sqrt{2}", False),
        ("(x+1)^2", "x^2+2x+1", True),
        ("(x+1)^2", "x^2+x+1", False),
        ("(1, 2)", "(1,2)", True),
        ("(1, 2)", "(2, 1)", False),
        ("[0, 1)", "[0,1)", True),
        ("[0, 1)", "[0, 1]", False),
        ("\\{-2, 2\\}", "\\{2, -2\\}", True),
        ("42", "42.0", True),
        ("42", "  42 ", True),
        ("-7", "7", False),
        ("1024", "2^{10}", True),
        ("256", "2^{2^{3}}", True),  # a small tower is graded, not refused
    ],
)
def test_ordinary_answers_grade_as_before(reference, candidate, expected):
    assert verify_unbounded(reference, candidate) is expected  # what the math env used to do
    assert answers_match(reference, candidate, TIMEOUT_S) is expected


def test_plain_numbers_never_reach_the_workers(monkeypatch):
    def no_pool():
        raise AssertionError("a plain number went to a worker")

    monkeypatch.setattr(grading, "pool", no_pool)
    pairs = [("42", "42"), ("42", "43"), ("-5", "-5"), ("\\frac{3}{4}", "0.75"), ("3/4", "\\dfrac{6}{8}"),
             ("\\frac{1}{3}", "0.3333"), ("0.125", "1/8"), ("12.5", "12.50"), ("7", "7.01"), ("\\frac{2}{3}", "2/5")]
    for reference, candidate in pairs:
        assert grade(reference, candidate) is verify_unbounded(reference, candidate), (reference, candidate)


def test_astronomical_literals():
    for text in [TOWER, "10^{10^{7}}", "1^{9^{9^{9}}}", "x^{2^{99999999}}+1", "100001!", "9" * 5000 + "!"]:
        assert astronomical(text), text
    for text in ["2^{10}", "2^{2^{3}}", "10^{10^{6}}", "100000!", "(x+1)^{100000}", "3.14", SLOW_PRODUCT]:
        assert not astronomical(text), text
    # A reference written as a tower is compared, not refused.
    assert grade("2^{2^{30}}", "2^{2^{30}}", TIMEOUT_S) is True


def test_grader_timeout_is_configured_and_checked(tmp_path):
    config = load_config(None, ["env.name=math", f"env.data={FIXTURE}", "env.grader_timeout_s=2.5"])
    assert make_env(config.env).grader_timeout_s == 2.5
    assert load_config(None, ["env.name=math", f"env.data={FIXTURE}"]).env.grader_timeout_s == grading.DEFAULT_TIMEOUT_S
    with pytest.raises(ConfigError, match=r"env\.grader_timeout_s: Input should be greater than 0"):
        load_config(None, ["env.name=math", f"env.data={FIXTURE}", "env.grader_timeout_s=0"])
    with pytest.raises(ConfigError, match="grader_timeout_s not used by env.name = 'arithmetic'"):
        load_config(None, ["env.grader_timeout_s=2"])
    with pytest.raises(ValueError, match="grader_timeout_s must be > 0"):
        MathEnv(FIXTURE, grader_timeout_s=-1)
    suite = tmp_path / "suite.toml"  # and per benchmark in an eval suite
    suite.write_text(f'[[benchmarks]]\nname = "m"\ntask = "math"\ndata = "{FIXTURE}"\ngrader_timeout_s = 2.5\n')
    (plan,) = load_suite(suite)
    assert plan.env.grader_timeout_s == 2.5


# ------------------------------------------------------------ no orphan workers

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from rzero.envs import grading

    pool = grading.pool()
    pool.check("1", "1", 30)
    print(*[w.process.pid for w in pool._workers], flush=True)
    # One worker busy on an endless comparison, from a daemon thread as a rollout worker would.
    threading.Thread(target=lambda: pool.check("1", sys.argv[1], float(sys.argv[2])), daemon=True).start()
    time.sleep(0.5)
    print("busy", flush=True)
    sys.stdin.readline()  # the test checks the workers first, then lets the script end (or kills it)
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has ended


def start_script(*args: str) -> tuple[subprocess.Popen, list[int]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert proc.stdout.readline() == "busy\n" and pids and all(alive(p) for p in pids)
    return proc, pids


def wait_gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def test_workers_end_with_a_normal_exit():
    proc, pids = start_script(TOWER, "60")
    proc.stdin.write("exit\n")  # the script ends while a worker computes the tower
    proc.stdin.flush()
    start = time.perf_counter()
    assert proc.wait(timeout=30) == 0
    assert time.perf_counter() - start < 10  # no hang at interpreter exit
    assert wait_gone(pids, 5)


def test_workers_end_when_their_process_is_killed():
    proc, pids = start_script(TOWER, str(TIMEOUT_S))
    proc.kill()  # no atexit: the idle worker reads EOF, the busy one hits its CPU-time limit
    proc.wait()
    assert wait_gone(pids, 15)


# ------------------------------------------------------------ an RL run keeps going


class HostileMathEnv(MathEnv):
    """A policy that answers a third of the tasks with a tower (refused at once), a third with a
    product too slow to grade (cut off by the timeout), and a third with the reference (1.0)."""

    def reward(self, task, completion):
        answer = [TOWER, SLOW_PRODUCT, task.answer][task.index % 3]
        return super().reward(task, "\\boxed{" + answer + "}")


def test_math_rl_run_keeps_training_through_hostile_answers(tmp_path):
    overrides = ["env.name=math", f"env.data={FIXTURE}", "env.grader_timeout_s=0.5", "warm_start.steps=0",
                 "rollout.prompts_per_step=3", "rollout.group_size=2", "rollout.max_tokens=4", "rollout.max_lag=1",
                 "train.steps=3", "run.tensorboard=false"]
    config = load_config(None, overrides)
    env = HostileMathEnv(FIXTURE, grader_timeout_s=0.5)
    out = train(config, tmp_path / "run", progress=False, env=env, log=lambda *a: None)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    # 9 groups of 2 trained on (and more sampled): about two thirds of them graded out.
    assert metrics[-1]["reward/grader_timeouts"] >= 8 and metrics[-1]["rollout/reward_failures"] == 0
    assert 0 < sum(m["reward/mean"] for m in metrics) / 3 < 1  # the right answers still score
