"""One token for every sequence that has its logits, and the behaviour logprob it was drawn with.

Rows that share a sampling transform are transformed together; each row draws with its own
generator, so a request's samples depend only on its seed, never on its batch.
"""

from __future__ import annotations

import torch

from rzero.engine.sequence import Sequence
from rzero.ops import Numerics

Sampled = tuple[Sequence, int, float, list[tuple[int, float]] | None]  # seq, token, logprob, top


def sample_generator(request_seed: int, index: int) -> torch.Generator:
    """The generator of sample `index` of a request with seed `request_seed`: the only source of
    its randomness, so a recorded run's tokens can be drawn again (rzero.rollout.replay)."""
    return torch.Generator().manual_seed(request_seed * 1009 + index)


def sample(numerics: Numerics, seqs: list[Sequence], logits: torch.Tensor) -> list[Sampled]:
    transform = seqs[0].transform
    groups: dict = {}
    # One transform object for the whole batch (Sequence shares one per distinct transform) is told
    # by identity, not a dataclass hash per row; then, or with one group, no gathers or scatters.
    if not all(seq.transform is transform for seq in seqs):
        for row, seq in enumerate(seqs):
            groups.setdefault(seq.transform, []).append(row)
    if len(groups) <= 1:
        lp = numerics.transformed_logprobs(logits, transform)
        chosen = numerics.sample_tokens(lp, [transform.temperature == 0] * len(seqs), [s.uniforms for s in seqs])
        return list(zip(seqs, chosen.tolist(), lp.gather(1, chosen[:, None])[:, 0].tolist(), top_logprobs(seqs, lp)))
    tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    logprobs = torch.empty(len(seqs), device=logits.device)
    top: list[list[tuple[int, float]] | None] = [None] * len(seqs)
    for transform, rows in groups.items():
        lp = numerics.transformed_logprobs(logits[rows], transform)
        greedy = [transform.temperature == 0] * len(rows)
        chosen = numerics.sample_tokens(lp, greedy, [seqs[r].uniforms for r in rows])
        tokens[rows] = chosen
        logprobs[rows] = lp.gather(1, chosen[:, None])[:, 0]
        for r, alternatives in zip(rows, top_logprobs([seqs[r] for r in rows], lp)):
            top[r] = alternatives
    return list(zip(seqs, tokens.tolist(), logprobs.tolist(), top))


def score_prompt(numerics: Numerics, rows: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
    """Record the logprob of prompt token p + 1 for each (sequence, p) row of `logits`
    (SamplingParams.prompt_logprobs), under the sequence's own transform."""
    by_sequence: dict[int, list[int]] = {}
    for i, (seq, _) in enumerate(rows):
        by_sequence.setdefault(id(seq), []).append(i)
    for idx in by_sequence.values():  # one transform per sequence: score its rows together
        seq = rows[idx[0]][0]
        positions = [rows[i][1] for i in idx]
        targets = torch.tensor([seq.token_ids[p + 1] for p in positions], device=logits.device)
        lp = numerics.transformed_logprobs(logits[idx], seq.transform).gather(1, targets[:, None])[:, 0]
        for p, value in zip(positions, lp.tolist()):
            seq.prompt_logprobs[p] = value


def top_logprobs(seqs: list[Sequence], logprobs: torch.Tensor) -> list[list[tuple[int, float]] | None]:
    """Each row's `params.top_logprobs` most likely tokens (None for rows that ask for none).

    They are read off the sampled distribution's logprobs, so they change nothing else. A stable sort
    of the row alone gives ties to the lower id, whatever the batch; tokens the sampling transform
    truncated away (logprob -inf) are not among the alternatives.
    """
    if not any(seq.params.top_logprobs for seq in seqs):
        return [None] * len(seqs)
    top: list[list[tuple[int, float]] | None] = []
    for row, seq in enumerate(seqs):
        k = seq.params.top_logprobs
        if not k:
            top.append(None)
            continue
        values, ids = torch.sort(logprobs[row], descending=True, stable=True)
        top.append([(i, v) for i, v in zip(ids[:k].tolist(), values[:k].tolist()) if v > float("-inf")])
    return top
