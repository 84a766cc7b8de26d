"""`VersionScorer`: the trainer's log π of each sampled token under its own version's weights,
computed in the rollout worker that sampled it.

The log-ratio decomposition (docs/design.md) needs log π_θv(a_t) for every token, v being the
version that sampled it: log π_θ − log π_θv is the weight lag, log π_θv − log μ the kernel
mismatch. The trainer can compute it itself (one forward per old version, on its critical path),
or a worker process on the same machine computes it here, on a core the trainer does not use,
with the same function (`Trainer.token_logprobs`, handed in by the run), the same numerics and
the very weights the trainer published as version v (not the engine's loaded copy, so a fault in
loading them still shows as kernel mismatch). Invariant numerics make the result the trainer's own
bit for bit whatever the batch (tests/test_process_backend.py compares whole runs). The cost: a
second copy of the model in each worker, and a teacher-forced forward per finished batch there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from rzero.rollout.record import Rollout

# (model, rollouts) -> log π of each rollout's policy tokens under the model: Trainer.token_logprobs
ScoreFn = Callable[[torch.nn.Module, list[Rollout]], list[torch.Tensor]]


class VersionScorer:
    def __init__(self, template: torch.nn.Module, score: ScoreFn, keep_versions: int):
        """`template`: a model of the trainer's architecture, dtype and numerics (its weights are
        replaced); `keep_versions`: how many of the newest versions to hold (max_lag + 1: older
        tokens make their group stale, and the trainer drops it)."""
        self.model = copy.deepcopy(template).eval().requires_grad_(False)
        self.model.pack_weights()
        self.score, self.keep_versions = score, keep_versions
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self._holds: int | None = None  # the version whose weights self.model holds

    def add_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """The published weights of `version` (kept by reference: shared memory, no copy)."""
        self.weights[version] = weights
        for old in [v for v in self.weights if v <= version - self.keep_versions]:
            del self.weights[old]

    def fill(self, rollouts: list[Rollout]) -> None:
        """Set `version_logprobs` of each rollout whose versions are all held (the others keep
        None, and the trainer scores them itself): one forward per version."""
        by_version: dict[int, list[int]] = {}
        for i, r in enumerate(rollouts):
            versions = set(r.policy_versions())
            if versions and versions <= self.weights.keys():
                for v in versions:
                    by_version.setdefault(v, []).append(i)
        scored = {i: [0.0] * len(rollouts[i].completion_ids) for ids in by_version.values() for i in ids}
        for v, ids in sorted(by_version.items()):
            self._load(v)
            with torch.no_grad():
                logprobs = self.score(self.model, [rollouts[i] for i in ids])
            for i, lp in zip(ids, logprobs):
                r, values = rollouts[i], lp.tolist()
                for j, pos in enumerate(r.policy_positions()):
                    if r.versions[pos] == v:
                        scored[i][pos] = values[j]
        for i, values in scored.items():
            rollouts[i].version_logprobs = values

    def _load(self, version: int) -> None:
        if self._holds == version:
            return
        weights = self.weights[version]
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(weights[name])
        self._holds = version
