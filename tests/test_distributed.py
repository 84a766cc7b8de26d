"""Rollout workers as Ray actors (issue 10): same numbers as the local backend, exact async runs,
actors killed mid-run, joining a running cluster, and bad input. Real Ray, no mocks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rzero.config import ConfigError  # noqa: E402
from rzero.envs.arithmetic import ArithmeticEnv  # noqa: E402
from rzero.rollout.ray_backend import ACTOR_PREFIX  # noqa: E402
from rzero.run.loop import train  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_process_backend import SRC, every_group_once, same_but_timing, sync_config  # noqa: E402


class EvenLengthEnv(ArithmeticEnv):
    """Reward 1 for a completion of an even number of characters: about half of a random model's
    completions, so groups have mixed rewards from step 0 and the weights really change between
    versions. Defined here on purpose: actors get it by value (cloudpickle)."""

    def reward(self, task, completion):
        return 1.0 if len(completion) % 2 == 0 else 0.0


def run_killing_a_worker(config, run_dir, worker_pid, timeout: float = 60, runner=None) -> tuple[list[dict], list[int]]:
    """Run `config` (with `runner`, default `run`) while a side thread kills one worker
    (`worker_pid()`: its pid, or None while there is none yet) with SIGKILL once step 0 is
    written; (metrics rows, killed pids)."""
    killed: list[int] = []

    def killer() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            path = run_dir / "metrics.jsonl"
            if path.is_file() and len(path.read_text().splitlines()) >= 1 and (pid := worker_pid()) is not None:
                time.sleep(0.1)  # into step 1's sampling
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    side = threading.Thread(target=killer, daemon=True)
    side.start()
    rows = (runner or run)(config, run_dir)
    side.join(timeout=5)
    assert killed, "the side thread never killed a worker"
    assert rows[-1]["rollout/worker_restarts"] >= 1, (killed, [(m["step"], m["rollout/worker_restarts"]) for m in rows])
    every_group_once(rows)
    return rows, killed


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def run(config, run_dir, env=None) -> list[dict]:
    train(config, run_dir, progress=False, env=env if env is not None else EvenLengthEnv(), log=lambda *a: None)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_sync(tmp_path_factory) -> list[dict]:
    """The reference: the synchronous run on the local backend with 2 worker threads."""
    rows = run(sync_config("rollout.backend=local", "rollout.workers=2"), tmp_path_factory.mktemp("local") / "run")
    assert any(m["grad_norm"] > 0 for m in rows)  # the weights change: the comparison means something
    return rows


def test_sync_run_on_ray_is_bitwise_the_local_run(local_ray, local_sync, tmp_path):
    rows = run(sync_config("rollout.backend=ray", "rollout.workers=2"), tmp_path / "run")
    same_but_timing(local_sync, rows)
    every_group_once(rows)
    assert all(m["rollout/worker_restarts"] == 0 for m in rows)


def test_resume_on_ray_continues_the_run_bitwise(local_ray, local_sync, tmp_path):
    """Stop a Ray run after 3 of 6 steps, resume it (fresh actors, same backend): the metrics are
    the uninterrupted local run's."""
    run_dir = tmp_path / "run"
    first = sync_config("rollout.backend=ray", "rollout.workers=2", "train.steps=3", "run.checkpoint_every=3")
    run(first, run_dir)
    train(sync_config("rollout.backend=ray", "rollout.workers=2"), run_dir, resume=True, progress=False,
          env=EvenLengthEnv(), log=lambda *a: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    same_but_timing(local_sync, rows)
    every_group_once(rows)


def test_async_run_on_ray_has_zero_kernel_mismatch(local_ray, tmp_path):
    config = sync_config("rollout.backend=ray", "rollout.workers=2", "rollout.max_lag=2", "train.steps=6")
    rows = run(config, tmp_path / "run")
    assert len(rows) == 6
    assert all(m["mismatch/kernel_max_abs"] == 0.0 and m["lag/max"] <= 2 for m in rows)
    assert any(m["lag/max"] > 0 for m in rows), "an async run at max_lag 2 trains on lagged tokens"


def actor_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(ACTOR_PREFIX)}


def actor_pids(names) -> list[int]:
    return ray.get([ray.get_actor(n).pid.remote() for n in sorted(names)])


