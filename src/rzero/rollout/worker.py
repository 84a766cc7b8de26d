"""`RolloutWorker`: one rollout worker in a process of its own (a Ray actor or a worker process),
with its own engine and environment.

The driver's proxy thread for this worker (rzero.rollout.remote) calls `work` over and over;
each call loads weights when they are given (the engine recomputes the K/V in flight, as in the
local backend), starts the given groups with the same seeds as the local backend, steps the engine
for a bounded slice, and returns the samples that finished meanwhile. Environment steps run on the
worker's own asyncio loop, so slow tools wait concurrently as in-process.

This module imports no Ray: the Ray backend wraps the class with `ray.remote` when it starts
actors, and the process backend runs it in a worker process (rzero.rollout.process_backend).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable

from rzero.engine import Engine, SamplingParams
from rzero.rollout.episodes import AsyncLoop, Episode, EpisodeRunner
from rzero.rollout.orchestrator import group_params, rollout_of
from rzero.rollout.record import Rollout
from rzero.rollout.scoring import ScoreFn, VersionScorer

# One finished sample: (group, sample index, record, env failed, grader timed out).
Finished = tuple[int, int, Rollout, bool, bool]


class RolloutWorker:
    def __init__(
        self,
        make_engine: Callable[[], Engine],
        make_env: Callable[[], object],
        sampling: SamplingParams,
        group_size: int,
        seed: int,
        delay_s: float = 0.0,
        slice_s: float = 0.2,
        score: ScoreFn | None = None,
        keep_versions: int = 1,
    ):
        """`score` (the trainer's scoring function): also compute each finished rollout's
        `version_logprobs` here, for the trainer's log-ratio decomposition (rzero.rollout.scoring),
        holding the newest `keep_versions` weight versions for it."""
        self.engine, self.env = make_engine(), make_env()
        self.scorer = None if score is None else VersionScorer(self.engine.model, score, keep_versions)
        self.sampling, self.group_size, self.seed, self.slice_s = sampling, group_size, seed, slice_s
        self._changed = threading.Condition()
        self._done: list[Finished] = []
        self._loop = AsyncLoop()
        # Which life of the worker this is: a killed worker is restarted from scratch, and the proxy
        # learns of a restart it did not see fail from a new incarnation in `work`'s answer.
        self.incarnation = uuid.uuid4().hex
        self.loaded = False  # no weights loaded yet: this life must not sample until they are
        self.runner = EpisodeRunner(self.engine, self.env, self._loop, self._finished, wake=self._wake, delay_s=delay_s)

    def pid(self) -> int:
        return os.getpid()

    def work(
        self, weights: dict | None, version: int | None, starts: list[int], wait: bool = True
    ) -> tuple[str, bool, list[Finished]]:
        """Load `weights` (stamped `version`) if given, start the groups `starts`, and step the
        engine until a sample finishes (with a scorer: until the engine has no work left, so that
        one forward scores what finished together) or the slice is over. Returns (incarnation,
        whether the call ran, the samples finished so far); it does not run (starts nothing) when
        this life of the worker has no weights yet and none were given. `wait=False` (nothing in
        flight here): return right after the load."""
        if weights is not None:
            self.engine.update_weights(weights, version)
            if self.scorer is not None:
                self.scorer.add_version(version, weights)
            self.loaded = True
        if not self.loaded:
            return self.incarnation, False, []
        for g in starts:
            self.runner.add(g, self.env.task(g), group_params(self.sampling, self.group_size, self.seed, g))
        deadline = time.monotonic() + (self.slice_s if wait else 0.0)
        while True:
            with self._changed:
                left = deadline - time.monotonic()
                idle = not self.runner.has_engine_work()
                if (self._done and (self.scorer is None or idle)) or left <= 0:
                    done, self._done = self._done, []
                    break
                if idle:  # every episode waits on its environment
                    self._changed.wait(timeout=left)
                    continue
            self.runner.step()
        if self.scorer is not None:
            self.scorer.fill([rollout for _, _, rollout, _, _ in done])
        return self.incarnation, True, done

    def _finished(self, episode: Episode) -> None:  # on the env loop
        with self._changed:
            self._done.append(
                (episode.key, episode.sample, rollout_of(episode, self.sampling.transform), episode.failed, episode.grader_timeout)
            )
            self._changed.notify_all()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()
