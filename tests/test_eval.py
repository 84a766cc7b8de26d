"""rzero eval: the pass@k estimator, suite validation, scripted runs with known answers, and a
real end-to-end run of a tiny model (metrics consistent with the samples, reproducible)."""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import math
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest

from rzero.cli import main as cli_main
from rzero.engine.sequence import RequestOutput
from rzero.envs.arithmetic import ArithmeticEnv
from rzero.eval import run as eval_run
from rzero.eval.metrics import (
    Problem,
    Sample,
    average_metrics,
    benchmark_metrics,
    pass_at_k,
)
from rzero.eval.suite import Sampling, SuiteError, load_suite
from rzero.model.tokenizer import IM_END, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
SUITE = FIXTURES / "suite.toml"


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ estimator


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_enumeration_over_all_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)), abs=1e-12)


def test_pass_at_k_known_values_and_edges():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)  # pass@1 is c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10, abs=1e-15)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(8, 0, 3) == 0.0
    assert pass_at_k(8, 8, 3) == 1.0
    assert pass_at_k(8, 6, 3) == 1.0  # n - c < k: every 3 samples include a correct one
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # k = n: any correct
    # Large n: binomials of this size overflow a float; the product form does not.
    exact = 1 - Fraction(math.comb(2000 - 37, 500), math.comb(2000, 500))
    assert pass_at_k(2000, 37, 500) == pytest.approx(float(exact), rel=1e-12)
    assert 0.0 < pass_at_k(100_000, 1, 1) == pytest.approx(1e-5, rel=1e-12)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)


def test_partial_reward_is_not_correct_and_mixed_k_has_no_average_pass_at_k():
    samples = [Sample("", r, 2, "stop", False) for r in (1.0, 0.5, 0.0, 1.0)]
    m = benchmark_metrics([Problem(0, "p", "a", samples[:2]), Problem(1, "q", "b", samples[2:])], k=2)
    assert m["pass@1"] == 0.5 and m["mean_reward"] == 0.625 and m["pass@k"] == 1.0
    other = dict(m, k=1, **{"pass@1": 0.25, "pass@k": 0.25})
    assert average_metrics([m, other])["pass@k"] is None and average_metrics([m, other])["pass@1"] == 0.375
    assert average_metrics([m, m])["pass@k"] == 1.0 and average_metrics([m, m])["k"] == 2


# ---------------------------------------------------------- suite validation


