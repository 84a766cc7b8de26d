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

`LocalBackend` runs the workers as threads in the trainer's process (the embedded default).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from rzero.engine import Engine, SamplingParams
from rzero.rollout.episodes import AsyncLoop, Episode, EpisodeRunner
from rzero.rollout.record import Rollout


class LocalBackend:
    def __init__(
        self,
        make_engine: Callable[[], Engine],
        env,
        *,
        prompts_per_step: int,
        group_size: int,
        max_lag: int,
        sampling: SamplingParams,
        seed: int,
        workers: int = 1,
        weight_update_interval: int = 1,
        rollout_delay_s: float = 0.0,
        state: dict | None = None,
    ):
        self.make_engine, self.env = make_engine, env
        self.prompts_per_step, self.group_size, self.max_lag = prompts_per_step, group_size, max_lag
        self.sampling, self.seed, self.num_workers = sampling, seed, workers
        self.rollout_delay_s, self.weight_update_interval = rollout_delay_s, weight_update_interval
        self.cond = threading.Condition()
        self.version = 0
        self.weights: dict[str, torch.Tensor] | None = None
        state = state or {}
        self.next_group = state.get("next_group", 0)
        self.dropped = state.get("dropped", 0)
        self.finished: dict[int, list[Rollout]] = {
            int(g): [Rollout.from_dict(r) for r in rs] for g, rs in state.get("finished", {}).items()
        }
        # Groups that were in flight when the checkpoint was taken: sampled again from scratch.
        self.restart: list[int] = sorted(state.get("in_flight", []))
        self.in_flight: set[int] = set()
        self._partial: dict[int, dict[int, Rollout]] = {}  # in-flight groups' finished samples
        self.reward_failures = state.get("reward_failures", 0)
        # Engine weight updates (each recomputes the K/V in flight); a resume continues the count.
        self.weight_loads = state.get("weight_loads", 0)
        self._loaded: dict[str, int] = {}  # worker thread name -> version its engine holds
        self.grader_timeouts = state.get("grader_timeouts", 0)
        self.errors: list[BaseException] = []
        self._stop = False
        self._threads: list[threading.Thread] = []
        # Environment steps of every worker run on one event loop: slow tools wait concurrently.
        self._loop = AsyncLoop()

    # -------------------------------------------------------------- trainer side

    def start(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.weights, self.version = weights, version
        for i in range(self.num_workers):
            t = threading.Thread(target=self._worker, name=f"rollout-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        with self.cond:
            self.weights, self.version = weights, version
            self.cond.notify_all()

    def get_groups(self, step: int, count: int) -> list[list[Rollout]]:
        """Block until `count` finished groups whose tokens all have lag <= max_lag at `step`."""
        oldest_allowed = step - self.max_lag
        with self.cond:
            while True:
                if self.errors:
                    raise RuntimeError("a rollout worker failed") from self.errors[0]
                for g in sorted(self.finished):
                    if min(min(r.policy_versions(), default=step) for r in self.finished[g]) < oldest_allowed:
                        del self.finished[g]
                        self.dropped += 1
                        self.cond.notify_all()
                if len(self.finished) >= count:
                    chosen = sorted(self.finished)[:count]
                    return [self.finished.pop(g) for g in chosen]
                self.cond.wait(timeout=0.5)

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        self._loop.close()

    def state_dict(self) -> dict:
        with self.cond:
            return {
                "next_group": self.next_group,
                "dropped": self.dropped,
                "reward_failures": self.reward_failures,
                # A resumed worker loads the current version again first: leave out the loads of
                # it that already happened, so the resumed count continues like an unbroken run.
                "weight_loads": self.weight_loads - sum(v == self.version for v in self._loaded.values()),
                "grader_timeouts": self.grader_timeouts,
                "finished": {g: [r.to_dict() for r in rs] for g, rs in self.finished.items()},
                "in_flight": sorted(self.in_flight | set(self.restart)),
            }

    def stats(self) -> dict[str, float]:
        with self.cond:
            return {
                "rollout/dropped_stale": float(self.dropped),
                "rollout/reward_failures": float(self.reward_failures),
                "reward/grader_timeouts": float(self.grader_timeouts),
                "rollout/queued_groups": float(len(self.finished)),
                "rollout/in_flight_groups": float(len(self.in_flight)),
                "rollout/weight_loads": float(self.weight_loads),
            }

    # --------------------------------------------------------------- worker side

    def _admissible(self) -> int | None:
        """The next group this worker may start, or None (called with the lock held)."""
        if self.restart:
            return self.restart.pop(0)
        limit = (self.version + self.max_lag + 1) * self.prompts_per_step + self.dropped
        if self.next_group < limit:
            self.next_group += 1
            return self.next_group - 1
        return None

    def _worker(self) -> None:
        try:
            self._work()
        except BaseException as err:  # surface to the trainer instead of dying silently
            with self.cond:
                self.errors.append(err)
                self.cond.notify_all()

    def _work(self) -> None:
        engine = self.make_engine()
        runner = EpisodeRunner(engine, self.env, self._loop, self._episode_done, wake=self._wake, delay_s=self.rollout_delay_s)
        local_version = None
        while True:
            with self.cond:
                if self._stop:
                    return
                due = local_version is None or self.version - local_version >= self.weight_update_interval
                weights, version = (self.weights, self.version) if due else (None, None)
                starts = []
                while (g := self._admissible()) is not None:
                    starts.append(g)
                    self.in_flight.add(g)
                    self._partial[g] = {}
                if weights is None and not starts and not runner.has_engine_work():
                    self.cond.wait(timeout=0.5)
                    continue
            if weights is not None:
                engine.update_weights(weights, version)
                local_version = version
                with self.cond:
                    self.weight_loads += 1
                    self._loaded[threading.current_thread().name] = version
            for g in starts:
                params = replace(self.sampling, n=self.group_size, seed=self.seed * 7919 + g)
                runner.add(g, self.env.task(g), params)
            runner.step()

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _episode_done(self, episode: Episode) -> None:
        """Called on the env loop: collect the group; hand it over once all its samples are in."""
        g = episode.key
        rollout = Rollout(
            prompt_ids=episode.prompt_ids,
            completion_ids=episode.token_ids,
            logprobs=episode.logprobs,
            versions=episode.versions,
            reward=episode.reward,
            transform=self.sampling.transform,
            mask=None if all(episode.mask) else episode.mask,
        )
        with self.cond:
            members = self._partial[g]
            members[episode.sample] = rollout
            self.reward_failures += int(episode.failed)
            self.grader_timeouts += int(episode.grader_timeout)
            if len(members) == self.group_size:
                del self._partial[g]
                self.in_flight.discard(g)
                self.finished[g] = [members[j] for j in range(self.group_size)]
            self.cond.notify_all()
