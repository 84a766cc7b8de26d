"""`RayBackend`: rollout workers as Ray actors, one engine and environment each.

Admission, collection, stale drops, state_dict and stats are the `Orchestrator`'s, exactly as in
the local backend; only the worker differs. For each actor the driver runs one proxy thread doing
the local worker's loop: under the lock it asks whether a weight load is due and which groups are
admissible, then makes one remote call `actor.work(weights_or_None, version, starts)` and collects
the finished samples it returns. Weights travel once per version: `publish` puts the state dict in
the Ray object store once and every proxy hands the same reference to its actor when a load is due.

Faults: actors are created with `max_restarts=-1`, so Ray restarts one that dies (`kill -9`).
When a call fails because the actor died or is unreachable, the proxy puts the actor's in-flight
groups back to be sampled again from scratch, forgets the version its engine held (the restarted
actor loads weights again), counts `rollout/worker_restarts`, and goes on. An error raised by the
actor's own code (a bug, an environment that raises outside the episode protocol) reaches the
trainer from `get_groups`, as in the local backend.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from rzero.rollout.orchestrator import Orchestrator
from rzero.rollout.ray_worker import RolloutWorker

# Consecutive failed calls to one actor (without a successful one between) before the run stops:
# an actor that cannot come back (its constructor raises) must not retry forever.
MAX_CONSECUTIVE_FAILURES = 30
# Actors are named f"{ACTOR_PREFIX}<run id>-<worker>" (ray.util.list_named_actors finds them).
ACTOR_PREFIX = "rzero-rollout-"


class RayBackend(Orchestrator):
    def __init__(
        self,
        ray,
        make_engine: Callable[[], Any],
        make_env: Callable[[], Any],
        *,
        placement_group=None,
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        rollout_delay_s: float = 0.0,
        **kwargs,
    ):
        """`make_engine` and `make_env` are called inside each actor: they must pickle (Ray
        sends them); `placement_group` holds one bundle per worker, in worker order."""
        super().__init__(**kwargs)
        self.ray = ray
        self.make_engine, self.make_env, self.rollout_delay_s = make_engine, make_env, rollout_delay_s
        self.placement_group, self.cpus_per_worker, self.gpus_per_worker = placement_group, cpus_per_worker, gpus_per_worker
        self.actors: list = []

    def _share(self, weights):
        return self.ray.put(weights)

    def start(self, weights, version: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = self.ray.remote(RolloutWorker)
        run_id = uuid.uuid4().hex[:8]
        # Held for the run: a restarted actor is built again from these same objects.
        self._init_refs = [self.ray.put(self.make_engine), self.ray.put(self.make_env)]
        for i in range(self.num_workers):
            options: dict = dict(
                num_cpus=self.cpus_per_worker,
                num_gpus=self.gpus_per_worker,
                max_restarts=-1,  # Ray restarts an actor that dies; its groups are sampled again
                name=f"{ACTOR_PREFIX}{run_id}-{i}",
            )
            if self.placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=i
                )
            self.actors.append(
                actor_class.options(**options).remote(
                    *self._init_refs, self.sampling, self.group_size, self.seed, self.rollout_delay_s
                )
            )
        super().start(weights, version)

    def pids(self) -> list[int]:
        """The process id of every actor (for fault tests and debugging)."""
        return self.ray.get([a.pid.remote() for a in self.actors])

    def _close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []

    def _run_worker(self, i: int) -> None:
        from ray.exceptions import RayActorError

        actor, name = self.actors[i], f"rollout-{i}"
        owned: set[int] = set()  # groups started on this actor and not finished
        local_version = None
        incarnation = None  # the actor's life the groups in `owned` run on
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
                life, ran, done = self.ray.get(actor.work.remote(weights, version, starts, bool(owned)))
            except RayActorError as err:
                if "creation task" in str(err):  # the constructor raised: a restart cannot help
                    raise
                failures += 1
                if failures > MAX_CONSECUTIVE_FAILURES:
                    raise RuntimeError(f"rollout actor {i} failed {failures - 1} times in a row; last: {err}") from err
                self._lost(name, owned, restarted=failures == 1)
                owned.clear()
                local_version, incarnation = None, None
                time.sleep(min(0.1 * failures, 1.0))
                continue
            failures = 0
            if incarnation is not None and life != incarnation:
                # Ray restarted the actor between two calls (the call waited for the new life):
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