def test_killed_actor_is_restarted_and_no_group_is_lost_or_trained_twice(local_ray, local_sync, tmp_path):
    # Rewards arrive 0.5 s after each episode: the kill lands while groups are in flight, and the
    # five steps left give Ray ample time to notice the death even on a busy machine.
    config = sync_config("rollout.backend=ray", "rollout.workers=2", "env.rollout_delay_s=0.5")
    earlier = actor_names()  # actors of earlier runs may still be winding down: never kill those
    first_of_ours = lambda: actor_pids(ours)[0] if (ours := actor_names() - earlier) else None  # noqa: E731
    rows, _ = run_killing_a_worker(config, tmp_path / "run", first_of_ours, timeout=40, runner=run)
    # Sync: a group sampled again after the kill is sampled with the same weights and seed, so the
    # run is still the local run, number for number (the restarted actor loaded weights again).
    same_but_timing(local_sync, rows, also=("rollout/worker_restarts",))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The test's own head and its driver skip Ray's token authentication (a real cluster keeps it:
# every node and driver then needs the same token, ~/.ray/auth_token or RAY_AUTH_TOKEN).
SCRIPT_ENV = {"PYTHONPATH": SRC, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def run_script(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, **SCRIPT_ENV}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env)


TRAIN_IN_SUBPROCESS = """
    import sys
    from pathlib import Path
    from rzero.config import load_config
    from rzero.run.loop import train
    config = load_config({config!r}, {overrides!r})
    try:
        train(config, Path({run_dir!r}), progress=False, log=lambda *a: None)
    except ValueError as err:
        print("ERROR:", err)
        sys.exit(3)
    print("DONE")
"""


def test_joins_an_existing_cluster_by_address(tmp_path):
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rzray")  # short: Ray's socket paths must fit 107 bytes
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp_dir}",
         "--disable-usage-stats", "--include-dashboard=false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **SCRIPT_ENV},
    )  # fmt: skip
    try:
        overrides = ["warm_start.steps=0", "train.steps=5", "rollout.prompts_per_step=4", "rollout.group_size=4",
                     "rollout.max_tokens=6", "run.tensorboard=false", "rollout.backend=ray", "rollout.workers=2",
                     f"cluster.address=127.0.0.1:{port}"]  # fmt: skip
        wait_for_port(port, timeout=20)
        code = TRAIN_IN_SUBPROCESS.format(config=None, overrides=overrides, run_dir=str(tmp_path / "run"))
        result = None
        for _ in range(3):  # the head needs a few seconds to come up
            result = run_script(code, timeout=50)
            if "DONE" in result.stdout or "cannot reach" not in result.stdout + result.stderr:
                break
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 5
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)
    left = [p for p in Path("/proc").glob("[0-9]*") if temp_dir.encode() in _cmdline(p)]
    assert not left, f"processes of the test's Ray head are still running: {[p.name for p in left]}"


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="backend"):
        sync_config("rollout.backend=threads")


def test_ray_backend_without_ray_names_the_extra(tmp_path):
    code = "import sys; sys.modules['ray'] = None\n" + textwrap.dedent(
        TRAIN_IN_SUBPROCESS.format(config=None, overrides=["rollout.backend=ray"], run_dir=str(tmp_path / "run"))
    )
    result = run_script(code, timeout=50)
    assert result.returncode == 3, result.stderr[-2000:]
    message = result.stdout.split("ERROR:", 1)[1].strip()
    assert "\n" not in message and ".[distributed]" in message
    assert not (tmp_path / "run").exists()  # failed before anything started


def test_unreachable_address_fails_within_the_timeout_in_one_line(tmp_path):
    overrides = ["rollout.backend=ray", f"cluster.address=127.0.0.1:{free_port()}", "cluster.connect_timeout_s=5",
                 "warm_start.steps=0", "run.tensorboard=false"]  # fmt: skip
    t0 = time.monotonic()
    result = run_script(TRAIN_IN_SUBPROCESS.format(config=None, overrides=overrides, run_dir=str(tmp_path / "run")), 50)
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    message = result.stdout.split("ERROR:", 1)[1].strip()
    assert "\n" not in message and "127.0.0.1" in message
    assert time.monotonic() - t0 < 40


def test_impossible_resource_request_names_the_gpu_before_training(local_ray, tmp_path):
    config = sync_config("rollout.backend=ray", "rollout.gpus_per_worker=1")
    with pytest.raises(ValueError, match="GPU"):
        train(config, tmp_path / "run", progress=False, env=EvenLengthEnv(), log=lambda *a: None)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


class BrokenTaskEnv(EvenLengthEnv):
    """A bug outside the episode protocol: building task 5 raises (inside the actor)."""

    def task(self, index):
        if index == 5:
            raise KeyError("no task 5")
        return super().task(index)


def test_an_error_in_the_actor_reaches_the_trainer(local_ray, tmp_path):
    config = sync_config("rollout.backend=ray", "rollout.workers=2")
    with pytest.raises(RuntimeError, match="rollout worker failed") as info:
        train(config, tmp_path / "run", progress=False, env=BrokenTaskEnv(), log=lambda *a: None)
    assert "no task 5" in str(info.value.__cause__)
