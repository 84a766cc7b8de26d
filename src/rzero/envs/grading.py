"""Bounded symbolic grading: math-verify in worker processes with a wall-time and memory limit.

math-verify has no usable timeout here (its ``signal.alarm`` only works in the main thread and
rewards are scored on worker threads), and sympy will happily spend hours and gigabytes on a
13-character answer such as ``9^{9^{9^{9}}}``. So ``grade`` answers in one of three ways:

- in-process, at once: normalised strings that are equal, and pairs of plain numbers (integers,
  decimals, ``a/b``, ``\\frac{a}{b}``), whose cost is bounded by their length;
- refused (``GraderTimeout``): a candidate holding an astronomically large literal (an integer
  power tower reaching more than ``MAX_DIGITS`` digits, or n! with n > ``MAX_FACTORIAL``) when the
  reference holds none;
- in a worker process, with a per-call timeout and an address-space limit (RLIMIT_AS): everything
  else. A worker that runs past the timeout is killed and replaced, and the grade raises
  ``GraderTimeout``; the episode runner scores it 0 and counts it.

Workers are fresh interpreters (see ``_Worker``), started on first use and killed at exit; one
left behind by a killed trainer ends at its own CPU-time limit, or when it reads its closed stdin.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import re
import resource
import select
import subprocess
import sys
import threading
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

from rzero.envs.base import GraderTimeout

MAX_ANSWER_CHARS = 512  # longer answers score 0 without being parsed
DEFAULT_TIMEOUT_S = 5.0
# Enough that one slow comparison does not hold up the rest; each is an interpreter with sympy (~60 MB).
WORKERS = min(4, os.cpu_count() or 1)
WORKER_MEMORY_BYTES = 1 << 30  # address space a worker may add to what it has after startup
STARTUP_TIMEOUT_S = 60.0  # a fresh worker's imports and warm-up, never charged to a grade
# 10^{10^6} (a million digits) grades in ~0.2 s, 10^{10^7} in ~6 s; 100000! in ~0.1 s, 1000000! in ~6 s.
MAX_DIGITS = 10**6
MAX_FACTORIAL = 10**5
_SRC = str(Path(__file__).resolve().parents[2])  # the directory holding this rzero package, for workers


# ------------------------------------------------------------------ math-verify itself


def _parse(expr: str):
    from math_verify import parse

    # Boxing makes the LaTeX extractor take the whole expression (plain numbers and 1/2 too).
    return parse("\\boxed{" + expr + "}", parsing_timeout=None, raise_on_error=False)


@lru_cache(maxsize=65536)
def _parse_gold(answer: str):
    return _parse(answer)


def verify_unbounded(reference: str, candidate: str) -> bool:
    """math-verify's verdict, in this process and with no bound on its cost: only for inputs
    known to be cheap (and the benchmark's "before"). MemoryError propagates; nothing else does."""
    from math_verify import verify

    try:
        gold, pred = _parse_gold(reference), _parse(candidate)
        if not gold or not pred:
            return False
        # No timeout: math-verify's uses signal.alarm (main thread only); callers bound the cost.
        return bool(verify(gold, pred, timeout_seconds=None, raise_on_error=False))
    except MemoryError:
        raise
    except Exception:  # garbage in, zero reward out
        return False


# ------------------------------------------------------------------ cheap decisions

_NUMBER = re.compile(r"(-?)(?:(\d+(?:\.\d+)?)|(\d+)\s*/\s*(\d+)|\\[dt]?frac\{(\d+)\}\{(\d+)\})")
_TOWER = re.compile(r"\d+(?:\s*\^\s*\{?\s*\d+)+")  # 9^{9^{9}}, 2^30: integer literals only
_FACTORIAL = re.compile(r"(\d+)\s*!")


def _normalise(text: str) -> str:
    return " ".join(text.split())


def _number(text: str) -> tuple[Fraction, bool] | None:
    """A plain number's exact value and whether it was written with a decimal point."""
    m = _NUMBER.fullmatch(text) if len(text) <= 1000 else None  # int() refuses over 4300 digits
    if m is None:
        return None
    sign, decimal, num, den, fnum, fden = m.groups()
    if decimal is not None:
        value = Fraction(decimal)
    elif (den or fden).strip("0") == "":
        return None  # a zero denominator: leave it to math-verify
    else:
        value = Fraction(int(num or fnum), int(den or fden))
    return (-value if sign else value), "." in (decimal or "")


def _tower_too_big(numbers: list[float]) -> bool:
    """Whether evaluating the right-associated tower n0^(n1^(...)) meets a number of more than
    MAX_DIGITS digits, at any level."""
    value = numbers[-1]
    for base in reversed(numbers[:-1]):
        if base < 2:
            value = base  # 0^x and 1^x stay small (x itself was checked one level up)
            continue
        digits = value * math.log10(base)
        if digits > MAX_DIGITS:
            return True
        value = 10.0**digits if digits < 300 else math.inf
    return False


def astronomical(text: str) -> bool:
    """Whether ``text`` holds an integer power tower or factorial too large to evaluate."""
    # float(): any length of digits (int() refuses over 4300), too long ones are simply inf.
    if any(float(n) > MAX_FACTORIAL for n in _FACTORIAL.findall(text)):
        return True
    return any(_tower_too_big([float(n) for n in re.findall(r"\d+", m)]) for m in _TOWER.findall(text))


# ------------------------------------------------------------------ worker processes


def serve() -> None:
    """A worker process's loop: JSON lines [reference, candidate, timeout_s] in, verdicts out."""
    out = os.fdopen(os.dup(1), "w")  # the reply channel; whatever a library prints goes to stderr
    os.dup2(2, 1)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeouts are off": we are the timeout
    verify_unbounded("1", "1")  # imports and builds the parser's tables now, not in a timed grade
    with open("/proc/self/statm") as f:
        in_use = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _set_soft_limit(resource.RLIMIT_AS, in_use + WORKER_MEMORY_BYTES)
    _set_soft_limit(resource.RLIMIT_CORE, 0)  # no core file when the CPU-time limit below ends it
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:  # ends when the pool closes the pipe, or its process is gone
        reference, candidate, timeout_s = json.loads(line)
        # A CPU-time backstop: SIGXCPU ends a runaway grade even if nobody is left to kill it.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        _set_soft_limit(resource.RLIMIT_CPU, math.ceil(usage.ru_utime + usage.ru_stime + timeout_s) + 1)
        try:
            verdict = verify_unbounded(reference, candidate)
        except MemoryError:  # over the limit: exit, so the pool counts it and starts a fresh worker
            return
        out.write(json.dumps(verdict) + "\n")
        out.flush()


def _set_soft_limit(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))


