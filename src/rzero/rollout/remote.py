"""`RemoteBackend`: rollout workers that run `RolloutWorker` in other processes, driven from here.

Admission, collection, stale drops, state_dict and stats are the `Orchestrator`'s, exactly as in
the local backend; only where the worker runs differs. For each worker the driver runs one proxy
thread doing the local worker's loop: under the lock it asks whether a weight load is due and
which groups are admissible, then makes one call `work(weights_or_None, version, starts)` to its
worker and collects the finished samples it returns. The subclass says how a call reaches the
worker (`_call`): a Ray actor (rzero.rollout.ray_backend) or a local worker process
(rzero.rollout.process_backend).

Faults: when a call fails because the worker's process died or is unreachable (`WorkerLost`), the
proxy puts the worker's in-flight groups back to be sampled again from scratch, forgets the
version its engine held (the restarted worker loads weights again), counts
`rollout/worker_restarts`, and goes on. An error raised by the worker's own code (a bug, an
environment that raises outside the episode protocol) reaches the trainer from `get_groups`, as in
the local backend.
"""

from __future__ import annotations

import time
from typing import Any

from rzero.rollout.orchestrator import Orchestrator
from rzero.rollout.worker import Finished

# Consecutive failed calls to one worker (without a successful one between) before the run stops:
# a worker that cannot come back must not be retried forever.
MAX_CONSECUTIVE_FAILURES = 30


class WorkerLost(Exception):
    """The worker's process died or cannot be reached; it is restarted (or restarts itself)."""


class RemoteBackend(Orchestrator):
    def _call(self, i: int, weights: Any, version: int | None, starts: list[int], wait: bool) -> tuple[str, bool, list[Finished]]:
        """`RolloutWorker.work` on worker i: (its incarnation, whether it ran, finished samples).
        Raises WorkerLost when the worker's process is gone."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it calls its workers")

    def _run_worker(self, i: int) -> None:
        name = f"rollout-{i}"
        owned: set[int] = set()  # groups started on this worker and not finished
        local_version = None
        incarnation = None  # the worker's life the groups in `owned` run on
        failures = 0
        while True:
            with self.cond:
                if self._stop:
                    return
                weights, version, starts = self._next_work(local_version)
                earlier = set(owned)
                owned.update(starts)
                if weights is None and not starts and not owned:
                    self.cond.wait(timeout=0.5)
                    continue
            try:
                life, ran, done = self._call(i, weights, version, starts, bool(owned))
            except WorkerLost as err:
                failures += 1
                if failures > MAX_CONSECUTIVE_FAILURES:
                    raise RuntimeError(f"rollout worker {i} failed {failures - 1} times in a row; last: {err}") from err
                self._lost(name, owned, restarted=failures == 1)
                owned.clear()
                local_version, incarnation = None, None
                time.sleep(min(0.1 * failures, 1.0))
                continue
            failures = 0
            if incarnation is not None and life != incarnation:
                # The worker was restarted between two calls (the call waited for the new life):
                # what ran on the old life is lost; what this call started runs on the new one.
                lost = owned if not ran else earlier
                self._lost(name, lost, restarted=True)
                owned -= lost
                local_version = None
            incarnation = life
            if not ran:  # a new life without weights: it started nothing
                self._lost(name, owned, restarted=False)
                owned.clear()
                local_version = None
                continue
            if weights is not None:
                local_version = version
                self._loaded_version(name, version)
            for g, sample, rollout, failed, grader_timeout in done:
                if g in owned and self._collect(g, sample, rollout, failed, grader_timeout):
                    owned.discard(g)
