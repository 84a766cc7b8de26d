"""Engine-side checks C2-C6: the engine's logprobs against the trainer's, and against itself in
other batches, compositions, chunkings and prefix-cache states."""

from __future__ import annotations

import math

from rzero.check.harness import CheckResult, Harness, fmt, max_abs_diff
from rzero.engine import RequestOutput, SamplingParams
from rzero.ops import ATTN_BLOCK


def c2_prefill_parity(h: Harness) -> CheckResult:
    prompt = h.tokens(57)
    [[out]] = h.run([(prompt, h.params(max_tokens=1, prompt_logprobs=True))])
    engine_lp = out.prompt_logprobs
    [trainer_lp] = h.trainer_logprobs([prompt])
    missing = sum(x is None for x in engine_lp)
    diff = max_abs_diff([math.nan if x is None else x for x in engine_lp], trainer_lp)
    return CheckResult(
        "C2", "prefill parity",
        f"trainer full-sequence logprobs vs engine prefill prompt_logprobs ({len(prompt) - 1} tokens, 1 sequence)",
        diff, diff == 0.0 and missing == 0, f"{missing} prompt logprobs missing" if missing else "",
    )


def c3_decode_parity(h: Harness) -> CheckResult:
    prompts = [h.tokens(n) for n in (20, 33, 9)]
    lengths = (48, 40, 32)
    outs = h.run([(p, h.params(max_tokens=n)) for p, n in zip(prompts, lengths)])
    outs = [o for [o] in outs]
    trainer = h.trainer_logprobs([p + o.token_ids for p, o in zip(prompts, outs)])
    diff = 0.0
    for p, o, t in zip(prompts, outs, trainer):
        diff = max(diff, max_abs_diff(o.logprobs, t[len(p) - 1 :]))
    versions = {v for o in outs for v in o.versions}
    return CheckResult(
        "C3", "decode parity",
        f"engine behaviour logprobs of {sum(lengths)} tokens decoded through the KV cache (3 concurrent seqs, T=1) "
        "vs trainer teacher-forced pass",
        diff, diff == 0.0, f"versions {sorted(versions)}",
    )


# Engine token budget per step for the batch checks: a big batch is prefilled over several steps
# while the sequences admitted first already decode, so steps mix decode tokens with prompt chunks
# (continuous batching), as they do in a real rollout.
BATCH_BUDGET = 96


def _engine_batch(h: Harness, batch: list[list[int]], pos: int, target: SamplingParams, others_max_tokens: int = 12) -> RequestOutput:
    """Run `batch` through a fresh engine with a BATCH_BUDGET token budget per step; the neighbours
    stop after 1..others_max_tokens tokens, so the decode batch shrinks. Returns row pos's output."""
    requests = [
        (seq, target if i == pos else h.params(max_tokens=h.rng.randint(1, others_max_tokens)))
        for i, seq in enumerate(batch)
    ]
    return h.run(requests, max_num_batched_tokens=BATCH_BUDGET)[pos][0]


def _prompt_lp(out: RequestOutput, n: int) -> list[float]:
    """Prompt logprobs of the first n tokens (positions 1..n-1); NaN where not computed."""
    return [math.nan if x is None else x for x in out.prompt_logprobs[: n - 1]]