def write_suite(tmp_path: Path, text: str) -> Path:
    (tmp_path / "rows.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    path = tmp_path / "suite.toml"
    path.write_text(text)
    return path


MATH = '[[benchmarks]]\nname = "m"\ntask = "math"\ndata = "rows.jsonl"\n'


@pytest.mark.parametrize(
    "text, expected",
    [
        (MATH + "colour = 3\n", ["benchmark 'm'", "key 'colour'", "unknown key"]),
        (MATH.replace("rows.jsonl", "nowhere.jsonl"), ["benchmark 'm'", "key 'data'", "nowhere.jsonl", "does not exist"]),
        (MATH.replace('"math"', '"chess"'), ["benchmark 'm'", "key 'task'", "'arithmetic', 'math' or 'tool_calc'"]),
        ('[[benchmarks]]\nname = "m"\ndata = "rows.jsonl"\n', ["benchmark 'm'", "missing key 'task'"]),
        (MATH + "digits = 2\n", ["benchmark 'm'", "digits not used"]),
        (MATH + "k = 0\n", ["benchmark 'm'", "key 'k'", "greater than or equal to 1"]),
        ("[defaults]\ntemperature = -1\n" + MATH, ["[defaults]", "key 'temperature'"]),
        ("[defaults]\nsize = 1\n" + MATH, ["[defaults]", "key 'size'", "unknown key"]),
        (MATH + "k = 4\nsamples = 2\n", ["benchmark 'm'", "key 'samples'", "pass@4"]),
        (MATH + "num_tasks = 3\n", ["benchmark 'm'", "key 'num_tasks'", "2 rows"]),
        (MATH + 'question_key = "problem"\n', ["benchmark 'm'", "missing column 'problem'"]),
        ('[[benchmarks]]\nname = "a"\ntask = "arithmetic"\n', ["benchmark 'a'", "key 'num_tasks'", "required"]),
        (MATH + MATH, ["names must be unique", "m"]),
        ("[[benchmarks]]\ntask = \"math\"\n", ["benchmarks[0]", "key 'name'", "Field required"]),
        ("benchmarks = []\n", ["key 'benchmarks'", "at least 1"]),
        ("[[benchmarks]\n", ["not valid TOML"]),
    ],
)
def test_suite_errors_name_file_benchmark_and_key(tmp_path, text, expected):
    path = write_suite(tmp_path, text)
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    message = str(err.value)
    assert str(path) in message
    for part in expected:
        assert part in message


def test_sampling_layers_and_paths_resolve(tmp_path):
    path = write_suite(
        tmp_path,
        "[defaults]\ntemperature = 0.3\nk = 2\nsamples = 6\n" + MATH + "max_tokens = 7\nk = 3\n"
        '[[benchmarks]]\nname = "a"\ntask = "arithmetic"\nnum_tasks = 50\ndigits = 3\nenv_seed = 9\n',
    )
    m, a = load_suite(path, Sampling(temperature=0.0), limit=10)
    assert m.sampling.model_dump() == dict(k=3, samples=6, temperature=0.0, top_p=1.0, top_k=0, max_tokens=7)
    assert a.sampling.model_dump() == dict(k=2, samples=6, temperature=0.0, top_p=1.0, top_k=0, max_tokens=1024)
    assert m.data == str(tmp_path / "rows.jsonl") and m.num_tasks == 2  # below the limit: all rows
    assert a.num_tasks == 10 and a.env.digits == 3 and a.env.task(0) == ArithmeticEnv(3, ("+",), seed=9).task(0)
    with pytest.raises(SuiteError, match="limit must be >= 1"):
        load_suite(path, limit=0)


def test_docs_example_suite_is_valid(tmp_path):
    docs = (Path(__file__).parents[1] / "docs" / "eval.md").read_text()
    suite = docs.split("```toml\n# suites/math5.toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "math5.toml").write_text(suite)
    names = ["aime24", "aime25", "amc23", "math500", "minerva"]
    for name in names:
        row = {"problem": "What is 2+2?", "question": "What is 2+2?", "answer": "4"}
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    plans = load_suite(tmp_path / "math5.toml")
    assert [p.name for p in plans] == names
    assert [p.sampling.samples for p in plans] == [16, 16, 4, 4, 4] and {p.sampling.k for p in plans} == {1}
    prompt = plans[0].env.task(0).prompt
    assert prompt.startswith("<|im_start|>user\nWhat is 2+2?\n") and "\\boxed{}" in prompt


def test_cli_reports_suite_errors_before_touching_the_model(tmp_path):
    path = write_suite(tmp_path, MATH + "colour = 3\n")
    rc, out, err = run_cli(["eval", "--model", str(tmp_path / "no-model"), "--suite", str(path)])
    assert rc == 2 and out == ""
    assert err.startswith("rzero eval: error: invalid suite") and "key 'colour': unknown key" in err
    rc, _, err = run_cli(["eval", "--model", str(tmp_path / "no-model"), "--suite", str(write_suite(tmp_path, MATH))])
    assert rc == 2 and "not a model directory" in err
    rc, _, err = run_cli(["eval", "--model", "m", "--suite", str(path), "--k", "0"])
    assert rc == 2 and "--k: Input should be greater than or equal to 1" in err


# ------------------------------------------------- scripted model, known answers


class ScriptedEngine:
    """Stands in for rzero.engine.Engine: sample j of a prompt gets `script[prompt][j]` as its
    completion, whole, on the first step it is scheduled (at most max_num_seqs per step);
    `seeds` records each prompt's sampling seed."""

    def __init__(self, model_dir, *, numerics, dtype, max_num_seqs, seed, script, seeds):
        self.script, self.seeds = script, seeds
        self.tokenizer = load_tokenizer(model_dir)
        self.max_num_seqs, self.version = max_num_seqs, 0
        self.sequences: dict[str, SimpleNamespace] = {}
        self.pending: list[str] = []

    def add_request(self, prompt, params, request_id):
        if not isinstance(prompt, str):  # token ids, as the episode runner sends them
            prompt = self.tokenizer.decode(prompt, skip_special_tokens=False)
        self.seeds[prompt] = params.seed
        ids = [f"{request_id}/{j}" for j in range(params.n)]
        for j, rid in enumerate(ids):
            text = self.script[prompt][j]
            self.sequences[rid] = SimpleNamespace(token_ids=self.tokenizer.encode(prompt).ids, text=text)
            self.pending.append(rid)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def num_unfinished(self) -> int:
        return len(self.pending)

    def validate_prompt(self, prompt):
        return self.tokenizer.encode(prompt).ids

    def step(self):
        batch, self.pending = self.pending[: self.max_num_seqs], self.pending[self.max_num_seqs :]
        return [SimpleNamespace(request_id=rid, finished=True) for rid in batch]

    def pop_output(self, rid):
        seq = self.sequences.pop(rid)
        tokens = list(range(len(seq.text)))  # one "token" per character: mean tokens is checkable
        return RequestOutput(rid, seq.token_ids, tokens, [0.0] * len(tokens), [0] * len(tokens), "stop", seq.text)


def test_scripted_model_gives_exactly_the_expected_metrics(tmp_path, monkeypatch, tiny_dense_dir):
    """Problem i of each benchmark gets c_i = i mod (n + 1) correct samples out of n, the
    samples that say "boom" make the env raise and the power towers make the grader give up, so
    every metric is known in advance."""
    suite = tmp_path / "suite.toml"
    suite.write_text(
        f"[defaults]\nk = 2\nsamples = 4\n"
        f'[[benchmarks]]\nname = "sums"\ntask = "arithmetic"\nnum_tasks = 13\ndigits = 2\n'
        f'[[benchmarks]]\nname = "algebra"\ntask = "math"\ndata = "{FIXTURES / "algebra.jsonl"}"\n'
    )
    plans = load_suite(suite)
    script, seeds, expected = {}, {}, {}
    for plan in plans:
        n, texts = plan.sampling.samples, {}
        correct, tokens, failures, timeouts, at_k = 0, 0, 0, 0, []
        for i in range(plan.num_tasks):
            task = plan.env.task(i)
            right = task.answer + IM_END if plan.task == "arithmetic" else f"The answer is \\boxed{{{task.answer}}}."
            c = i % (n + 1)
            wrong = "boom" if plan.task == "arithmetic" and i % 5 == 1 else "no idea"
            if plan.task == "math" and i % 2 == 0:
                wrong = "\\boxed{9^{9^{9^{9}}}}"
            texts[task.prompt] = [right] * c + [wrong] * (n - c)
            correct += c
            tokens += sum(len(t) for t in texts[task.prompt])
            failures += (n - c) * (wrong == "boom")
            timeouts += (n - c) * ("9^{9" in wrong)
            at_k.append(1 - Fraction(math.comb(n - c, 2), math.comb(n, 2)))
        script.update(texts)
        samples = plan.num_tasks * n
        expected[plan.name] = {
            "problems": plan.num_tasks,
            "samples": samples,
            "pass@1": correct / samples,
            "pass@k": float(sum(at_k) / len(at_k)),
            "mean_completion_tokens": tokens / samples,
            "reward_failures": failures,
            "grader_timeouts": timeouts,
        }
    assert expected["sums"]["reward_failures"] > 0 and 0 < expected["algebra"]["pass@1"] < 1
    assert expected["algebra"]["grader_timeouts"] > 0 and expected["sums"]["grader_timeouts"] == 0

    real_reward = ArithmeticEnv.reward

    def reward(self, task, completion):
        if completion == "boom":
            raise RuntimeError("scripted env failure")
        return real_reward(self, task, completion)

    monkeypatch.setattr(ArithmeticEnv, "reward", reward)
    monkeypatch.setattr(eval_run, "Engine", functools.partial(ScriptedEngine, script=script, seeds=seeds))
    rc, out, _ = run_cli(
        ["eval", "--model", str(tiny_dense_dir), "--suite", str(suite), "--out", str(tmp_path / "out"), "--max-num-seqs", "5"]
    )
    assert rc == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    for bench in results["benchmarks"]:
        metrics = bench["metrics"]
        for key, value in expected[bench["name"]].items():
            assert metrics[key] == pytest.approx(value, abs=1e-12), (bench["name"], key)
    average = results["average"]
    assert average["pass@1"] == pytest.approx((expected["sums"]["pass@1"] + expected["algebra"]["pass@1"]) / 2)
    assert average["pass@k"] == pytest.approx((expected["sums"]["pass@k"] + expected["algebra"]["pass@k"]) / 2)
    assert average["k"] == 2 and average["reward_failures"] == expected["sums"]["reward_failures"]
    assert average["grader_timeouts"] == expected["algebra"]["grader_timeouts"]
    assert f"{100 * average['pass@1']:.2f}" in out and f"{100 * expected['sums']['pass@k']:.2f}" in out
    # Each problem sampled with its own seed, derived from (seed, benchmark, index).
    for plan in plans:
        for i in range(plan.num_tasks):
            assert seeds[plan.env.task(i).prompt] == eval_run.problem_seed(0, plan.name, i)
    assert len(set(seeds.values())) == len(script) == 13 + 3
    records = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 13 + 3
    boom = [s for r in records for s in r["samples"] if s["text"] == "boom"]
    assert boom and all(s["failed"] and s["reward"] == 0.0 and "scripted env failure" in s["error"] for s in boom)
    towers = [s for r in records for s in r["samples"] if "9^{9" in s["text"]]
    assert towers and all(s["grader_timeout"] and not s["failed"] and s["reward"] == 0.0 for s in towers)
    assert sum(s["grader_timeout"] for r in records for s in r["samples"]) == len(towers)
    assert "timeouts" in (tmp_path / "out" / "results.md").read_text()


# ----------------------------------------------------- tiny model, end to end


def first_samples(run_dir: Path) -> dict[str, list[str]]:
    """Each benchmark's first-sample completions, in problem order."""
    texts: dict[str, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        texts.setdefault(record["benchmark"], []).append(record["samples"][0]["text"])
    return texts


@pytest.fixture(scope="module")
def tiny_run(tiny_dense_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    rc, stdout, _ = run_cli(["eval", "--model", str(tiny_dense_dir), "--suite", str(SUITE), "--out", str(out)])
    assert rc == 0
    return out, stdout


def test_tiny_model_end_to_end_numbers_are_consistent(tiny_run):
    out, stdout = tiny_run
    results = json.loads((out / "results.json").read_text())
    names = ["algebra", "geometry", "sums", "calc", "vowels"]
    assert [b["name"] for b in results["benchmarks"]] == names
    for name in names + ["average"]:
        assert name in stdout
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    markdown = (out / "results.md").read_text()
    for bench, problems in zip(results["benchmarks"], [3, 2, 4, 2, 4]):
        m, s = bench["metrics"], bench["sampling"]
        mine = [r for r in records if r["benchmark"] == bench["name"]]
        rewards = [x["reward"] for r in mine for x in r["samples"]]
        assert m["problems"] == len(mine) == problems and m["samples"] == len(rewards) == problems * s["samples"] == problems * 3
        assert m["k"] == s["k"] == (1 if bench["name"] == "geometry" else 2)
        assert m["pass@1"] == pytest.approx(sum(r == 1.0 for r in rewards) / len(rewards))
        assert m["pass@k"] == pytest.approx(sum(pass_at_k(3, r["num_correct"], m["k"]) for r in mine) / problems)
        assert m["pass@k"] >= m["pass@1"]
        assert 0 < m["mean_completion_tokens"] <= s["max_tokens"] * (2 if bench["name"] == "calc" else 1)
        assert f"| {bench['name']} | {problems} | 3 | {m['k']} | {100 * m['pass@1']:.2f} | {100 * m['pass@k']:.2f} |" in markdown
    # The vowel lottery: a random model does win some of it (so the checks above are not all 0 == 0).
    assert results["benchmarks"][-1]["metrics"]["pass@1"] > 0
    average = results["average"]
    assert average["pass@1"] == pytest.approx(sum(b["metrics"]["pass@1"] for b in results["benchmarks"]) / 5)
    assert average["pass@k"] is None and average["k"] is None  # geometry's k = 1: no common k
    assert average["problems"] == 15 and f"| average | 15 |  | - | {100 * average['pass@1']:.2f} | - |" in markdown
    assert results["config"]["numerics"] == "invariant" and results["config"]["seed"] == 0


def test_same_seed_same_results_any_batching_other_seed_other_samples(tiny_run, tiny_dense_dir, tmp_path):
    out, _ = tiny_run
    # Fewer sequences per batch: other batches, same bits (invariant numerics, per-sample seeds).
    again = ["--out", str(tmp_path / "again"), "--max-num-seqs", "3"]
    rc, _, _ = run_cli(["eval", "--model", str(tiny_dense_dir), "--suite", str(SUITE), *again])
    assert rc == 0
    first, again = (json.loads((d / "results.json").read_text()) for d in (out, tmp_path / "again"))
    assert first["benchmarks"] == again["benchmarks"] and first["average"] == again["average"]
    assert (out / "samples.jsonl").read_text() == (tmp_path / "again" / "samples.jsonl").read_text()

    argv = ["--seed", "1", "--limit", "2", "--k", "1", "--samples", "1", "--out", str(tmp_path / "other")]
    rc, _, _ = run_cli(["eval", "--model", str(tiny_dense_dir), "--suite", str(SUITE), *argv])
    assert rc == 0
    other = json.loads((tmp_path / "other" / "results.json").read_text())
    assert [b["metrics"]["problems"] for b in other["benchmarks"]] == [2, 2, 2, 2, 2]
    assert all(b["sampling"]["k"] == b["sampling"]["samples"] == 1 for b in other["benchmarks"])
    assert other["config"]["command_line_sampling"] == {"k": 1, "samples": 1}
    full, limited = first_samples(out), first_samples(tmp_path / "other")
    assert [len(texts) for texts in limited.values()] == [2] * 5
    # Random gibberish from another seed: equal only by a fluke (say both stop at once).
    assert sum(a != b for name, texts in limited.items() for a, b in zip(texts, full[name])) >= 8


def test_eval_cli_gives_the_caller_its_thread_count_back(tmp_path):
    """`rzero eval` runs a tiny model on one intra-op thread (--threads 0) and, called in-process,
    leaves the caller's thread count as it was."""
    import torch

    from rzero.cli import main
    from rzero.model.presets import init_model

    model = init_model("tiny-dense", tmp_path / "m")
    suite = tmp_path / "suite.toml"
    suite.write_text('[[benchmarks]]\nname = "a"\ntask = "arithmetic"\nnum_tasks = 2\n')
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["eval", "--model", str(model), "--suite", str(suite), "--max-tokens", "2"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
