"""Exact replay of asynchronous runs (`rzero train --replay`) and exact resume of recorded steps."""

import json
import shutil
from pathlib import Path

import pytest

from rzero.rollout.record import Rollout
from rzero.run.loop import replay_run, train
from rzero.run.record import ReplayDiverged, RolloutRecord, compare_runs
from test_train import EvenLengthEnv, metrics, small_config

QUIET = dict(progress=False, log=lambda *a: None)


def async_run(tmp_path, name, *overrides):
    """A lag-4 run of a random model: completions run to max_tokens, so the trainer publishes
    new weights while samples are in flight and their tokens carry several versions."""
    config = small_config(tmp_path, "rollout.max_lag=4", "rollout.max_tokens=16", "train.steps=8",
                          "run.checkpoint_every=4", *overrides)
    return train(config, tmp_path / name, env=EvenLengthEnv(), **QUIET)


def in_flight_switches(run_dir) -> int:
    entries = RolloutRecord(run_dir).read().values()
    return sum(len(set(r["versions"])) > 1 for e in entries for g in e["rollouts"] for r in g)


@pytest.fixture(scope="module")
def invariant_run(tmp_path_factory):
    return async_run(tmp_path_factory.mktemp("replay"), "original")


@pytest.mark.parametrize("numerics", ["invariant", "standard"])
def test_tokens_sampled_across_a_weight_update_are_drawn_again(tiny_dense_dir, numerics):
    # A sequence whose engine loads new weights mid-generation (an in-flight update: its K/V are
    # recomputed, the later tokens carry the new version). Invariant: every token redraws exactly,
    # and naming the wrong version for one token is caught. Standard: the redraw cannot match.
    import torch

    from rzero.engine import Engine, SamplingParams
    from rzero.rollout.orchestrator import group_params
    from rzero.rollout.record import Rollout
    from rzero.rollout.replay import redraw_mismatch

    engine = Engine(tiny_dense_dir, numerics=numerics, dtype="bf16", decode_steps_per_call=4)  # an update mid-way
    w0 = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    w1 = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)).to(v.dtype) for k, v in w0.items()}
    params = group_params(SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), 1, 0, 5)
    engine.add_request([5, 6, 7, 8, 9], params, request_id="g5")
    while len(engine.sequences["g5"].token_ids) < 5 + 6:  # at least 6 of its 12 tokens
        engine.step()
    engine.update_weights(w1, 1)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output("g5")
    assert sorted(set(out.versions)) == [0, 1]
    rollout = Rollout([5, 6, 7, 8, 9], out.token_ids, out.logprobs, out.versions, 0.0, params.transform)
    replay_model = Engine(tiny_dense_dir, numerics=numerics, dtype="bf16").model
    found = redraw_mismatch(replay_model, {0: w0, 1: w1}, [5], [[rollout]], run_seed=0)
    if numerics == "standard":
        assert found is not None and "drawn again" in found
        return
    assert found is None
    wrong = Rollout(rollout.prompt_ids, rollout.completion_ids, rollout.logprobs,
                    [0] * len(rollout.versions), 0.0, params.transform)  # every token claims version 0
    assert "version 0" in redraw_mismatch(replay_model, {0: w0, 1: w1}, [5], [[wrong]], run_seed=0)


def test_replay_of_an_async_run_is_the_same_run(tmp_path, invariant_run):
    # In-flight updates depend on thread timing here (the test above forces one).
    assert max(m["lag/max"] for m in metrics(invariant_run)) >= 2
    same, report = replay_run(invariant_run, tmp_path / "replayed", **QUIET)
    assert same, report
    assert "final weights (step_8): identical" in report
    # Every metric but the timings, bit for bit (compare_runs checks it; this says it plainly).
    timing = ("time/", "tokens/s")
    strip = lambda rows: [{k: v for k, v in m.items() if not k.startswith(timing)} for m in rows]  # noqa: E731
    assert strip(metrics(tmp_path / "replayed")) == strip(metrics(invariant_run))
    # The replayed run has its own complete record, so it can be replayed or resumed in turn.
    assert RolloutRecord(tmp_path / "replayed").read() == RolloutRecord(invariant_run).read()


