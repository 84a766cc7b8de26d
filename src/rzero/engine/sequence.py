"""Requests, their sampling parameters and what the engine returns for them."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import torch

from rzero.ops import SamplingTransform
from rzero.ops.sampling import UniformStream


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings (need the engine's tokenizer)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None  # None: derived from the engine seed and the request number
    n: int = 1  # samples of the same prompt; they share the prompt's KV cache blocks
    prompt_logprobs: bool = False  # also return the logprob of each prompt token it computes
    top_logprobs: int = 0  # also return the k most likely tokens of each sampled distribution

    def __post_init__(self) -> None:
        self.transform  # validates temperature, top_p, top_k
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def transform(self) -> SamplingTransform:
        return SamplingTransform(self.temperature, self.top_k, self.top_p)


@functools.lru_cache(maxsize=1024)
def _shared(transform: SamplingTransform) -> SamplingTransform:
    """One object per distinct transform (the first one seen), so that the sampler tells a batch of
    one transform by identity instead of hashing a dataclass per row every step."""
    return transform


def cut_at_stop(text: str, stop: list[str]) -> str:
    """The text before the first stop string (the whole text when none occurs)."""
    return text[: min((text.find(s) for s in stop if s in text), default=len(text))]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StepOutput:
    """One sampled token, as the step-level API reports it."""

    request_id: str
    token_id: int
    logprob: float  # behaviour logprob under the sampling transform
    version: int  # weight version that sampled the token
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    # (token id, logprob) of the SamplingParams.top_logprobs most likely tokens, most likely first
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None
    text: str | None = None
    # prompt_logprobs[i] is the logprob of prompt token i + 1; None where it came from the prefix cache
    # (for samples 1..n-1 of a request, forked from sample 0, the whole prompt: see its output)
    prompt_logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token, with top_logprobs > 0


class Sequence:
    """One sample being generated: its tokens, its cache blocks and its bookkeeping."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        generator: torch.Generator,
    ):
        self.request_id = request_id
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.transform = _shared(params.transform)
        self.uniforms = UniformStream(generator)  # the sampler's draws (the generator's own sequence)
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.block_hashes: list[int] = []  # prefix hashes of the computed full blocks
        self.prompt_logprobs: list[float | None] | None = [None] * (len(prompt) - 1) if params.prompt_logprobs else None
        # When it ends: the engine sets both from its own limits and EOS ids (Engine.add_request).
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)
        self.length_limit = len(prompt) + params.max_tokens
        self.wait_for: Sequence | None = None  # group leader whose prompt blocks this sample reuses
        self.followers: list[Sequence] = []  # a leader's other samples, forked from its prompt (Scheduler.fork)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def __len__(self) -> int:
        return len(self.token_ids)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            token_ids=self.output_ids,
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            text=self.text,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
        )
