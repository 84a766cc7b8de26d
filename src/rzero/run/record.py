"""The rollout record of a run, and the rollout source that replays it.

  rollouts.jsonl   one JSON object per trainer step: {"step", "groups": the group indices the
                   step trained on, "rollouts": their samples (tokens, behaviour logprobs μ, the
                   weight version of every token, turn starts), "stats": the rollout side's
                   counters at that step}

An asynchronous run's only nondeterminism is which weight version sampled which token (thread
timing). The record holds exactly that, so `ReplaySource` can stand in for the rollout workers:
it hands the trainer the recorded groups after drawing every token again from the replay's own
weights of the recorded version (rzero.rollout.replay). With `invariant` numerics the replayed
run is the original, bit for bit; under `standard` numerics it stops at the first step whose
tokens cannot be drawn again (`ReplayDiverged`).
"""

from __future__ import annotations

import copy
import json
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from rzero.rollout.record import Rollout
from rzero.rollout.replay import redraw_mismatch

RECORD_FILE = "rollouts.jsonl"


class ReplayDiverged(RuntimeError):
    """A recorded step's tokens could not be drawn again from the replay's weights."""

    def __init__(self, step: int, detail: str):
        super().__init__(f"replay diverged at step {step}: {detail}")
        self.step = step


class RolloutRecord:
    """rollouts.jsonl of one run directory: read whole, appended one step at a time.

    A step's entry is encoded and written on a thread of its own (~3 ms a step for 64 rollouts,
    which the run loop then spends waiting for the next rollouts instead); `flush` waits for the
    writes (the run loop flushes before every checkpoint and at its end), and a failed write
    raises from the next `append` or `flush`."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / RECORD_FILE
        self.next_step = 0  # steps below it are in the file already (see keep_below)
        self._entries: queue.Queue[dict | None] = queue.Queue()  # None: the writer ends
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def read(self) -> dict[int, dict]:
        """step -> entry. A torn last line (the process died while writing it) is dropped."""
        self.flush()
        if not self.path.is_file():
            return {}
        entries: dict[int, dict] = {}
        lines = self.path.read_text().splitlines()
        for n, line in enumerate(lines):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines) - 1:
                    break
                raise ValueError(f"{self.path}: line {n + 1} is not JSON (the record is damaged)") from None
            entries[entry["step"]] = entry
        return entries

    def keep_below(self, step: int) -> None:
        """Drop the entries of steps >= `step` (they will be trained anew), atomically."""
        entries = self.read()  # flushes first
        self.next_step = step
        if all(s < step for s in entries) and self._intact():
            return  # nothing to drop: no rewrite of a long record
        kept = [e for s, e in sorted(entries.items()) if s < step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in kept))
        os.replace(tmp, self.path)

    def _intact(self) -> bool:
        """Whether the file ends with a complete line (a torn one must be cut before appending)."""
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return True
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def append(self, step: int, groups: list[int], rollouts: list[list[Rollout]], stats: dict) -> None:
        """Record a step trained from live workers (or replayed into a new run directory); steps
        already in the file (replayed on resume) are not written twice."""
        self._raise_error()
        if step < self.next_step:
            return
        self.next_step = step + 1
        # to_dict shares the rollouts' lists, which nothing changes once a step has them.
        entry = {"step": step, "groups": groups, "rollouts": [[r.to_dict() for r in g] for g in rollouts], "stats": stats}
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_entries, name="rollout-record", daemon=True)
            self._writer.start()
        self._entries.put(entry)

    def flush(self) -> None:
        """Return once every appended step is in the file; raise if a write failed."""
        if self._writer is not None:
            self._entries.join()
        self._raise_error()

    def close(self, raise_error: bool = True) -> None:
        """Flush, and end the writer thread (a later append starts another). `raise_error=False`:
        a run that is failing already keeps its own error."""
        if self._writer is not None:
            self._entries.put(None)
            self._writer.join()
            self._writer = None
        if raise_error:
            self._raise_error()

    def _write_entries(self) -> None:
        while True:
            entry = self._entries.get()
            if entry is None:
                self._entries.task_done()
                return
            try:
                if self._error is None:  # after a failure nothing more is written: the file ends at the last good step
                    line = json.dumps(entry) + "\n"
                    with open(self.path, "a") as f:
                        f.write(line)
            except BaseException as err:  # noqa: BLE001 (raised on the run loop's thread)
                self._error = err
            finally:
                self._entries.task_done()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error


class ReplaySource:
    """The rollout side of a replayed run: recorded groups, each step's tokens drawn again first.

    It offers what the run loop uses of a rollout backend (start, publish, get_groups, stats,
    state_dict, stop), so a run can replay recorded steps and then go on with live workers.
    """

    def __init__(self, entries: dict[int, dict], engine_model: torch.nn.Module, dtype: torch.dtype, *,
                 run_seed: int, max_lag: int, state: dict | None = None,
                 earlier_weights: dict[int, dict[str, torch.Tensor]] | None = None):
        """`earlier_weights`: versions before the first published one that recorded tokens may
        name (on resume: the trainer's ring of recent versions, saved in the checkpoint)."""
        self.entries, self.run_seed, self.max_lag = entries, run_seed, max_lag
        self.dtype = dtype
        self.model = copy.deepcopy(engine_model).to(dtype).eval().requires_grad_(False)
        self.weights: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        for version, weights in sorted((earlier_weights or {}).items()):
            self.publish(weights, version)
        self.base_state = dict(state or {})  # the rollout side's state where the replay starts
        self.consumed: list[int] = []
        self.last_groups: list[int] = []
        self._stats: dict[str, float] = {}

    def has(self, step: int) -> bool:
        return step in self.entries

    def start(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.publish(weights, version)

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        # Cast as an engine's update_weights casts, and keep the versions a token may still name.
        self.weights[version] = {k: v.to(self.dtype) for k, v in weights.items()}
        while len(self.weights) > self.max_lag + 1:
            self.weights.popitem(last=False)

    def get_groups(self, step: int, count: int) -> list[list[Rollout]]:
        entry = self.entries[step]
        if len(entry["groups"]) != count:
            raise ReplayDiverged(step, f"the record has {len(entry['groups'])} groups, the config asks for {count}")
        rollouts = [[Rollout.from_dict(r) for r in g] for g in entry["rollouts"]]
        mismatch = redraw_mismatch(self.model, self.weights, entry["groups"], rollouts, run_seed=self.run_seed)
        if mismatch is not None:
            raise ReplayDiverged(step, mismatch)
        self.last_groups = list(entry["groups"])
        self.consumed += self.last_groups
        self._stats = entry["stats"]
        return rollouts

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def state_dict(self) -> dict:
        """The rollout side's state after the replayed steps, for live workers that take over:
        finished or in-flight groups the replay consumed are gone, groups the original had started
        but not yet trained are sampled again, and the counters are the original's."""
        base, consumed = self.base_state, set(self.consumed)
        start_next = base.get("next_group", 0)
        next_group = max([start_next, *(g + 1 for g in consumed)])
        finished = {int(g): rs for g, rs in base.get("finished", {}).items() if int(g) not in consumed}
        in_flight = set(base.get("in_flight", [])) | set(range(start_next, next_group))
        s = self._stats
        return {
            **base,
            "next_group": next_group,
            "finished": finished,
            "in_flight": sorted(in_flight - consumed - set(finished)),
            "dropped": int(s.get("rollout/dropped_stale", base.get("dropped", 0))),
            "reward_failures": int(s.get("rollout/reward_failures", base.get("reward_failures", 0))),
            "grader_timeouts": int(s.get("reward/grader_timeouts", base.get("grader_timeouts", 0))),
            "weight_loads": int(s.get("rollout/weight_loads", base.get("weight_loads", 0))),
            "worker_restarts": int(s.get("rollout/worker_restarts", base.get("worker_restarts", 0))),
        }

    def stop(self) -> None:
        """Nothing runs in the background."""


class ReplayThenLive:
    """A resumed run's rollout side: the recorded steps after the checkpoint are replayed, then
    live workers (`open_live(state)`, started with the latest published weights) take over, also
    when a step diverges (its record and the later ones are dropped and trained anew). With
    `open_live` None (`rzero train --replay`) it only replays, and a divergence is raised."""

    def __init__(self, replay: ReplaySource, open_live, record: RolloutRecord, log=print):
        self.current: ReplaySource | object = replay
        self.open_live, self.record, self.log = open_live, record, log
        self._latest: tuple[dict, int] | None = None

    @property
    def last_groups(self) -> list[int]:
        return self.current.last_groups

    def start(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self._latest = (weights, version)
        self.current.start(weights, version)

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self._latest = (weights, version)
        self.current.publish(weights, version)

    def get_groups(self, step: int, count: int) -> list[list[Rollout]]:
        replay = self.current
        if isinstance(replay, ReplaySource):
            try:
                if replay.has(step) or self.open_live is None:
                    return replay.get_groups(step, count)
                self.log(f"replayed the recorded steps up to {step - 1} exactly; live rollout workers go on")
            except ReplayDiverged as err:
                if self.open_live is None:
                    raise
                self.log(f"{err}; the recorded steps from {step} on are dropped and trained anew by live workers")
                self.record.keep_below(step)
            self.current = self.open_live(replay.state_dict())
            self.current.start(*self._latest)
        return self.current.get_groups(step, count)

    def stats(self) -> dict[str, float]:
        return self.current.stats()

    def state_dict(self) -> dict:
        return self.current.state_dict()

    def stop(self) -> None:
        self.current.stop()


TIMING_FIELDS = {"time/train", "time/wait_rollouts", "time/step", "tokens/s"}


def compare_runs(original: Path, replayed: Path) -> tuple[bool, str]:
    """Whether a replay reproduced its original: every metric of every step but the timings,
    bit for bit, and the final weights (when both runs checkpointed the same last step)."""
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (original, replayed)]
    a, b = ({m["step"]: m for m in r} for r in rows)
    replayed_steps = sorted(b)
    for step in replayed_steps:
        keys = (set(a.get(step, {})) | set(b[step])) - TIMING_FIELDS
        differ = sorted(k for k in keys if a.get(step, {}).get(k) != b[step].get(k) and not _both_nan(a.get(step, {}).get(k), b[step].get(k)))
        if differ:
            k = differ[0]
            return False, f"step {step}: metric {k} differs ({a.get(step, {}).get(k)!r} vs {b[step].get(k)!r}); also: {differ[1:]}"
    lines = [f"metrics: steps {replayed_steps[0]}..{replayed_steps[-1]} identical to {original} (all but {sorted(TIMING_FIELDS)})"]
    last = f"step_{replayed_steps[-1] + 1}"
    weights = [d / "checkpoints" / last / "model" / "model.safetensors" for d in (original, replayed)]
    if all(w.is_file() for w in weights):
        if weights[0].read_bytes() != weights[1].read_bytes():
            return False, f"{lines[0]}\nfinal weights ({last}) differ"
        lines.append(f"final weights ({last}): identical")
    else:
        lines.append(f"final weights: not compared ({original} has no checkpoint {last})")
    return True, "\n".join(lines)


def _both_nan(x, y) -> bool:
    return isinstance(x, float) and isinstance(y, float) and x != x and y != y
