"""Trainer-side checks: C0 (numerics audit), C1 (weight parity), C7-C10 (sampler, MoE routing,
training forward, end-to-end ratio). They run `rzero.train.trainer.Trainer` itself."""

from __future__ import annotations

import math

import torch

from rzero import ops
from rzero.check.audit import AtenRecorder
from rzero.check.harness import (
    NA,
    SAMPLER,
    CheckResult,
    Harness,
    bitwise_equal,
    capture_moe,
    fmt,
    max_abs_diff,
    whole_sequences,
)
from rzero.engine import Engine
from rzero.rollout.record import Rollout


def c0_numerics_audit(h: Harness) -> CheckResult:
    recorder = AtenRecorder()
    seqs = [h.tokens(n) for n in (23, 40, 9)]
    with ops.trace_dispatch() as trace, recorder:
        logprobs = torch.cat(h.trainer.token_logprobs(h.model, whole_sequences(seqs)))  # trainer forward (autograd on)
        recorder.phase = "loss+backward"
        (-logprobs.mean()).backward()
        recorder.phase = "setup"
        h.trainer.zero_grad()
        engine = h.engine()
        recorder.phase = "forward"
        # engine: prefill, decode, prompt logprobs, plain and truncated sampling in one batch
        h.run(
            [
                (h.tokens(30), h.params(max_tokens=10, prompt_logprobs=True)),
                (h.tokens(17), h.params(max_tokens=12, temperature=0.7, top_k=20, top_p=0.9)),
            ],
            engine=engine,
        )
    leaked = sum(recorder.leaks.values())
    foreign = {k: v for k, v in trace.items() if not k.startswith("invariant.")}
    n_foreign = sum(foreign.values())
    owned = sum(recorder.owned.values())
    parts = []
    if recorder.leaks:
        parts.append("stock reductions outside rzero.ops: " + ", ".join(f"{k} x{v}" for k, v in recorder.leaks.most_common()))
    if foreign:
        parts.append("non-invariant rzero ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(foreign.items())))
    parts.append(
        f"{sum(trace.values())} rzero op calls, {owned} aten reductions inside them, "
        f"{recorder.num_forward_ops} forward aten ops recorded"
    )
    passed = leaked == 0 and n_foreign == 0 and owned > 0
    if owned == 0:
        parts.append("the audit recorded no reductions at all (vacuous)")
    return CheckResult(
        "C0", "numerics audit",
        "aten reductions in trainer fwd(+bwd) and engine generate: outside rzero.ops, or not invariant",
        float(leaked + n_foreign), passed, "; ".join(parts),
    )


def c1_weight_parity(h: Harness) -> CheckResult:
    trainer, engine = h.update()
    master = trainer.master
    engine_params = dict(engine.model.named_parameters())
    master_params = dict(master.named_parameters())
    if set(engine_params) != set(master_params):
        missing = sorted(set(master_params) ^ set(engine_params))
        return CheckResult("C1", "weight parity", "parameter names", math.inf, False, f"names differ: {missing[:5]}")
    worst, mismatched, changed = 0.0, [], 0
    for name, mp in master_params.items():
        expected = mp.detach().to(h.dtype)
        got = engine_params[name].detach()
        worst = max(worst, max_abs_diff(got.float(), expected.float()))
        if not bitwise_equal(got, expected):
            mismatched.append(name)
        if not bitwise_equal(expected, h.master.get_parameter(name).detach().to(h.dtype)):
            changed += 1
    detail = f"{len(master_params)} tensors, engine version {engine.version}; {changed} changed by the update"
    if mismatched:
        detail += f"; {len(mismatched)} differ: {', '.join(mismatched[:4])}"
    ok = not mismatched and worst == 0.0 and engine.version == 1 and changed > 0
    if changed == 0:
        detail += " (the update changed nothing: vacuous)"
    return CheckResult(
        "C1", "weight parity",
        f"engine params after update_weights(v=1) vs fp32 master after 1 AdamW step, cast to {h.dtype_name}",
        worst, ok, detail,
    )


def c7_sampler_parity(h: Harness) -> CheckResult:
    prompts = [h.tokens(25), h.tokens(12)]
    sp = dict(temperature=SAMPLER.temperature, top_k=SAMPLER.top_k, top_p=SAMPLER.top_p, max_tokens=32)
    outs = [o for [o] in h.run([(p, h.params(**sp)) for p in prompts])]
    trainer = h.trainer_logprobs([p + o.token_ids for p, o in zip(prompts, outs)], SAMPLER)
    diff, outside = 0.0, 0
    for p, o, t in zip(prompts, outs, trainer):
        pi = t[len(p) - 1 :]
        diff = max(diff, max_abs_diff(o.logprobs, pi))
        outside += int(torch.isinf(pi).sum())
    finite = all(math.isfinite(x) for o in outs for x in o.logprobs)
    notes = [f"{sum(len(o.token_ids) for o in outs)} tokens"]
    if outside:  # the truncation boundary moved: the trainer gives the sampled token probability 0
        notes.append(f"{outside} sampled tokens outside the trainer's top-k/top-p support (π = -inf)")
    if not finite:
        notes.append("non-finite behaviour logprob")
    return CheckResult(
        "C7", "sampler parity",
        "behaviour logprobs recorded by the sampler (T=0.7, top_k=20, top_p=0.9) vs trainer "
        "ops.transformed_logprobs under the same transform",
        diff, diff == 0.0 and finite, "; ".join(notes),
    )


def c8_moe_routing_invariance(h: Harness) -> CheckResult:
    if not h.is_moe:
        return CheckResult("C8", "MoE routing invariance", "no MoE layers (dense model)", NA, True, "")
    target = h.tokens(29)
    n = len(target)

    def trainer_capture(batch: list[list[int]], pos: int) -> list[dict[str, torch.Tensor]]:
        start = sum(len(s) for s in batch[:pos])
        with capture_moe(h.model) as records:
            h.trainer_logprobs(batch)  # the trainer's scoring pass
        return [{k: v[start : start + n] for k, v in r.items()} for r in records]

    def engine_capture(batch: list[list[int]], pos: int) -> list[dict[str, torch.Tensor]]:
        engine = h.engine()
        start = sum(len(s) for s in batch[:pos])
        for seq in batch:
            engine.add_request(seq, h.params(max_tokens=1))
        with capture_moe(engine.model) as records:
            engine.step()  # one step: the whole batch's prefill
        return [{k: v[start : start + n] for k, v in r.items()} for r in records]

    reference = trainer_capture([target], 0)
    compositions = {}
    for size in (3, 8, 31):
        pos = h.rng.randrange(size)
        batch = [h.tokens(h.rng.randint(5, 60)) for _ in range(size)]
        batch[pos] = target
        compositions[f"trainer batch {size}"] = trainer_capture(batch, pos)
    compositions["trainer padded row"] = trainer_capture([target + [h.pad_id] * 19], 0)
    compositions["engine alone"] = engine_capture([target], 0)
    batch = [h.tokens(h.rng.randint(5, 60)) for _ in range(5)]
    batch[2] = target
    compositions["engine batch 5"] = engine_capture(batch, 2)

    worst, expert_mismatch, bad = 0.0, 0, []
    for name, records in compositions.items():
        d = 0.0
        for ref, got in zip(reference, records):
            d = max(d, max_abs_diff(got["weights"], ref["weights"]), max_abs_diff(got["output"].float(), ref["output"].float()))
            m = int((got["experts"] != ref["experts"]).sum())
            expert_mismatch += m
            if m or not bitwise_equal(got["output"], ref["output"]) or not bitwise_equal(got["weights"], ref["weights"]):
                d = d if d > 0 else math.inf
        if d:
            bad.append(f"{name} {fmt(d)}")
        worst = max(worst, d)
    detail = f"{len(reference)} MoE layers x {n} tokens, {len(compositions)} compositions"
    if bad:
        detail += "; differs: " + ", ".join(bad)
    if expert_mismatch:
        detail += f"; {expert_mismatch} expert choices differ"
    return CheckResult(
        "C8", "MoE routing invariance",
        "expert ids, routing weights and MoE block outputs of one sequence alone vs in trainer batches "
        "3/8/31, padded, engine prefill",
        worst, worst == 0.0 and expert_mismatch == 0, detail,
    )


def c9_training_forward_parity(h: Harness) -> CheckResult:
    seqs = [h.tokens(h.rng.randint(12, 60)) for _ in range(6)]
    reference = torch.cat(h.trainer_logprobs(seqs))  # the no-grad scoring pass, all packed
    advantages = torch.randn(len(seqs), generator=h.gen)
    rollouts = whole_sequences(seqs)
    row = {id(r): i for i, r in enumerate(rollouts)}

    def loss_fn(micro: list[Rollout], lps: list[torch.Tensor]) -> torch.Tensor:
        return -sum((lp * advantages[row[id(r)]]).sum() for r, lp in zip(micro, lps)) / 100.0

    variants = {
        "micro-batches 1+2+3": ([1, 2, 3], False),
        "micro-batches 4+2, checkpointing": ([4, 2], True),
        "one packed batch of 6, checkpointing": ([6], True),
    }
    results = {}
    trainer = h.trainer
    for name, (sizes, checkpointing) in variants.items():
        # gradient accumulation over micro-batches: the trainer's own forward_backward
        trainer.zero_grad()
        trainer.compute.gradient_checkpointing = checkpointing
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        micro_batches = [rollouts[a:b] for a, b in zip(bounds, bounds[1:])]
        _, got, finite = trainer.forward_backward(micro_batches, loss_fn)
        grads = sum(p.grad is not None for p in trainer.compute.parameters())
        results[name] = max_abs_diff(torch.cat(got), reference) if grads and finite else math.inf
    trainer.compute.gradient_checkpointing = False
    trainer.zero_grad()
    diff = max(results.values())
    return CheckResult(
        "C9", "training-forward parity",
        "autograd training forward (params require grad; micro-batches, packing, activation checkpointing) "
        "vs no-grad forward, 6 sequences",
        diff, diff == 0.0, ", ".join(f"{k} {fmt(v)}" for k, v in results.items()),
    )


def c10_end_to_end_ratio(h: Harness) -> CheckResult:
    trainer1, engine1 = h.update()
    new_model = trainer1.compute  # version 1 in the run dtype

    def rollouts(engine: Engine) -> tuple[list[list[int]], list[list[float]], set[int]]:
        prompts = [h.tokens(14), h.tokens(23)]
        groups = h.run([(p, h.params(max_tokens=16, n=4)) for p in prompts], engine=engine)
        seqs, mus, versions = [], [], set()
        for p, group in zip(prompts, groups):
            for o in group:
                seqs.append(p + o.token_ids)
                mus.append(torch.tensor(o.logprobs, dtype=torch.float32))
                versions.update(o.versions)
        return seqs, mus, versions

    def completion(lps: list[torch.Tensor], mus: list[torch.Tensor]) -> list[torch.Tensor]:
        return [lp[len(lp) - len(mu) :] for lp, mu in zip(lps, mus)]

    # lag 0: rollouts of version v scored by the trainer at version v, for v = 0 and v = 1
    seqs0, mu0_list, versions0 = rollouts(h.engine())
    pi_old = torch.cat(completion(h.trainer_logprobs(seqs0), mu0_list))
    seqs1, mu1_list, versions1 = rollouts(engine1)
    pi_new1 = torch.cat(completion(h.trainer_logprobs(seqs1, model=new_model), mu1_list))
    mu0, mu1 = torch.cat(mu0_list), torch.cat(mu1_list)
    w = torch.exp(torch.cat([pi_old - mu0, pi_new1 - mu1]).double())
    same_version = max(max_abs_diff(pi_old, mu0), max_abs_diff(pi_new1, mu1))
    peak, median = float(w.max()), float(w.median())

    # lag 1: the version-0 rollouts scored after one update; π_old recomputed from the kept θ0
    pi_new = torch.cat(completion(h.trainer_logprobs(seqs0, model=new_model), mu0_list))
    lag_log_w = pi_new - mu0
    decomposition = max_abs_diff(lag_log_w, pi_new - pi_old)
    moved = float(lag_log_w.abs().max())
    diff = max(same_version, decomposition)
    ok = diff == 0.0 and moved > 0 and versions0 == {0} and versions1 == {1}
    detail = (
        f"lag 0: {len(w)} tokens, w peak {peak!r} median {median!r}, max |log w| {fmt(same_version)}; "
        f"lag 1: max |log w - (π_new - π_old)| {fmt(decomposition)}, max |log w| {fmt(moved)}; "
        f"versions {sorted(versions0)}/{sorted(versions1)}"
    )
    if moved == 0:
        detail += " (the update changed no logprob: vacuous)"
    return CheckResult(
        "C10", "end-to-end ratio",
        f"GRPO-like rollouts (2 prompts x 4) at v0 and v1: w at the same version (peak/median {peak:g}/{median:g}); "
        "after 1 update: log w vs π_new − π_old from kept θ0",
        diff, ok, detail,
    )
