"""MathEnv: file loading, seeded task order, \\boxed extraction, math-verify scoring."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rzero.envs.base import Task
from rzero.envs.math import MathEnv, extract_boxed
from rzero.model.tokenizer import IM_END

FIXTURE = Path(__file__).parent / "fixtures" / "math_small.jsonl"


@pytest.fixture(scope="module")
def env() -> MathEnv:
    return MathEnv(FIXTURE, seed=3)


def t(answer: str) -> Task:
    return Task(0, "q", answer)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---- loading ---------------------------------------------------------------------------------


def test_loads_fixture(env):
    assert len(env) == 10  # the blank line is skipped
    answers = {env.task(i).answer for i in range(len(env))}
    assert "\\frac{1}{2}" in answers and "-7" in answers  # numbers become strings


def test_custom_columns_jsonl(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1?", "solution": "2", "extra": 1}])
    e = MathEnv(p, question_key="problem", answer_key="solution", prompt_template="Q: {question}")
    task = e.task(0)
    assert task.prompt == "Q: 1+1?" and task.answer == "2"


def test_parquet_custom_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["Half of 1?", "2+2?"], "solution": ["0.5", "4"]}), p)
    e = MathEnv(p, question_key="problem", answer_key="solution")
    assert sorted(e.task(i).answer for i in range(2)) == ["0.5", "4"]
    task = next(e.task(i) for i in range(2) if e.task(i).answer == "0.5")
    assert e.reward(task, "so \\boxed{\\frac{1}{2}}") == 1.0
    with pytest.raises(ValueError, match=r"d\.parquet.*missing column 'answer'"):
        MathEnv(p, question_key="problem")
    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["1", None]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n\.parquet: row 1: column 'answer'"):
        MathEnv(tmp_path / "n.parquet")


def test_default_prompt(env):
    prompt = env.task(0).prompt
    assert prompt.endswith("\nPut the final answer in \\boxed{}.")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        MathEnv(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"question": "a", "answer": "1"}, {"question": "b"}], r"bad\.jsonl: line 2: missing column 'answer'"),
        ([{"question": "a", "answer": "1"}, "{not json"], r"bad\.jsonl: line 2: invalid JSON"),
        (["[1, 2]"], r"bad\.jsonl: line 1: expected a JSON object"),
        ([{"question": "a", "answer": None}], r"bad\.jsonl: line 1: column 'answer'"),
        ([{"question": "  ", "answer": "1"}], r"bad\.jsonl: line 1: column 'question' is empty"),
        ([], r"bad\.jsonl: no rows"),
    ],
)
def test_bad_data(tmp_path, rows, match):
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        MathEnv(p)


def test_bad_options(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}])
    with pytest.raises(ValueError, match="exactly one group"):
        MathEnv(p, answer_pattern=r"answer: \d+")
    with pytest.raises(ValueError, match="prompt_template"):
        MathEnv(p, prompt_template="{problem}")
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported format"):
        MathEnv(tmp_path / "d.csv")


# ---- task order ------------------------------------------------------------------------------


def test_task_order_is_deterministic_and_cycles(env):
    n = len(env)
    again = MathEnv(FIXTURE, seed=3)
    first = [env.task(i) for i in range(3 * n)]
    assert first == [again.task(i) for i in range(3 * n)]
    assert [again.task(i) for i in reversed(range(3 * n))] == first[::-1]  # pure in i, no hidden state
    for epoch in range(3):  # every epoch is a permutation of all rows
        assert sorted(t.prompt for t in first[epoch * n : (epoch + 1) * n]) == sorted(
            env.prompt_template.format(question=q) for q, _ in env.rows
        )
    assert [t.index for t in first] == list(range(3 * n))
    other = MathEnv(FIXTURE, seed=4)
    assert [other.task(i).prompt for i in range(n)] != [t.prompt for t in first[:n]]
    assert [t.prompt for t in first[:n]] != [env.prompt_template.format(question=q) for q, _ in env.rows]
    with pytest.raises(ValueError):
        env.task(-1)


# ---- extraction ------------------------------------------------------------------------------


def test_extract_boxed_nested_and_last():
    assert extract_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} then \\boxed{ {a}{b{c}} }") == " {a}{b{c}} "
    assert extract_boxed("\\boxed{3} and a truncated \\boxed{\\frac{1}{") == "3"
    assert extract_boxed("no box here") is None


def test_extract_answer_strips_end_of_turn(env):
    assert env.extract_answer("work... \\boxed{ 42 }" + IM_END + "\\boxed{7}") == "42"
    assert env.extract_answer("nothing") is None


def test_answer_pattern(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1/2"}])
    e = MathEnv(p, answer_pattern=r"Answer:\s*(\S+)")
    task = e.task(0)
    assert e.extract_answer("Answer: 3\nwait, Answer: 0.5") == "0.5"
    assert e.reward(task, "Answer: 3\nwait, Answer: 0.5") == 1.0
    assert e.reward(task, "Answer: 0.5\nno, Answer: 3") == 0.0
    assert e.reward(task, "\\boxed{1/2}") == 0.0  # the pattern replaces \boxed extraction


# ---- reward ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, completion",
    [
        ("\\frac{1}{2}", "\\boxed{0.5}"),
        ("\\frac{1}{2}", "\\boxed{1/2}"),
        ("0.5", "\\boxed{\\frac{1}{2}}"),
        ("1/2", "\\boxed{\\dfrac{1}{2}}"),
        ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),
        ("\\sqrt{8}", "so the answer is \\boxed{2\\sqrt{2}}."),
        ("\\{-2, 2\\}", "\\boxed{\\{2, -2\\}}"),
        ("[0, 1)", "\\boxed{[0,1)}"),
        ("42", "\\boxed{42.0}"),
        ("-7", "\\boxed{-7}"),
    ],
)
def test_equivalent_forms_score_one(env, answer, completion):
    assert env.reward(t(answer), completion) == 1.0


@pytest.mark.parametrize(
    "answer, completion",
    [
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
        ("2\\sqrt{2}", "\\boxed{\\sqrt{2}}"),
        ("[0, 1)", "\\boxed{[0, 1]}"),
        ("\\{-2, 2\\}", "\\boxed{\\{2\\}}"),
        ("42", "\\boxed{43}"),
        ("42", "42"),  # right number, but not boxed
        ("-7", "\\boxed{7}"),
    ],
)
def test_wrong_answers_score_zero(env, answer, completion):
    assert env.reward(t(answer), completion) == 0.0


@pytest.mark.parametrize(
    "completion",
    ["", IM_END, "\\boxed{", "\\boxed{}", "\\boxed{}}}{{\\frac}", "\\boxed{\\frac{1}{0}}", "\\boxed{" + "(" * 300 + "}",
     "\\boxed{" + "9" * 5000 + "}", "\x00\\boxed{\ud800}", "\\boxed{\\begin{matrix}}"],
)
def test_garbage_never_raises(env, completion):
    assert env.reward(t("3"), completion) == 0.0


def test_reference_scores_one(env):
    for i in range(len(env)):
        task = env.task(i)
        ref = env.reference(task)
        assert ref == "\\boxed{" + task.answer + "}" + IM_END
        assert env.reward(task, ref) == 1.0, task


def test_reward_from_worker_threads(env):
    assert threading.current_thread() is threading.main_thread()
    cases = [(t("\\frac{1}{2}"), "\\boxed{0.5}", 1.0), (t("2\\sqrt{2}"), "\\boxed{\\sqrt{8}}", 1.0),
             (t("42"), "\\boxed{41}", 0.0)] * 8
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda c: env.reward(c[0], c[1]), cases))
    assert got == [c[2] for c in cases]
    # And a bare thread, as the orchestrator's rollout workers are.
    out = []
    th = threading.Thread(target=lambda: out.append(env.reward(t("1/2"), "\\boxed{\\frac{2}{4}}")))
    th.start()
    th.join()
    assert out == [1.0]
