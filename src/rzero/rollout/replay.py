"""Draw a recorded step's tokens again from the weights and the seeds, and say where they differ.

A sampled token is a function of three things: the weights that sampled it (its recorded
version), the tokens before it, and its request's generator (seeded from the run seed, the group
index, the sample and the turn; nothing else). With `invariant` numerics the engine's logits for
a token do not depend on the batch it was decoded in, nor on decode vs prefill, so one prefill
of each recorded sequence under each of its versions reproduces the original logits bit for bit,
and the same uniform draws pick the same tokens with the same behaviour logprobs μ. Under
`standard` numerics the logits of a token depend on its batch, and a replay finds the step where
the recorded bits cannot be drawn again.

Needs `rollout.recompute_on_update = true` (the default): with it off, a token's logits depend on
K/V that older weights computed, which the record does not hold.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rzero.engine.sampler import sample_generator
from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.ops import AttentionMeta
from rzero.rollout.episodes import turn_seed
from rzero.rollout.orchestrator import group_seed
from rzero.rollout.record import Rollout


def _turns(r: Rollout) -> list[list[int]]:
    """The completion positions sampled in each model turn, in order."""
    starts = r.turn_starts or [0]
    ends = starts[1:] + [len(r.completion_ids)]
    policy = set(r.policy_positions())
    return [[i for i in range(a, b) if i in policy] for a, b in zip(starts, ends)]


@torch.no_grad()
def _logprob_rows(model: Qwen3ForCausalLM, rollouts: list[Rollout], positions: list[list[int]]) -> list[torch.Tensor]:
    """For each rollout, the transformed logprob rows that predict its completion tokens at
    `positions` (one prefill of all the sequences, each cut after its last needed position: a
    causal model's logits for a prefix do not depend on what follows it)."""
    seqs = [r.prompt_ids + r.completion_ids[: max(pos) + 1] for r, pos in zip(rollouts, positions)]
    meta, _ = AttentionMeta.for_sequences([len(s) for s in seqs], row_tile=model.numerics.row_tile)
    hidden = model(torch.tensor([t for s in seqs for t in s], dtype=torch.long), meta)
    rows, offset = [], 0
    for r, s, pos in zip(rollouts, seqs, positions):
        rows.extend(offset + len(r.prompt_ids) - 1 + i for i in pos)
        offset += len(s)
    logits = model.logits(hidden[rows])
    out, cursor = [], 0
    for r, pos in zip(rollouts, positions):
        out.append(model.numerics.transformed_logprobs(logits[cursor : cursor + len(pos)], r.transform))
        cursor += len(pos)
    return out


@torch.no_grad()
def redraw_mismatch(
    model: Qwen3ForCausalLM,
    weights: Mapping[int, Mapping[str, torch.Tensor]],
    groups: list[int],
    rollouts: list[list[Rollout]],
    *,
    run_seed: int,
) -> str | None:
    """Draw every sampled token of one step's groups again; None when every token and its μ come
    out bit for bit as recorded, else a description of the first that does not.

    `model` is a scratch engine model (its dtype and numerics are the engine's); `weights` maps
    each version the tokens name to that version's state dict; group g's samples are in order.
    """
    flat = [(g, j, r) for g, members in zip(groups, rollouts) for j, r in enumerate(members)]
    versions = sorted({v for _, _, r in flat for v in r.policy_versions()})
    # (rollout index, completion position) -> its logprob row under the version that sampled it
    rows: dict[tuple[int, int], torch.Tensor] = {}
    params = dict(model.named_parameters())
    for v in versions:
        if v not in weights:
            return f"the record names weight version {v}, which the replay does not hold"
        for name, p in params.items():
            p.copy_(weights[v][name])
        chosen = [k for k, (_, _, r) in enumerate(flat) if v in r.policy_versions()]
        positions = [[i for i in flat[k][2].policy_positions() if flat[k][2].versions[i] == v] for k in chosen]
        for k, pos, lp in zip(chosen, positions, _logprob_rows(model, [flat[k][2] for k in chosen], positions)):
            rows.update(((k, i), lp[n]) for n, i in enumerate(pos))
    for k, (g, j, r) in enumerate(flat):
        task_seed = group_seed(run_seed, g)
        for turn, positions in enumerate(_turns(r)):
            generator = sample_generator(task_seed, j) if turn == 0 else sample_generator(turn_seed(task_seed, j, turn), 0)
            greedy = [r.transform.temperature == 0]
            for i in positions:
                row = rows[(k, i)]
                token = int(model.numerics.sample_tokens(row[None], greedy, [generator])[0])
                mu = float(row[token])
                if token != r.completion_ids[i] or mu != r.logprobs[i]:
                    return (
                        f"group {g} sample {j} token {i} (version {r.versions[i]}): recorded token "
                        f"{r.completion_ids[i]} with logprob {r.logprobs[i]!r}, drawn again: token {token} "
                        f"with logprob {mu!r}"
                    )
    return None

