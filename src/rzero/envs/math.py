"""Math word problems from a file, scored by symbolic equivalence (math-verify).

Rows are question/answer pairs read from JSONL or Parquet. Task i is a pure function of
(seed, i): the rows are visited in a seeded shuffled order, reshuffled each epoch, so a resumed
run regenerates exactly the same prompts without carrying an RNG across the checkpoint.

A single-turn ``Env``: ``task(index)``, ``reference(task)``, ``reward(task, completion)``.

Grading is bounded (rzero.envs.grading): symbolic comparisons run in worker processes with a
timeout (``grader_timeout_s``) and a memory limit, so a short pathological answer such as
``9^{9^{9^{9}}}`` scores 0 within the timeout instead of hanging the run.
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from pathlib import Path

from rzero.envs.base import Env, GraderTimeout, Task
from rzero.envs.grading import DEFAULT_TIMEOUT_S, grade
from rzero.model.tokenizer import IM_END

DEFAULT_PROMPT_TEMPLATE = "{question}\nPut the final answer in \\boxed{{}}."

_BOXED = re.compile(r"\\boxed\s*\{")


def extract_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` in ``text`` (nested braces allowed)."""
    found = None
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for pos in range(start, len(text)):
            ch = text[pos]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:pos]
                    break
    return found


def answers_match(reference: str, candidate: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when math-verify judges ``candidate`` equal to ``reference``; whatever the answer, it
    neither raises nor runs much longer than ``timeout_s`` (an answer the grader gives up on is no
    match)."""
    try:
        return grade(reference, candidate, timeout_s)
    except GraderTimeout:
        return False


def _cell(value, path: Path, where: str, key: str) -> str:
    if value is None or isinstance(value, (dict, list)) or isinstance(value, bool):
        raise ValueError(f"{path}: {where}: column {key!r} must be a string or number, got {value!r}")
    text = str(value).strip()
    if not text:
        raise ValueError(f"{path}: {where}: column {key!r} is empty")
    return text


def _load_jsonl(path: Path, qk: str, ak: str) -> list[tuple[str, str]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: {where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: {where}: expected a JSON object, got {type(obj).__name__}")
            for key in (qk, ak):
                if key not in obj:
                    raise ValueError(f"{path}: {where}: missing column {key!r} (has {sorted(obj)})")
            rows.append((_cell(obj[qk], path, where, qk), _cell(obj[ak], path, where, ak)))
    return rows


def _load_parquet(path: Path, qk: str, ak: str) -> list[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is present wherever datasets/trl are
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    names = pq.read_schema(path).names
    for key in (qk, ak):
        if key not in names:
            raise ValueError(f"{path}: missing column {key!r} (has {names})")
    table = pq.read_table(path, columns=[qk, ak])
    qs, ans = table.column(qk).to_pylist(), table.column(ak).to_pylist()
    return [
        (_cell(q, path, f"row {i}", qk), _cell(a, path, f"row {i}", ak)) for i, (q, a) in enumerate(zip(qs, ans))
    ]


class MathEnv(Env):
    def __init__(
        self,
        path: str | Path,
        *,
        question_key: str = "question",
        answer_key: str = "answer",
        answer_pattern: str | None = None,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        grader_timeout_s: float = DEFAULT_TIMEOUT_S,
        seed: int = 0,
    ):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"math env data file not found: {self.path}")
        suffix = self.path.suffix.lower()
        if suffix in (".jsonl", ".ndjson", ".json"):
            rows = _load_jsonl(self.path, question_key, answer_key)
        elif suffix in (".parquet", ".pq"):
            rows = _load_parquet(self.path, question_key, answer_key)
        else:
            raise ValueError(f"{self.path}: unsupported format {suffix!r} (use .jsonl or .parquet)")
        if not rows:
            raise ValueError(f"{self.path}: no rows")
        self.rows: tuple[tuple[str, str], ...] = tuple(rows)

        self.pattern = None
        if answer_pattern is not None:
            self.pattern = re.compile(answer_pattern)
            if self.pattern.groups != 1:
                raise ValueError(f"answer_pattern must have exactly one group, has {self.pattern.groups}")
        try:
            prompt_template.format(question="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"bad prompt_template {prompt_template!r}: only {{question}} is available ({e})") from e
        if not grader_timeout_s > 0:
            raise ValueError(f"grader_timeout_s must be > 0, got {grader_timeout_s!r}")
        self.prompt_template, self.grader_timeout_s, self.seed = prompt_template, grader_timeout_s, seed
        self._order = lru_cache(maxsize=4)(self._epoch_order)

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> tuple[int, ...]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return tuple(order)

    def task(self, index: int) -> Task:
        if index < 0:
            raise ValueError(f"task index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self.rows))
        question, answer = self.rows[self._order(epoch)[pos]]
        return Task(index, self.prompt_template.format(question=question), answer)

    def reference(self, task: Task) -> str:
        """The supervised target for the warm start: the boxed answer, then end of turn."""
        return "\\boxed{" + task.answer + "}" + IM_END

    def extract_answer(self, completion: str) -> str | None:
        """The last ``answer_pattern`` match's group if a pattern is set, else the last \\boxed{...}."""
        text = completion.split(IM_END)[0]
        if self.pattern is not None:
            last = None
            for m in self.pattern.finditer(text):
                last = m.group(1)
            return last.strip() if last is not None else None
        found = extract_boxed(text)
        return found.strip() if found is not None else None

    def reward(self, task: Task, completion: str) -> float:
        """1.0 when the extracted answer is mathematically equal to the reference, else 0.0;
        GraderTimeout when grading it was cut off (the episode runner scores that 0 and counts it)."""
        try:
            answer = self.extract_answer(completion)
        except Exception:
            return 0.0
        if not answer:
            return 0.0
        return 1.0 if grade(task.answer, answer, self.grader_timeout_s) else 0.0
