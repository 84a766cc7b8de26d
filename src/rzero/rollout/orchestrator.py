"""Rollout workers that run beside the trainer, with a bound on the weight lag of every token.

A *group* is `group_size` samples of one prompt; group g is task g of the environment, sampled
with seeds derived from (run seed, g), so its content depends only on the weights that sample it.

Bounded lag. Each trainer step consumes `prompts_per_step` (P) groups. Workers may start group g
only while g < (version + max_lag + 1) * P + dropped, where version is the latest published
weight version: at most max_lag + 1 steps' worth of groups exist ahead of the trainer, which is
also what keeps memory flat (back-pressure). The trainer takes finished groups oldest first and
never trains on a token older than max_lag versions: a group that finished too late for that is
dropped and counted (`rollout/dropped_stale`). max_lag = 0 is the synchronous baseline: P groups
are sampled with version s, trained on at step s, and only then are the next P started.

Episodes may take several turns: a worker thread owns an engine and runs model turns; the
environment's steps (tool calls, rewards) run on an asyncio loop (rollout/episodes.py), so slow
tools never block generation.

`Orchestrator` holds all of that (admission, collection into groups, stale drops, state_dict,
stats, restart of in-flight groups on resume or after a lost worker); its subclasses differ only in
how a worker runs. `LocalBackend` runs the workers as threads in the trainer's process (the
embedded default); `rzero.rollout.ray_backend.RayBackend` runs each as a Ray actor with its own
engine and environment, driven by one proxy thread per actor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from rzero.engine import Engine, SamplingParams
from rzero.ops import SamplingTransform
from rzero.rollout.episodes import AsyncLoop, Episode, EpisodeRunner
from rzero.rollout.record import Rollout


def rollout_of(episode: Episode, transform: SamplingTransform) -> Rollout:
    """The record of one finished episode."""
    return Rollout(
        prompt_ids=episode.prompt_ids,
        completion_ids=episode.token_ids,
        logprobs=episode.logprobs,
        versions=episode.versions,
        reward=episode.reward,
        transform=transform,
        mask=None if all(episode.mask) else episode.mask,
        turn_starts=None if episode.turn_starts in ([], [0]) else episode.turn_starts,
    )


def group_seed(run_seed: int, g: int) -> int:
    """The request seed of group g's first turn: it depends only on (run seed, g)."""
    return run_seed * 7919 + g


def group_params(sampling: SamplingParams, group_size: int, seed: int, g: int) -> SamplingParams:
    """The sampling parameters of group g."""
    return replace(sampling, n=group_size, seed=group_seed(seed, g))