class _Worker:
    """One worker: a fresh interpreter that imports only this module (never a fork of the
    multi-threaded trainer, and unlike multiprocessing's spawn and forkserver it does not re-import
    the caller's __main__, which may be a training script that imports torch)."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from rzero.envs.grading import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        self._poll = select.poll()  # not select.select: a trainer's descriptors may exceed FD_SETSIZE
        self._poll.register(self.process.stdout, select.POLLIN)
        self.ready = False

    def _reply(self, timeout_s: float) -> str | None:
        """The worker's next line, None after timeout_s, "" if it died."""
        if not self._poll.poll(timeout_s * 1000):
            return None
        return self.process.stdout.readline().decode()

    def call(self, reference: str, candidate: str, timeout_s: float) -> bool:
        if not self.ready:
            if not self._reply(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"a grading worker exited or was silent for {STARTUP_TIMEOUT_S:.0f} s at startup")
            self.ready = True
        try:
            self.process.stdin.write((json.dumps([reference, candidate, timeout_s]) + "\n").encode())
        except BrokenPipeError:
            raise GraderTimeout("the grading worker died") from None
        reply = self._reply(timeout_s)
        if reply is None:
            raise GraderTimeout(f"grading took longer than {timeout_s:g} s")
        if not reply:
            raise GraderTimeout("the grading worker died (out of memory?)")
        return json.loads(reply)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """Kill it and close its pipes (only the thread that holds the worker may)."""
        self.kill()
        self.process.stdin.close()
        self.process.stdout.close()


class GradingPool:
    """WORKERS worker processes; a call waits for an idle one (a busy one frees up or is killed
    within its caller's timeout), so waiting is bounded too."""

    def __init__(self):
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [_Worker() for _ in range(WORKERS)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for w in self._workers:
            self._idle.put(w)

    def check(self, reference: str, candidate: str, timeout_s: float) -> bool:
        """math-verify's verdict; GraderTimeout when the worker had to be killed."""
        worker = self._idle.get()
        try:
            if self._closed:  # at exit: in-flight grades give up instead of starting workers
                raise GraderTimeout("the grading pool is closed")
            return worker.call(reference, candidate, timeout_s)
        except BaseException:
            # Timed out, died or interrupted mid-call: a late answer may still arrive on its pipe,
            # so it never serves again.
            worker = self._replace(worker)
            raise
        finally:
            self._idle.put(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop()
        with self._lock:
            if self._closed:  # shutting down: hand back the dead one, later calls fail fast
                return worker
            fresh = _Worker()
            self._workers[self._workers.index(worker)] = fresh
            return fresh

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for w in workers:  # a thread waiting on a busy one sees it die and gives up
            w.kill()


_pool: GradingPool | None = None
_pool_lock = threading.Lock()


def pool() -> GradingPool:
    """The process's grading pool, started on first use and closed at exit."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = GradingPool()
        return _pool


def close_pool() -> None:
    """Kill the workers (a later grade starts a new pool)."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None


atexit.register(close_pool)  # kill the workers at exit, and stop in-flight grades from replacing them


def grade(reference: str, candidate: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``candidate`` is mathematically equal to ``reference``, in about ``timeout_s`` at
    most; raises GraderTimeout when the grader gave up (the answer scores 0)."""
    if len(candidate) > MAX_ANSWER_CHARS:
        return False
    reference, candidate = _normalise(reference), _normalise(candidate)
    if candidate == reference:
        return True
    ref, cand = _number(reference), _number(candidate)
    if ref is not None and cand is not None:
        if ref[0] == cand[0]:
            return True
        if not (ref[1] or cand[1]):
            return False  # two different exact rationals
        return verify_unbounded(reference, candidate)  # decimals: math-verify's rounding rules
    if astronomical(candidate) and not astronomical(reference):
        raise GraderTimeout("refused: an astronomically large literal")
    return pool().check(reference, candidate, timeout_s)