def test_a_changed_record_is_caught_at_its_step(tmp_path, invariant_run):
    doctored = tmp_path / "doctored"
    shutil.copytree(invariant_run, doctored)
    lines = (doctored / "rollouts.jsonl").read_text().splitlines()
    entry = json.loads(lines[5])
    entry["rollouts"][0][0]["logprobs"][0] += 1e-6  # one behaviour logprob, off by a few ulps
    lines[5] = json.dumps(entry)
    (doctored / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReplayDiverged, match="at step 5: group .* sample 0 token 0") as err:
        replay_run(doctored, tmp_path / "replayed", **QUIET)
    assert err.value.step == 5
    assert [m["step"] for m in metrics(tmp_path / "replayed")] == [0, 1, 2, 3, 4]


def test_replay_under_standard_numerics_reports_where_it_diverged(tmp_path):
    original = async_run(tmp_path, "standard", "model.numerics=standard")
    with pytest.raises(ReplayDiverged) as err:
        replay_run(original, tmp_path / "replayed", **QUIET)
    assert 0 <= err.value.step < 8 and "drawn again" in str(err.value)


def test_resume_replays_the_recorded_steps_after_the_checkpoint(tmp_path, invariant_run):
    # A crash after step 7 that left only the step-4 checkpoint: the resume replays 4..7 from the
    # record (exactly) instead of training them anew, then live workers go on to step 10.
    crashed = tmp_path / "crashed"
    shutil.copytree(invariant_run, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_8")
    (crashed / "checkpoints" / "latest").write_text("step_4\n")
    logs = []
    config = small_config(tmp_path, "rollout.max_lag=4", "rollout.max_tokens=16", "train.steps=10",
                          "run.checkpoint_every=4")
    train(config, crashed, resume=True, overrides=["train.steps=10"], env=EvenLengthEnv(), progress=False,
          log=logs.append)
    assert any("replayed the recorded steps up to 7 exactly" in line for line in logs), logs
    rows = metrics(crashed)
    assert [m["step"] for m in rows] == list(range(10))
    strip = lambda rows: [{k: v for k, v in m.items() if not k.startswith(("time/", "tokens/s"))} for m in rows]  # noqa: E731
    assert strip(rows[:8]) == strip(metrics(invariant_run))
    record = RolloutRecord(crashed).read()
    assert sorted(record) == list(range(10))
    trained = [g for s in range(10) for g in record[s]["groups"]]
    assert len(trained) == len(set(trained))  # every group trained once, across the switch to live workers


def test_record_keeps_everything_but_a_torn_last_line(tmp_path, invariant_run):
    run = tmp_path / "run"
    shutil.copytree(invariant_run, run)
    text = (run / "rollouts.jsonl").read_text()
    (run / "rollouts.jsonl").write_text(text + '{"step": 8, "groups": [1')  # died while writing
    assert sorted(RolloutRecord(run).read()) == list(range(8))
    (run / "rollouts.jsonl").write_text('{"step": 0, "gro\n' + text)
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        RolloutRecord(run).read()


def test_record_writes_in_the_background_and_a_failed_write_is_raised(tmp_path, invariant_run):
    """Steps are encoded and written on the record's own thread: flush waits for them, and a write
    that failed raises from the next append or flush instead of vanishing."""
    entries = RolloutRecord(invariant_run).read()
    groups = [[Rollout.from_dict(r) for r in g] for g in entries[0]["rollouts"]]
    record = RolloutRecord(tmp_path)
    for step in range(3):
        record.append(step, entries[0]["groups"], groups, {"s": step})
    record.flush()
    assert [e["stats"] for e in RolloutRecord(tmp_path).read().values()] == [{"s": 0}, {"s": 1}, {"s": 2}]
    record.close()
    (tmp_path / "rollouts.jsonl").unlink()
    (tmp_path / "rollouts.jsonl").mkdir()  # appending to it now fails
    record.append(3, entries[0]["groups"], groups, {})
    with pytest.raises(IsADirectoryError):
        record.flush()
    with pytest.raises(IsADirectoryError):
        record.append(4, entries[0]["groups"], groups, {})
    record.close(raise_error=False)


def test_a_run_whose_record_cannot_be_written_stops_with_that_error(tmp_path):
    """The record is written in the background: a failed write still ends the run with its own
    error (raised at the next step, checkpoint or the run's end, after the run's cleanup)."""
    run_dir = tmp_path / "run"
    (run_dir / "rollouts.jsonl").mkdir(parents=True)  # every append to it fails
    config = small_config(tmp_path, "rollout.max_lag=0", "train.steps=3", "run.checkpoint_every=100")
    with pytest.raises(IsADirectoryError):
        train(config, run_dir, env=EvenLengthEnv(), **QUIET)
    assert metrics(run_dir)  # the steps before it were logged


def test_replay_refuses_what_it_cannot_reexecute(tmp_path, invariant_run):
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        replay_run(tmp_path / "nothing", tmp_path / "out", **QUIET)
    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(invariant_run, unrecorded)
    (unrecorded / "rollouts.jsonl").unlink()
    with pytest.raises(ValueError, match="no rollout record"):
        replay_run(unrecorded, tmp_path / "out", **QUIET)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        replay_run(invariant_run, tmp_path / "taken", **QUIET)
    changed = tmp_path / "changed"
    shutil.copytree(invariant_run, changed)
    (changed / "overrides.jsonl").write_text(json.dumps({"step": 4, "set": ["train.lr=0.1"]}) + "\n")
    with pytest.raises(ValueError, match="changed settings on resume"):
        replay_run(changed, tmp_path / "out2", **QUIET)


def test_compare_runs_names_the_first_differing_metric(tmp_path, invariant_run):
    other = tmp_path / "other"
    shutil.copytree(invariant_run, other)
    rows = metrics(other)
    rows[3]["loss"] += 1.0
    (other / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    same, report = compare_runs(invariant_run, other)
    assert not same and report.startswith("step 3: metric loss differs")
    assert compare_runs(invariant_run, Path(invariant_run))[0]


def test_replay_of_a_multi_turn_async_run_with_tool_responses(tmp_path):
    # Each later turn is its own engine request with its own seed; the tool's tokens are context.
    from test_episodes import RESPONSE, ScriptedEnv

    class TurnsEnv(ScriptedEnv):
        def reward(self, task, completion):  # mixed rewards, so the weights really change
            return 1.0 if len(completion.split(RESPONSE)[-1]) % 2 == 0 else 0.0

    config = small_config(tmp_path, "rollout.max_lag=3", "rollout.max_tokens=6", "train.steps=5",
                          "run.checkpoint_every=5")
    original = train(config, tmp_path / "original", env=TurnsEnv(max_turns=3), **QUIET)
    samples = [r for e in RolloutRecord(original).read().values() for g in e["rollouts"] for r in g]
    assert all(r["turn_starts"] and len(r["turn_starts"]) == 3 and 0 in r["mask"] for r in samples)
    same, report = replay_run(original, tmp_path / "replayed", **QUIET)
    assert same, report


def test_cli_replay_says_identical_and_refuses_extra_arguments(tmp_path, invariant_run, capsys):
    from rzero.cli import main

    assert main(["train", "--replay", str(invariant_run), "--out", str(tmp_path / "again")]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["train", "--replay", str(invariant_run), "--out", str(tmp_path / "x"), "--set", "train.lr=1"]) != 0
    assert "takes only --out" in capsys.readouterr().err