class Orchestrator:
    """Admission under the lag bound and collection into groups; subclasses run the workers.

    A subclass implements `_run_worker(i)`, the body of worker i's thread: under `self.cond` it
    asks `_next_work` what to do (a weight load, groups to start), does it outside the lock,
    reports loads with `_loaded_version` and finished samples with `_collect`, and returns when
    `self._stop` is set. An exception it raises reaches the trainer from `get_groups`.
    """

    def __init__(
        self,
        *,
        prompts_per_step: int,
        group_size: int,
        max_lag: int,
        sampling: SamplingParams,
        seed: int,
        workers: int = 1,
        weight_update_interval: int = 1,
        state: dict | None = None,
    ):
        self.prompts_per_step, self.group_size, self.max_lag = prompts_per_step, group_size, max_lag
        self.sampling, self.seed, self.num_workers = sampling, seed, workers
        self.weight_update_interval = weight_update_interval
        self.cond = threading.Condition()
        self.version = 0
        self.weights: Any = None  # what `_share` made of the latest published state dict
        state = state or {}
        self.next_group = state.get("next_group", 0)
        self.dropped = state.get("dropped", 0)
        self.finished: dict[int, list[Rollout]] = {
            int(g): [Rollout.from_dict(r) for r in rs] for g, rs in state.get("finished", {}).items()
        }
        # Groups that were in flight when the checkpoint was taken (or on a worker that was lost):
        # sampled again from scratch.
        self.restart: list[int] = sorted(state.get("in_flight", []))
        self.in_flight: set[int] = set()
        self._partial: dict[int, dict[int, Rollout]] = {}  # in-flight groups' finished samples
        self.reward_failures = state.get("reward_failures", 0)
        # Engine weight updates (each recomputes the K/V in flight); a resume continues the count.
        self.weight_loads = state.get("weight_loads", 0)
        self.worker_restarts = state.get("worker_restarts", 0)
        self._loaded: dict[str, int] = {}  # worker name -> version its engine holds
        self._all_loaded_once = False
        self.grader_timeouts = state.get("grader_timeouts", 0)
        self.last_groups: list[int] = []  # indices of the groups the last get_groups handed out
        self.errors: list[BaseException] = []
        self._stop = False
        self._threads: list[threading.Thread] = []

    # -------------------------------------------------------------- trainer side

    def _share(self, weights: dict[str, torch.Tensor]) -> Any:
        """How a published state dict reaches the workers (in-process: the dict itself)."""
        return weights

    def start(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.weights, self.version = self._share(weights), version
        for i in range(self.num_workers):
            t = threading.Thread(target=self._worker, args=(i,), name=f"rollout-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        shared = self._share(weights)  # once per version, outside the lock
        with self.cond:
            self.weights, self.version = shared, version
            self.cond.notify_all()

    def get_groups(self, step: int, count: int) -> list[list[Rollout]]:
        """Block until `count` finished groups whose tokens all have lag <= max_lag at `step`.

        The first call also waits until every worker has loaded weights once: groups restored
        from a checkpoint could otherwise be trained before a resumed worker's first load, and
        `rollout/weight_loads` would depend on that race."""
        oldest_allowed = step - self.max_lag
        with self.cond:
            while True:
                if self.errors:
                    raise RuntimeError("a rollout worker failed") from self.errors[0]
                if not self._all_loaded_once:
                    if len(self._loaded) < self.num_workers:
                        self.cond.wait(timeout=0.5)
                        continue
                    self._all_loaded_once = True
                for g in sorted(self.finished):
                    if min(min(r.policy_versions(), default=step) for r in self.finished[g]) < oldest_allowed:
                        del self.finished[g]
                        self.dropped += 1
                        self.cond.notify_all()
                if len(self.finished) >= count:
                    chosen = sorted(self.finished)[:count]
                    self.last_groups = chosen
                    return [self.finished.pop(g) for g in chosen]
                self.cond.wait(timeout=0.5)

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        self._close()

    def _close(self) -> None:
        """Release what the workers shared (called once their threads have ended)."""

    def state_dict(self) -> dict:
        with self.cond:
            return {
                "next_group": self.next_group,
                "dropped": self.dropped,
                "reward_failures": self.reward_failures,
                # A resumed worker loads the current version again first: the loads of it that
                # already happened are left out, so the resumed count continues like an unbroken run.
                "weight_loads": self._loads_before_current(),
                "worker_restarts": self.worker_restarts,
                "grader_timeouts": self.grader_timeouts,
                "finished": {g: [r.to_dict() for r in rs] for g, rs in self.finished.items()},
                "in_flight": sorted(self.in_flight | set(self.restart)),
            }

    def _loads_before_current(self) -> int:
        """Engine weight loads of versions before the newest published one. Loads of the newest
        race with the trainer reading the stats right after publishing it; leaving them out makes
        the count the same in every run of a synchronous config (and across a resume)."""
        return self.weight_loads - sum(v == self.version for v in self._loaded.values())

    def stats(self) -> dict[str, float]:
        with self.cond:
            return {
                "rollout/dropped_stale": float(self.dropped),
                "rollout/reward_failures": float(self.reward_failures),
                "reward/grader_timeouts": float(self.grader_timeouts),
                "rollout/queued_groups": float(len(self.finished)),
                "rollout/in_flight_groups": float(len(self.in_flight)),
                "rollout/weight_loads": float(self._loads_before_current()),
                "rollout/worker_restarts": float(self.worker_restarts),
                # The group indices the step trained on (oldest and newest): with the count, the
                # record of which groups were trained, each exactly once.
                "rollout/first_group": float(min(self.last_groups, default=-1)),
                "rollout/last_group": float(max(self.last_groups, default=-1)),
            }

    # --------------------------------------------------------------- worker side

    def _admissible(self) -> int | None:
        """The next group a worker may start, or None (called with the lock held)."""
        if self.restart:
            return self.restart.pop(0)
        limit = (self.version + self.max_lag + 1) * self.prompts_per_step + self.dropped
        if self.next_group < limit:
            self.next_group += 1
            return self.next_group - 1
        return None

    def _next_work(self, local_version: int | None) -> tuple[Any, int | None, list[int]]:
        """(weights or None, their version, groups to start) for a worker whose engine holds
        `local_version` (None: not loaded yet). Called with the lock held; the groups returned
        are in flight from now on."""
        due = local_version is None or self.version - local_version >= self.weight_update_interval
        weights, version = (self.weights, self.version) if due else (None, None)
        starts = []
        while (g := self._admissible()) is not None:
            starts.append(g)
            self.in_flight.add(g)
            self._partial[g] = {}
        return weights, version, starts

    def _loaded_version(self, worker: str, version: int) -> None:
        with self.cond:
            self.weight_loads += 1
            self._loaded[worker] = version
            self.cond.notify_all()

    def _lost(self, worker: str, groups: Iterable[int], restarted: bool) -> None:
        """Worker `worker` died: its in-flight `groups` are sampled again from scratch (their
        partial samples dropped) and its engine must load weights again."""
        with self.cond:
            for g in groups:
                if g in self.in_flight:
                    self.in_flight.discard(g)
                    self._partial.pop(g, None)
                    self.restart.append(g)
            self.restart.sort()
            self._loaded.pop(worker, None)
            self.worker_restarts += int(restarted)
            self.cond.notify_all()

    def _collect(self, g: int, sample: int, rollout: Rollout, failed: bool, grader_timeout: bool) -> bool:
        """Add one finished sample of group g; True when that completed the group."""
        with self.cond:
            members = self._partial[g]
            members[sample] = rollout
            self.reward_failures += int(failed)
            self.grader_timeouts += int(grader_timeout)
            complete = len(members) == self.group_size
            if complete:
                del self._partial[g]
                self.in_flight.discard(g)
                self.finished[g] = [members[j] for j in range(self.group_size)]
            self.cond.notify_all()
            return complete

    def _worker(self, i: int) -> None:
        try:
            self._run_worker(i)
        except BaseException as err:  # surface to the trainer instead of dying silently
            with self.cond:
                self.errors.append(err)
                self.cond.notify_all()

    def _run_worker(self, i: int) -> None:
        """Worker i's loop; each backend says where it runs (LocalBackend, RayBackend)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its workers run")

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


class LocalBackend(Orchestrator):
    """Workers as threads of this process, each with its own engine; environment steps of every
    worker run on one event loop, so slow tools wait concurrently."""

    def __init__(self, make_engine: Callable[[], Engine], env, *, rollout_delay_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.make_engine, self.env, self.rollout_delay_s = make_engine, env, rollout_delay_s
        self._loop = AsyncLoop()

    def _close(self) -> None:
        self._loop.close()

    def _run_worker(self, i: int) -> None:
        engine = self.make_engine()
        runner = EpisodeRunner(engine, self.env, self._loop, self._episode_done, wake=self._wake, delay_s=self.rollout_delay_s)
        local_version = None
        while True:
            with self.cond:
                if self._stop:
                    return
                weights, version, starts = self._next_work(local_version)
                if weights is None and not starts and not runner.has_engine_work():
                    self.cond.wait(timeout=0.5)
                    continue
            if weights is not None:
                engine.update_weights(weights, version)
                local_version = version
                self._loaded_version(threading.current_thread().name, version)
            for g in starts:
                runner.add(g, self.env.task(g), group_params(self.sampling, self.group_size, self.seed, g))
            runner.step()

    def _episode_done(self, episode: Episode) -> None:
        """Called on the env loop: collect the group; hand it over once all its samples are in."""
        rollout = rollout_of(episode, self.sampling.transform)
        self._collect(episode.key, episode.sample, rollout, episode.failed, episode.grader_timeout)
