"""Rollout workers as processes (`rollout.backend = "process"`, what "auto" picks on the CPU): the
same numbers as worker threads, a killed worker restarted with no group lost or trained twice,
errors that reach the trainer, no worker left behind, and scripts without a main guard."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rzero.config import load_config
from rzero.envs.arithmetic import ArithmeticEnv
from rzero.rollout import process_backend
from rzero.run.backends import resolved_backend
from rzero.run.loop import train

SRC = str(Path(__file__).resolve().parents[1] / "src")
# Timing-dependent fields: wall clock, and how many groups had been picked up or finished and how
# many weight loads had completed when the trainer read the stats (a worker that is still being
# built, or a load still on its way, shows one step later). Shared with tests/test_distributed.py.
NONDETERMINISTIC = ("time/", "tokens/s", "rollout/queued_groups", "rollout/in_flight_groups", "rollout/weight_loads")
STEPS, PROMPTS = 6, 4


class EvenLengthEnv(ArithmeticEnv):
    """Reward 1 for a completion of an even number of characters: mixed rewards, so the weights
    really change. Defined in this test module: the worker processes unpickle it from here (the
    driver's sys.path)."""

    def reward(self, task, completion):
        return 1.0 if len(completion) % 2 == 0 else 0.0


class BrokenTaskEnv(EvenLengthEnv):
    """Fails outside the episode protocol: building task 5 raises, in the worker."""

    def task(self, index):
        if index == 5:
            raise KeyError("task 5 is missing from the dataset")
        return super().task(index)


def sync_config(*overrides):
    return load_config(
        Path(SRC).parent / "configs/sync.toml",
        ["warm_start.steps=0", f"train.steps={STEPS}", f"rollout.prompts_per_step={PROMPTS}", "rollout.group_size=4",
         "rollout.max_tokens=6", "train.lr=0.01", "run.tensorboard=false", *overrides],
    )


def run(config, run_dir, env=None) -> list[dict]:
    train(config, run_dir, progress=False, env=env if env is not None else EvenLengthEnv(), log=lambda *a: None)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_but_timing(a: list[dict], b: list[dict], also: tuple[str, ...] = ()) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        keep = lambda m: {k: v for k, v in m.items() if not k.startswith(NONDETERMINISTIC + also)}  # noqa: E731
        assert keep(x) == keep(y), x["step"]


def every_group_once(rows: list[dict]) -> None:
    """Step s trained exactly groups s*P .. s*P+P-1 (a sync run drops none): each group once."""
    for m in rows:
        s = m["step"]
        assert (m["rollout/first_group"], m["rollout/last_group"]) == (s * PROMPTS, s * PROMPTS + PROMPTS - 1)


def worker_pids(parent: int) -> list[int]:
    """Live rollout worker processes whose parent is `parent` (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # ended meanwhile
        if b"rzero.rollout.process_backend" in cmdline and int(ppid) == parent and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def local_sync(tmp_path_factory) -> list[dict]:
    """The reference: the synchronous run with 2 worker threads."""
    rows = run(sync_config("rollout.backend=local", "rollout.workers=2"), tmp_path_factory.mktemp("local") / "run")
    assert any(m["grad_norm"] > 0 for m in rows)  # the weights change: the comparison means something
    return rows


def test_auto_is_processes_on_the_cpu_and_threads_for_what_cannot_be_pickled():
    assert load_config(None).rollout.backend == "auto"
    assert resolved_backend(load_config(None)) == "process"
    assert resolved_backend(load_config(None, ["rollout.backend=local"])) == "local"
    unpicklable = EvenLengthEnv()
    unpicklable.hook = lambda: None  # a lambda does not pickle
    assert resolved_backend(load_config(None), unpicklable) == "local"


def test_sync_run_in_processes_is_bitwise_the_thread_run_and_leaves_no_worker(local_sync, tmp_path, monkeypatch):
    spawned = []  # the function that started each interpreter
    spawn = process_backend._spawn
    monkeypatch.setattr(process_backend, "_spawn", lambda threads: spawned.append(sys._getframe(1).f_code.co_name) or spawn(threads))
    rows = run(sync_config("rollout.backend=process", "rollout.workers=2"), tmp_path / "run")
    same_but_timing(local_sync, rows)
    every_group_once(rows)
    assert all(m["rollout/worker_restarts"] == 0 for m in rows)
    assert worker_pids(os.getpid()) == []  # both workers ended with the run
    # The run started its two interpreters before building the model, and the backend took them.
    assert spawned == ["prespawn", "prespawn"]


def test_prespawned_interpreters_that_no_backend_takes_are_stopped():
    process_backend.prespawn(2, threads=1)
    assert len(worker_pids(os.getpid())) == 2
    process_backend.discard_spares()
    assert worker_pids(os.getpid()) == []


class DiesOnceEnv(EvenLengthEnv):
    """SIGKILLs its own rollout worker process while grading the first sample of group
    `PROMPTS + 1` (step 1), once per run (the marker file): a kill -9 that always lands with groups
    in flight, however slow the machine. (A kill from outside, timed by the clock, can land after
    the last step on a loaded machine, and then nothing is left to restart.)"""

    def __init__(self, marker: Path):
        super().__init__()
        self.marker = str(marker)

    def reward(self, task, completion):
        if task.index == PROMPTS + 1 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().reward(task, completion)


def test_killed_worker_process_is_restarted_and_no_group_is_lost_or_trained_twice(local_sync, tmp_path):
    config = sync_config("rollout.backend=process", "rollout.workers=2")
    rows = run(config, tmp_path / "run", env=DiesOnceEnv(tmp_path / "died"))
    assert (tmp_path / "died").is_file(), "the worker never reached the group that kills it"
    assert [m["rollout/worker_restarts"] for m in rows] == [0.0] + [1.0] * (STEPS - 1)
    every_group_once(rows)
    # Sync: a group sampled again after the kill has the same weights and seed, so the run is
    # still the thread run, number for number (the new worker loaded the weights again).
    same_but_timing(local_sync, rows, also=("rollout/worker_restarts",))
    assert worker_pids(os.getpid()) == []


def test_an_error_in_a_worker_reaches_the_trainer_with_its_traceback(tmp_path):
    with pytest.raises(RuntimeError, match="a rollout worker failed") as info:
        run(sync_config("rollout.backend=process"), tmp_path / "run", env=BrokenTaskEnv())
    assert "task 5 is missing from the dataset" in str(info.value.__cause__)
    assert worker_pids(os.getpid()) == []


def test_an_environment_that_cannot_be_pickled_is_refused_in_one_line(tmp_path):
    env = EvenLengthEnv()
    env.hook = lambda: None
    with pytest.raises(ValueError, match="cannot be sent to rollout worker processes.*rollout.backend = 'local'"):
        run(sync_config("rollout.backend=process"), tmp_path / "run", env=env)


SCRIPT = """
from pathlib import Path
from rzero.config import load_config
from rzero.run.loop import train
print("MAIN RAN", flush=True)
config = load_config(None, ["warm_start.steps=0", "train.steps={steps}", "rollout.prompts_per_step=2",
                            "rollout.group_size=2", "rollout.max_tokens=4", "run.tensorboard=false",
                            "rollout.backend=process", "env.rollout_delay_s={delay}"])
train(config, Path({run_dir!r}), progress=False, log=lambda *a: None)
print("DONE", flush=True)
"""


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """The workers are fresh interpreters: nothing runs the caller's script a second time."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(SCRIPT.format(steps=2, delay=0.0, run_dir=str(tmp_path / "run"))))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("MAIN RAN") == 1 and out.stdout.count("DONE") == 1, out.stdout


def test_workers_exit_when_their_driver_is_killed(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(SCRIPT.format(steps=1000, delay=0.2, run_dir=str(tmp_path / "run"))))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": SRC})
    try:
        deadline = time.monotonic() + 120
        while not (pids := worker_pids(driver.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids, "the driver never started a worker"
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in pids if running(p)]
    assert not alive, f"workers {alive} outlived their driver"


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_version_scorer_gives_the_trainers_logprobs_of_each_tokens_own_version():
    import torch

    from rzero.model.presets import PRESETS
    from rzero.rollout.record import Rollout
    from rzero.rollout.scoring import VersionScorer
    from rzero.train.trainer import Trainer

    cls, config = PRESETS["tiny-dense"]
    models = []
    for seed in (0, 1):
        m = cls(config)
        m.init_weights(seed)
        models.append(m.to(torch.bfloat16).requires_grad_(False))
    scorer = VersionScorer(models[0], Trainer.token_logprobs, keep_versions=2)
    for version, m in enumerate(models, start=4):
        scorer.add_version(version, {n: p.clone() for n, p in m.named_parameters()})
    rollouts = [
        Rollout([1, 2, 3], [7, 8, 9, 10], [0.0] * 4, [4, 4, 5, 5], 0.0),  # weights changed mid-rollout
        Rollout([4, 5], [11, 12, 13], [0.0] * 3, [5, 5, 5], 0.0, mask=[1, 0, 1]),  # an environment token
        Rollout([6], [14, 15], [0.0] * 2, [3, 4], 0.0),  # version 3 is not held: the trainer scores it
    ]
    scorer.fill(rollouts)
    with torch.no_grad():
        by_version = {v: Trainer.token_logprobs(m, rollouts[:2]) for v, m in zip((4, 5), models)}
    expected0 = [float(by_version[v][0][i]) for i, v in enumerate([4, 4, 5, 5])]
    assert rollouts[0].version_logprobs == expected0
    assert rollouts[1].version_logprobs == [float(by_version[5][1][0]), 0.0, float(by_version[5][1][1])]
    assert rollouts[2].version_logprobs is None
    assert "version_logprobs" not in rollouts[0].to_dict()  # not recorded: a replay scores again
    scorer.add_version(6, {n: p.clone() for n, p in models[0].named_parameters()})
    assert sorted(scorer.weights) == [5, 6]  # the newest keep_versions only


def test_async_run_takes_the_decomposition_from_the_workers_and_it_is_exact(tmp_path, monkeypatch):
    from rzero.train.trainer import Trainer

    seen = []
    original = Trainer._diagnostics

    def spy(self, rollouts, trainer_lps):
        seen.append(all(r.version_logprobs is not None for r in rollouts))
        return original(self, rollouts, trainer_lps)

    monkeypatch.setattr(Trainer, "_diagnostics", spy)
    rows = run(sync_config("rollout.backend=process", "rollout.max_lag=2", "train.steps=8"), tmp_path / "run")
    assert seen and all(seen)
    assert all(m["mismatch/kernel_max_abs"] == 0.0 for m in rows)
    assert any(m["lag/max"] > 0 and m["mismatch/lag_max_abs"] > 0 for m in rows)  # the weights did lag


def test_weight_slots_are_written_again_only_when_no_worker_can_read_them():
    """The slot pool's rules (process_backend._WeightSlots): the newest version's slot, a slot a
    worker thread is sending, and the slots of the versions a worker's scorer keeps (keep = 2
    here: its loaded version and the one before) are never free; a worker that moved on, or was
    started again, frees them; a worker life is sent a slot's buffers once."""
    import torch

    def weights(v):
        return {"a": torch.full((3,), float(v)), "b": torch.full((2, 2), float(v))}

    slots = process_backend._WeightSlots(keep_versions=2)
    slots.slots = [process_backend.SharedWeights(weights(0)), process_backend.SharedWeights(weights(1))]
    assert slots.free_slot(weights(2), newest=1) == 0
    assert slots.free_slot(weights(2), newest=0) == 1
    slots.taken[7] = 0  # a worker thread is sending slot 0
    assert slots.free_slot(weights(2), newest=1) is None
    del slots.taken[7]
    slots.loaded(worker=0, version=4, slot=0)
    slots.loaded(worker=0, version=5, slot=1)  # keeps versions 4 and 5: both slots
    assert slots.free_slot(weights(6), newest=1) is None
    slots.slots.append(process_backend.SharedWeights(weights(6)))
    slots.loaded(worker=0, version=6, slot=2)  # version 4 is out of its scorer's reach now
    assert slots.free_slot(weights(7), newest=2) == 0
    assert slots.free_slot({"a": torch.zeros(4)}, newest=2) is None  # another layout never fits
    slots.new_life(0)  # restarted: it keeps nothing
    assert slots.free_slot(weights(7), newest=2) == 0 and slots.kept == {}
    # A slot's buffers go to a worker life once; then the load is the slot number alone.
    assert slots.message(1, 2)[1] is slots.slots[2] and slots.message(1, 2) == (2, None)
    slots.new_life(1)
    assert slots.message(1, 2)[1] is slots.slots[2]
    # A write lands in the buffers the workers map.
    slots.slots[0].copy_from(weights(9))
    assert all(bool((t == 9).all()) for t in slots.slots[0].tensors().values())
