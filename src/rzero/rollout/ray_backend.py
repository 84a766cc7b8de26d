"""`RayBackend`: rollout workers as Ray actors, one engine and environment each.

The driver side (a proxy thread per actor, faults) is `RemoteBackend`'s; this class starts the
actors and makes the remote call. Weights travel once per version: `publish` puts the state dict
in the Ray object store once and every proxy hands the same reference to its actor when a load is
due. Actors are created with `max_restarts=-1`, so Ray restarts one that dies (`kill -9`); its
groups are sampled again.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from rzero.rollout.remote import RemoteBackend, WorkerLost
from rzero.rollout.worker import RolloutWorker

# Actors are named f"{ACTOR_PREFIX}<run id>-<worker>" (ray.util.list_named_actors finds them).
ACTOR_PREFIX = "rzero-rollout-"


class RayBackend(RemoteBackend):
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

    def _call(self, i, weights, version, starts, wait):
        from ray.exceptions import RayActorError

        try:
            return self.ray.get(self.actors[i].work.remote(weights, version, starts, wait))
        except RayActorError as err:
            if "creation task" in str(err):  # the constructor raised: a restart cannot help
                raise
            raise WorkerLost(str(err)) from err  # Ray restarts the actor (max_restarts=-1)
