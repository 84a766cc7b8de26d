"""`Rollout`: one finished sample, the record the rollout side produces and the trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from rzero.ops import SamplingTransform


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour logprobs μ_t (0.0 for environment tokens)
    versions: list[int]  # weight version that sampled each token
    reward: float
    transform: SamplingTransform = field(default_factory=SamplingTransform)
    # 1 where the model sampled the token, 0 where the environment wrote it (a tool response):
    # environment tokens are context for the trainer, never actions. None: all sampled.
    mask: list[int] | None = None
    # Index in completion_ids where each model turn starts (each turn is its own engine request,
    # with its own seed: rzero.rollout.replay). None: one turn, starting at 0.
    turn_starts: list[int] | None = None
    # log π of each token under the weights of its own version (0.0 for environment tokens),
    # computed by the trainer's scoring function where the rollout was sampled (the process
    # backend, rzero.rollout.scoring); the log-ratio decomposition reads it. None: the trainer
    # scores the tokens itself. Not recorded (to_dict): a replay or resume scores them again.
    version_logprobs: list[float] | None = None

    def policy_positions(self) -> list[int]:
        """Indices (into completion_ids) of the tokens the model sampled."""
        if self.mask is None:
            return list(range(len(self.completion_ids)))
        return [i for i, m in enumerate(self.mask) if m]

    def policy_logprobs(self) -> list[float]:
        return [self.logprobs[i] for i in self.policy_positions()]

    def policy_versions(self) -> list[int]:
        return [self.versions[i] for i in self.policy_positions()]

    def policy_version_logprobs(self) -> list[float] | None:
        if self.version_logprobs is None:
            return None
        return [self.version_logprobs[i] for i in self.policy_positions()]

    def num_turns(self) -> int:
        """Model turns in the episode (runs of sampled tokens)."""
        if self.mask is None:
            return 1 if self.completion_ids else 0
        return sum(1 for i, m in enumerate(self.mask) if m and (i == 0 or not self.mask[i - 1]))

    def to_dict(self) -> dict:
        """The fields as JSON-ready values. The token lists are shared, not copied (dataclasses.asdict
        deep-copies every list: ~10 ms a step for the default job's 128 rollouts)."""
        d = {name: getattr(self, name) for name in _RECORDED_FIELDS}
        d["transform"] = dict(vars(self.transform))  # a flat frozen dataclass: asdict's deep walk is 10x slower
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Rollout:
        """Inverse of `to_dict`; keys of fields this version no longer has (an older checkpoint's
        `group`, `reward_failed`) are ignored."""
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if isinstance(d.get("transform"), dict):
            d["transform"] = SamplingTransform(**d["transform"])
        return cls(**d)


# The fields `to_dict` writes: all but version_logprobs (a replay or resume scores again).
_RECORDED_FIELDS = tuple(f.name for f in fields(Rollout) if f.name != "version_logprobs")