def c4_batch_size_invariance(h: Harness) -> CheckResult:
    target = h.tokens(30)
    target_params = h.params(max_tokens=8, prompt_logprobs=True)
    ref_trainer = ref_engine = None
    worst_t = worst_e = 0.0
    notes = []
    for size in (1, 2, 3, 8, 31, 64):
        # first half: the target then decodes while later arrivals are still being prefilled
        pos = h.rng.randrange((size + 1) // 2)
        batch = [h.tokens(h.rng.randint(8, 48)) for _ in range(size)]
        batch[pos] = target
        t = h.trainer_logprobs(batch)[pos]
        e = _engine_batch(h, batch, pos, target_params)
        if ref_trainer is None:
            ref_trainer, ref_engine = t, e
            continue
        worst_t = max(worst_t, max_abs_diff(t, ref_trainer))
        d, note = _compare_runs(e, ref_engine)
        worst_e = max(worst_e, d, max_abs_diff(_prompt_lp(e, len(target)), _prompt_lp(ref_engine, len(target))))
        if note:
            notes.append(f"batch {size}: {note}")
    diff = max(worst_t, worst_e)
    return CheckResult(
        "C4", "batch-size invariance",
        "one 30-token sequence in batches of 1,2,3,8,31,64 random others: trainer logprobs, engine "
        f"prompt logprobs + 8 decoded tokens (continuous batching, {BATCH_BUDGET}-token steps), vs batch of 1",
        diff, diff == 0.0, f"trainer {fmt(worst_t)}, engine {fmt(worst_e)}" + "".join(f"; {n}" for n in notes),
    )


def c5_composition_invariance(h: Harness) -> CheckResult:
    target = h.tokens(37)
    n = len(target)
    pad_to = 64
    target_params = h.params(max_tokens=8, prompt_logprobs=True)

    def others(k: int, lo: int, hi: int) -> list[list[int]]:
        return [h.tokens(h.rng.randint(lo, hi)) for _ in range(k)]

    def padded(seq: list[int]) -> list[int]:
        return seq + [h.pad_id] * (pad_to - len(seq))

    compositions: dict[str, tuple[list[list[int]], int]] = {}
    mixed = others(4, 10, 50)
    compositions["first of 5"] = ([target] + mixed, 0)
    compositions["middle of 5"] = (mixed[:2] + [target] + mixed[2:], 2)
    compositions["last of 5"] = (mixed + [target], 4)
    short = others(7, 1, 4)
    compositions["short neighbours"] = (short[:3] + [target] + short[3:], 3)
    long = others(3, 100, 130)
    compositions["long neighbours"] = (long[:1] + [target] + long[1:], 1)
    # padded rows: only the target's own prompt positions are compared (the pads come after them)
    compositions["padded row"] = ([padded(target)], 0)
    compositions["padded batch"] = ([padded(s) for s in others(1, 5, 64)] + [padded(target)] + [padded(s) for s in others(2, 5, 64)], 1)

    ref_t = h.trainer_logprobs([target])[0]
    ref_e = _engine_batch(h, [target], 0, target_params)
    worst: dict[str, float] = {}
    notes = []
    for name, (batch, pos) in compositions.items():
        t = h.trainer_logprobs(batch)[pos][: n - 1]
        e = _engine_batch(h, batch, pos, target_params)
        d = max(max_abs_diff(t, ref_t), max_abs_diff(_prompt_lp(e, n), _prompt_lp(ref_e, n)))
        if not name.startswith("padded"):  # same prompt: the decoded tokens must match too
            d_gen, note = _compare_runs(e, ref_e)
            d = max(d, d_gen)
            if note:
                notes.append(f"{name}: {note}")
        worst[name] = d
    diff = max(worst.values())
    bad = [f"{k} {fmt(v)}" for k, v in worst.items() if v != 0.0]
    detail = ("differs: " + ", ".join(bad)) if bad else f"{len(compositions)} compositions"
    return CheckResult(
        "C5", "composition invariance",
        "one 37-token sequence first/middle/last, short/long neighbours, padded row/batch vs alone packed "
        "(trainer logprobs; engine prompt logprobs + 8 decoded tokens)",
        diff, diff == 0.0, detail + "".join(f"; {n}" for n in notes),
    )


def _compare_runs(a: RequestOutput, b: RequestOutput) -> tuple[float, str]:
    """Max |Δ| of two runs of the same seeded request: prompt logprobs where both computed them,
    then behaviour logprobs up to the first token where the samples diverge (a divergence with no
    difference before it counts as inf: the runs were not equal)."""
    pa = a.prompt_logprobs or []
    pb = b.prompt_logprobs or []
    both = [(x, y) for x, y in zip(pa, pb) if x is not None and y is not None]
    diff = max_abs_diff([x for x, _ in both], [y for _, y in both])
    same = 0
    while same < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[same] == b.token_ids[same]:
        same += 1
    diff = max(diff, max_abs_diff(a.logprobs[:same], b.logprobs[:same]))
    note = ""
    if a.token_ids != b.token_ids:  # same seed, different samples: the distributions differed
        note = f"samples diverge at token {same}"
        if diff == 0.0:
            diff = math.inf
    return diff, note


def c6_chunk_and_prefix_invariance(h: Harness) -> CheckResult:
    results: dict[str, float] = {}
    notes = []
    gen_tokens = 8

    # (a) chunked prefill vs one plain prefill
    prompt = h.tokens(70)
    seed = h.next_seed()
    [[plain]] = h.run([(prompt, h.params(max_tokens=gen_tokens, prompt_logprobs=True, seed=seed))])
    for chunk in (5, 16, 37):
        [[chunked]] = h.run(
            [(prompt, h.params(max_tokens=gen_tokens, prompt_logprobs=True, seed=seed))], max_num_batched_tokens=chunk
        )
        results[f"chunk {chunk}"], note = _compare_runs(chunked, plain)
        if note:
            notes.append(f"chunk {chunk}: {note}")

    # (b) continuation from a cached prefix: A computed first, then A+B reuses A's blocks
    a = h.tokens(3 * ATTN_BLOCK)
    ab = a + h.tokens(22)
    seed = h.next_seed()
    engine = h.engine()
    h.run([(a, h.params(max_tokens=1))], engine=engine)
    [[cont]] = h.run([(ab, h.params(max_tokens=gen_tokens, prompt_logprobs=True, seed=seed))], engine=engine)
    [[fresh]] = h.run([(ab, h.params(max_tokens=gen_tokens, prompt_logprobs=True, seed=seed))])
    reused = sum(x is None for x in cont.prompt_logprobs)
    results["prefix A+B"], note = _compare_runs(cont, fresh)
    if note:
        notes.append(f"prefix: {note}")
    if reused == 0:
        notes.append("prefix cache was not hit (vacuous)")
        results["prefix A+B"] = math.inf

    # (c) a GRPO group (n=4) sharing its prompt's blocks vs a plain prefill of each sample
    group = h.run([(ab, h.params(max_tokens=gen_tokens, n=4, prompt_logprobs=True))])[0]
    rescored = h.run([(ab + o.token_ids, h.params(max_tokens=1, prompt_logprobs=True)) for o in group])
    worst, shared = 0.0, 0
    for o, [r] in zip(group, rescored):
        worst = max(worst, max_abs_diff(o.logprobs, r.prompt_logprobs[len(ab) - 1 :]))
        # the prompt positions a member recomputed itself (past the shared blocks) must match too
        mine = [(x, y) for x, y in zip(o.prompt_logprobs, fresh.prompt_logprobs) if x is not None]
        worst = max(worst, max_abs_diff([x for x, _ in mine], [y for _, y in mine]))
        shared += sum(x is None for x in o.prompt_logprobs)
    results["group n=4"] = worst
    reused += shared
    if shared == 0:
        notes.append("group members did not share the prompt's blocks (vacuous)")
        results["group n=4"] = math.inf

    diff = max(results.values())
    detail = ", ".join(f"{k} {fmt(v)}" for k, v in results.items())
    detail += f"; {reused} prompt positions served from the prefix cache"
    if notes:
        detail += "; " + "; ".join(notes)
    return CheckResult(
        "C6", "chunk and prefix invariance",
        "engine chunked prefill (budgets 5,16,37), A+B after cached A, n=4 group on a shared prompt "
        "vs one plain prefill (prompt + sampled logprobs)",
        diff, diff == 0.0, detail,
    )
