"""The sampling transform, shared by the engine's sampler and the trainer's scorer.

The engine samples from `transformed_logprobs(logits, transform)`; the trainer scores with the same
function on its own logits. Under trainer-inference invariance the logits are bitwise equal, so
the truncation masks and the log-probabilities are too.

Choices (docs/design.md, "Sampling transform"): temperature divides the fp32 logits; top-k keeps the k largest transformed
logits (ties at the k-th value are all kept); top-p keeps the smallest prefix of the
probability-sorted vocabulary (stable sort, so ties go to the lower token id) whose mass reaches
top_p, always at least one token. The behaviour logprob is taken under that renormalised,
truncated distribution. Temperature 0 means greedy: the argmax token, scored under temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rzero.ops import cpu_kernel


@dataclass(frozen=True)
class SamplingTransform:
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")


class _Normalizers(Protocol):
    """The two row normalisations of a numerics mode (`rzero.ops.Numerics` has them)."""

    def softmax(self, x: torch.Tensor) -> torch.Tensor: ...
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...


def transformed_logprobs(ops: _Normalizers, logits: torch.Tensor, transform: SamplingTransform) -> torch.Tensor:
    """(N, V) logits -> (N, V) fp32 log-probabilities of the distribution that is sampled, with the
    softmax and log-softmax of the given numerics."""
    x = logits.float()
    if transform.temperature > 0 and transform.temperature != 1.0:
        x = x / transform.temperature
    if transform.top_k and transform.top_k < x.shape[-1]:
        kth = torch.topk(x, transform.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if transform.top_p < 1.0:
        probs = ops.softmax(x)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = _row_cumsum(sorted_probs) - sorted_probs
        drop_sorted = mass_before >= transform.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return ops.log_softmax(x)


def _row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum along each row. On the CPU cumsum is a sequential scan, the same for any row
    count; a GPU scan may split a row differently for different batch shapes, so there each row
    is scanned alone (every scan then has the same shape)."""
    if x.device.type == "cpu":
        return x.cumsum(-1)
    return torch.stack([row.cumsum(-1) for row in x]) if len(x) else x.cumsum(-1)


# On the CPU a row's exp must take the bits it takes alone: a vectorised transcendental computes
# the elements of a scalar tail with other code. When the row length is a multiple of 64 (every
# element in the vectorised body, none in a tail) and a chunk has fewer elements than the grain at
# which PyTorch splits an elementwise op over threads, several whole rows in one call give each
# element exactly those bits, for one op call instead of one per row.
_ROW_MULTIPLE = 64
_PARALLEL_GRAIN = 32768


def _row_chunks(x: torch.Tensor) -> list[torch.Tensor]:
    rows, width = x.shape
    per_chunk = _PARALLEL_GRAIN // width if width % _ROW_MULTIPLE == 0 else 1
    return list(x.split(max(1, per_chunk)))


class UniformStream:
    """The uniforms of one CPU torch.Generator, drawn BLOCK at a time: torch.rand(n) gives exactly
    the values of n successive torch.rand(1) calls (tests/test_ops.py checks), so the stream yields
    its generator's own sequence, at one op per BLOCK draws instead of one per draw (64 draws per
    decode step cost ~100 us one by one). The generator itself runs ahead by up to a block: draw
    from the stream only."""

    BLOCK = 32

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self._drawn: list[float] = []
        self._next = 0

    def next(self) -> float:
        if self._next == len(self._drawn):
            self._drawn, self._next = torch.rand(self.BLOCK, generator=self.generator).tolist(), 0
        self._next += 1
        return self._drawn[self._next - 1]


    def give_back(self, values: list[float]) -> None:
        """Put back the last values drawn (in the order drawn): the next draws yield them again."""
        self._drawn, self._next = values + self._drawn[self._next :], 0


def _uniform(source: torch.Generator | UniformStream | None) -> float:
    if isinstance(source, UniformStream):
        return source.next()
    return torch.rand(1, generator=source).item()


def sample_tokens(
    logprobs: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | UniformStream | None]
) -> torch.Tensor:
    """Draw one token per row by inverting the row's cumulative distribution at one uniform drawn
    from the row's own generator; greedy rows take their first maximum.

    Per-row generators make a request's samples depend only on its seed, never on its batch.
    """
    # The first maximum of each row, for a batch as for a single row: max(dim).indices, which on
    # the CPU is ~3x faster than argmax over a large vocabulary and picks the same index
    # (tests/test_ops.py checks ties and NaN).
    sampled = [row for row, is_greedy in enumerate(greedy) if not is_greedy]
    if not sampled:
        return _first_max(logprobs)
    # One uniform per row, drawn on the CPU whatever the device (the per-request generators are
    # CPU generators). One draw per token rather than one per vocabulary entry (Gumbel-max): at a
    # 152k vocabulary the CPU generator took ~1.3 ms per row, more than a 0.6B model's decode step.
    uniform = torch.tensor([_uniform(generators[row]) for row in sampled], dtype=torch.float32).to(logprobs.device)
    rows = logprobs if len(sampled) == len(greedy) else logprobs[sampled]
    chosen = _inverse_cdf(rows, uniform)
    if len(sampled) == len(greedy):
        return chosen
    tokens = _first_max(logprobs)  # the greedy rows
    tokens[sampled] = chosen
    return tokens


def _inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose cumulative probability passes uniform * total mass.

    Every operation is per row: the exp, the scan (_row_cumsum) and a binary search that compares
    without arithmetic. The token found is one where the scan rose, so one with mass, never one the
    transform truncated: u <= 1 - 2^-24 (a float draw), and u * total then rounds to below the total.
    On the CPU one C pass with rzero's own exp (csrc/kernels.c, rz_inverse_cdf).
    """
    if logprobs.device.type != "cpu":
        return _search(_row_cumsum(logprobs.exp()), uniform)
    if cpu_kernel.library() is not None:
        return cpu_kernel.inverse_cdf(logprobs, uniform)
    # No compiler: torch's exp in chunks of whole rows, then its sequential scan.
    probs = torch.empty_like(logprobs)
    for chunk, out in zip(_row_chunks(logprobs), _row_chunks(probs)):
        torch.exp(chunk, out=out)
    return _search(probs.cumsum_(-1), uniform)


def _search(cumulative: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    threshold = uniform[:, None] * cumulative[:, -1:]
    return torch.searchsorted(cumulative, threshold, right=True)[:, 0]


def _first_max(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row (a NaN counts as the maximum, as in torch.argmax)."""
    return x.max(dim=-1).indices
