"""The alignment checklist C0-C10 (BRIEF §4): `rzero check --model DIR --numerics M --dtype D`.

Each check compares two numbers that trainer-inference invariance says are bitwise equal, and
passes only when the largest difference it sees is exactly 0.0. In `invariant` numerics every check
passes; in `standard` numerics the parity checks fail with their nonzero differences (the negative
control that shows the checks can fail).

The trainer side is what a trainer does: fp32 master weights (`load_model(dir, "fp32")`), a
forward copy cast to the run dtype, packed sequences described by `AttentionMeta.for_sequences`,
logprobs through `ops.transformed_logprobs`. The engine side is `rzero.engine.Engine` on the same
directory, driven through its public request API. Every input (prompts, batch neighbours, seeds)
comes from `--seed`, so a run is reproducible.

Python API: `run_checks(model_dir, numerics, dtype, seed) -> list[CheckResult]`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rzero import ops
from rzero.check.audit import AtenRecorder
from rzero.engine import Engine, RequestOutput, SamplingParams
from rzero.model.io import load_model, parse_dtype, read_config
from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.model.qwen3_moe import SparseMoeBlock
from rzero.ops import ATTN_BLOCK, AttentionMeta, SamplingTransform

NA = "n/a"
PLAIN = SamplingTransform()  # temperature 1, no truncation: the model's own distribution
SAMPLER = SamplingTransform(temperature=0.7, top_k=20, top_p=0.9)  # the C7 transform

CHECKS: list[tuple[str, str]] = [
    ("C0", "numerics audit"),
    ("C1", "weight parity"),
    ("C2", "prefill parity"),
    ("C3", "decode parity"),
    ("C4", "batch-size invariance"),
    ("C5", "composition invariance"),
    ("C6", "chunk and prefix invariance"),
    ("C7", "sampler parity"),
    ("C8", "MoE routing invariance"),
    ("C9", "training-forward parity"),
    ("C10", "end-to-end ratio"),
]


@dataclass
class CheckResult:
    id: str
    name: str
    compared: str  # one line: what was compared with what
    max_abs_diff: float | str | None  # max |Δ| seen; "n/a" (C8 on a dense model); None if it crashed
    passed: bool
    detail: str = ""  # a short explanation: what differed, leaked op names, sanity figures
    seconds: float = 0.0

    def to_json(self) -> dict:
        diff = self.max_abs_diff
        if isinstance(diff, float) and not math.isfinite(diff):
            diff = "inf" if diff > 0 else "nan"  # keep the output strict JSON
        return {
            "id": self.id,
            "name": self.name,
            "compared": self.compared,
            "max_abs_diff": diff,
            "passed": self.passed,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
        }


# --------------------------------------------------------------------------------- comparisons


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over two equal-length sequences of numbers (exact: 0.0 iff all equal).

    Equal infinities count as equal; a length mismatch or a NaN on either side counts as inf
    (callers map a missing value to NaN, so it can never compare equal).
    """
    a = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
    b = torch.as_tensor(b, dtype=torch.float64).reshape(-1)
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    same = a == b
    d = (a - b).abs()
    d = torch.where(same, torch.zeros_like(d), d)
    d = torch.where(d.isnan(), torch.full_like(d, math.inf), d)
    return float(d.max())


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def fmt(x: float) -> str:
    return "0.0" if x == 0 else f"{x:.3g}"


# ------------------------------------------------------------------------------- trainer side


def score(model: Qwen3ForCausalLM, seqs: Sequence[Sequence[int]], transform: SamplingTransform = PLAIN) -> list[torch.Tensor]:
    """The trainer's teacher-forced logprobs: for each sequence, the logprob of tokens 1..n-1 under
    `transform`, all sequences packed into one forward pass. Grad mode is the caller's."""
    lengths = [len(s) for s in seqs]
    meta, _ = AttentionMeta.for_sequences(lengths)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    hidden = model(ids, meta)
    rows, targets, offset = [], [], 0
    for s in seqs:
        rows.extend(range(offset, offset + len(s) - 1))
        targets.extend(s[1:])
        offset += len(s)
    logprobs = ops.transformed_logprobs(model.logits(hidden[rows]), transform)
    picked = logprobs.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0]
    return list(picked.split([n - 1 for n in lengths]))


def forward_copy(master: Qwen3ForCausalLM, dtype: torch.dtype, requires_grad: bool = False) -> Qwen3ForCausalLM:
    """The trainer's forward model: a copy of the fp32 master weights cast to the run dtype."""
    model = copy.deepcopy(master).to(dtype)
    for p in model.parameters():
        p.requires_grad_(requires_grad)
        p.grad = None
    return model


@contextmanager
def capture_moe(model: Qwen3ForCausalLM) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Record, per SparseMoeBlock, the last `route` outputs (weights, expert ids) and block output."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    records: list[dict[str, torch.Tensor]] = [{} for _ in blocks]
    handles = []
    for i, block in enumerate(blocks):
        original = block.route

        def route(x, _original=original, _i=i):
            weights, experts = _original(x)
            records[_i]["weights"], records[_i]["experts"] = weights.detach().clone(), experts.clone()
            return weights, experts

        block.route = route  # instance attribute shadows the method
        handles.append(
            block.register_forward_hook(lambda mod, inp, out, _i=i: records[_i].__setitem__("output", out.detach().clone()))
        )
    try:
        yield records
    finally:
        for block, handle in zip(blocks, handles):
            handle.remove()
            del block.route


# --------------------------------------------------------------------------------- the harness


class Harness:
    """Shared state of one checklist run: the trainer's models, engine factory, seeded inputs."""

    def __init__(self, model_dir: str | Path, dtype: str, seed: int = 0):
        self.model_dir = Path(model_dir)
        read_config(self.model_dir)  # a clear error for a directory that is not a model
        self.dtype_name = dtype
        self.dtype = parse_dtype(dtype)
        self.seed = seed
        self.reseed("setup")
        self.master = load_model(self.model_dir, "fp32")  # the trainer's fp32 master weights (θ0)
        self.model = forward_copy(self.master, self.dtype)  # its forward copy in the run dtype
        self.vocab = self.master.config.vocab_size
        self.is_moe = any(isinstance(m, SparseMoeBlock) for m in self.master.modules())
        self.has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.pad_id = 0  # padding token of the C5 padded rows: the tokenizer's pad token if any
        if self.has_tokenizer:
            from rzero.model.tokenizer import PAD_TOKEN, load_tokenizer

            pad = load_tokenizer(self.model_dir).token_to_id(PAD_TOKEN)
            self.pad_id = pad if pad is not None and pad < self.vocab else 0
        self._engine_model: Qwen3ForCausalLM | None = None
        self._update: tuple[Qwen3ForCausalLM, Engine] | None = None

    # ------------------------------------------------------------------ inputs

    def reseed(self, label: str) -> None:
        """Seed the input generators from (seed, label): each check draws the same inputs whether
        it runs alone or after the others."""
        stream = zlib.crc32(f"{self.seed}/{label}".encode())
        torch.manual_seed(stream)
        self.rng = random.Random(stream)
        self.gen = torch.Generator().manual_seed(stream)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def next_seed(self) -> int:
        return self.rng.randrange(2**31)

    # ------------------------------------------------------------------ engine

    def engine(self, *, own_weights: bool = False, max_num_batched_tokens: int = 8192, num_kv_blocks: int = 512) -> Engine:
        """A fresh engine (empty prefix cache). Engines share one model loaded from the directory,
        except `own_weights=True` (a private copy, for weight updates)."""
        kw = dict(
            dtype=self.dtype_name,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=self.seed,
        )
        if own_weights or self._engine_model is None:
            if self.has_tokenizer:
                engine = Engine(self.model_dir, **kw)
            else:
                engine = Engine(load_model(self.model_dir, self.dtype), eos_token_ids=[], **kw)
            if not own_weights:
                self._engine_model = engine.model
            return engine
        return Engine(self._engine_model, eos_token_ids=[], **kw)  # requests set ignore_eos

    def run(self, requests: list[tuple[list[int], SamplingParams]], engine: Engine | None = None, **engine_kw) -> list[list[RequestOutput]]:
        """Add all requests, step the engine until they finish; outputs grouped per request."""
        engine = engine or self.engine(**engine_kw)
        ids = [engine.add_request(prompt, params) for prompt, params in requests]
        while engine.has_unfinished():
            engine.step()
        return [[engine.pop_output(i) for i in group] for group in ids]

    def params(self, **kw) -> SamplingParams:
        kw.setdefault("seed", self.next_seed())
        kw.setdefault("ignore_eos", True)
        return SamplingParams(**kw)

    # ------------------------------------------------------------------ trainer

    def trainer_logprobs(self, model: Qwen3ForCausalLM, seqs, transform: SamplingTransform = PLAIN) -> list[torch.Tensor]:
        with torch.no_grad():
            return score(model, seqs, transform)

    def update(self) -> tuple[Qwen3ForCausalLM, Engine]:
        """One trainer step (AdamW on the fp32 master, mixed precision forward in the run dtype),
        published to a fresh engine as version 1. Computed once; C1 and C10 share it."""
        if self._update is None:
            saved = self.rng, self.gen
            self.reseed("update")
            master = copy.deepcopy(self.master)
            fwd = forward_copy(master, self.dtype, requires_grad=True)
            seqs = [self.tokens(n) for n in (37, 21, 50)]
            loss = -torch.cat(score(fwd, seqs)).mean()
            loss.backward()
            grads = {n: p.grad for n, p in fwd.named_parameters()}
            for name, p in master.named_parameters():
                p.grad = None if grads[name] is None else grads[name].float()
            torch.optim.AdamW(master.parameters(), lr=1e-3, weight_decay=0.01).step()
            master.zero_grad(set_to_none=True)
            engine = self.engine(own_weights=True)
            engine.update_weights({k: v.detach() for k, v in master.state_dict().items()}, version=1)
            self._update = (master, engine)
            self.rng, self.gen = saved
        return self._update


# ----------------------------------------------------------------------------------- the checks


def c0_numerics_audit(h: Harness) -> CheckResult:
    recorder = AtenRecorder()
    model = forward_copy(h.master, h.dtype, requires_grad=True)
    seqs = [h.tokens(n) for n in (23, 40, 9)]
    with ops.trace_dispatch() as trace, recorder:
        logprobs = torch.cat(score(model, seqs))  # trainer forward (autograd on)
        recorder.phase = "loss+backward"
        (-logprobs.mean()).backward()
        recorder.phase = "setup"
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
    master, engine = h.update()
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


def c2_prefill_parity(h: Harness) -> CheckResult:
    prompt = h.tokens(57)
    [[out]] = h.run([(prompt, h.params(max_tokens=1, prompt_logprobs=True))])
    engine_lp = out.prompt_logprobs
    [trainer_lp] = h.trainer_logprobs(h.model, [prompt])
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
    trainer = h.trainer_logprobs(h.model, [p + o.token_ids for p, o in zip(prompts, outs)])
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
        t = h.trainer_logprobs(h.model, batch)[pos]
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

    ref_t = h.trainer_logprobs(h.model, [target])[0]
    ref_e = _engine_batch(h, [target], 0, target_params)
    worst: dict[str, float] = {}
    notes = []
    for name, (batch, pos) in compositions.items():
        t = h.trainer_logprobs(h.model, batch)[pos][: n - 1]
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


def c7_sampler_parity(h: Harness) -> CheckResult:
    prompts = [h.tokens(25), h.tokens(12)]
    sp = dict(temperature=SAMPLER.temperature, top_k=SAMPLER.top_k, top_p=SAMPLER.top_p, max_tokens=32)
    outs = [o for [o] in h.run([(p, h.params(**sp)) for p in prompts])]
    trainer = h.trainer_logprobs(h.model, [p + o.token_ids for p, o in zip(prompts, outs)], SAMPLER)
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
        with capture_moe(h.model) as records, torch.no_grad():
            h.model(torch.tensor([t for s in batch for t in s]), AttentionMeta.for_sequences([len(s) for s in batch])[0])
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
    reference = torch.cat(h.trainer_logprobs(h.model, seqs))  # the no-grad scoring pass, all packed
    advantages = torch.randn(len(seqs), generator=h.gen)
    variants = {
        "micro-batches 1+2+3": ([1, 2, 3], False),
        "micro-batches 4+2, checkpointing": ([4, 2], True),
        "one packed batch of 6, checkpointing": ([6], True),
    }
    results = {}
    for name, (sizes, checkpointing) in variants.items():
        model = forward_copy(h.master, h.dtype, requires_grad=True)
        model.gradient_checkpointing = checkpointing
        got, start = [], 0
        for size in sizes:  # gradient accumulation over micro-batches, as the trainer does
            micro = seqs[start : start + size]
            lps = score(model, micro)
            loss = -sum((lp * advantages[start + i]).sum() for i, lp in enumerate(lps)) / 100.0
            loss.backward()
            got.extend(lp.detach() for lp in lps)
            start += size
        grads = sum(p.grad is not None for p in model.parameters())
        results[name] = max_abs_diff(torch.cat(got), reference) if grads else math.inf
    diff = max(results.values())
    return CheckResult(
        "C9", "training-forward parity",
        "autograd training forward (params require grad; micro-batches, packing, activation checkpointing) "
        "vs no-grad forward, 6 sequences",
        diff, diff == 0.0, ", ".join(f"{k} {fmt(v)}" for k, v in results.items()),
    )


def c10_end_to_end_ratio(h: Harness) -> CheckResult:
    new_master, engine1 = h.update()
    new_model = forward_copy(new_master, h.dtype)

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
    pi_old = torch.cat(completion(h.trainer_logprobs(h.model, seqs0), mu0_list))
    seqs1, mu1_list, versions1 = rollouts(engine1)
    pi_new1 = torch.cat(completion(h.trainer_logprobs(new_model, seqs1), mu1_list))
    mu0, mu1 = torch.cat(mu0_list), torch.cat(mu1_list)
    w = torch.exp(torch.cat([pi_old - mu0, pi_new1 - mu1]).double())
    same_version = max(max_abs_diff(pi_old, mu0), max_abs_diff(pi_new1, mu1))
    peak, median = float(w.max()), float(w.median())

    # lag 1: the version-0 rollouts scored after one update; π_old recomputed from the kept θ0
    pi_new = torch.cat(completion(h.trainer_logprobs(new_model, seqs0), mu0_list))
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


CHECK_FUNCTIONS: dict[str, Callable[[Harness], CheckResult]] = {
    "C0": c0_numerics_audit,
    "C1": c1_weight_parity,
    "C2": c2_prefill_parity,
    "C3": c3_decode_parity,
    "C4": c4_batch_size_invariance,
    "C5": c5_composition_invariance,
    "C6": c6_chunk_and_prefix_invariance,
    "C7": c7_sampler_parity,
    "C8": c8_moe_routing_invariance,
    "C9": c9_training_forward_parity,
    "C10": c10_end_to_end_ratio,
}


# ---------------------------------------------------------------------------------- running


def run_checks(
    model_dir: str | Path,
    numerics: str = "invariant",
    dtype: str = "fp32",
    seed: int = 0,
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Run the checklist (all of C0-C10, or the ids in `only`) and return one result per check.

    The numerics mode is switched for the duration of the call (the CLI sets it for the process
    first, so there this is a no-op). A bad model directory raises FileNotFoundError/ValueError;
    a check that crashes is reported as failed with max_abs_diff None and the error in its detail.
    """
    ids = [cid for cid, _ in CHECKS if only is None or cid in only]
    unknown = set(only or ()) - {cid for cid, _ in CHECKS}
    if unknown:
        raise ValueError(f"unknown check ids: {', '.join(sorted(unknown))}")
    results = []
    with ops.numerics(numerics):
        harness = Harness(model_dir, dtype, seed)
        for cid in ids:
            if progress:
                progress(cid)
            start = time.perf_counter()
            harness.reseed(cid)
            try:
                result = CHECK_FUNCTIONS[cid](harness)
            except Exception as err:  # a crashing check fails; the others still run
                traceback.print_exc(file=sys.stderr)
                result = CheckResult(cid, dict(CHECKS)[cid], "(crashed)", None, False, f"error: {type(err).__name__}: {err}")
            result.seconds = time.perf_counter() - start
            results.append(result)
    return results


def report(results: list[CheckResult], model_dir: str | Path, numerics: str, dtype: str, seconds: float | None = None) -> dict:
    out = {
        "numerics": numerics,
        "dtype": dtype,
        "model": str(model_dir),
        "passed": all(r.passed for r in results),
        "checks": [r.to_json() for r in results],
    }
    if seconds is not None:
        out["seconds"] = round(seconds, 2)
    return out


def print_table(results: list[CheckResult], model_dir, numerics: str, dtype: str, seconds: float, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=max(140, Console().width))
    table = Table(title=f"rzero check  {model_dir}  numerics={numerics}  dtype={dtype}", show_lines=False)
    table.add_column("check", no_wrap=True)
    table.add_column("name", no_wrap=True)
    table.add_column("compared", ratio=1)
    table.add_column("max |Δ|", justify="right", no_wrap=True)
    table.add_column("result", no_wrap=True)
    for r in results:
        diff = r.max_abs_diff
        shown = "error" if diff is None else diff if isinstance(diff, str) else fmt(diff)
        verdict = "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]"
        compared = r.compared + (f"\n[dim]{r.detail}[/dim]" if r.detail else "")
        table.add_row(r.id, r.name, compared, shown, verdict)
    console.print(table)
    passed = sum(r.passed for r in results)
    colour = "green" if passed == len(results) else "red"
    console.print(f"[{colour}]{passed}/{len(results)} checks passed[/{colour}] in {seconds:.1f} s")


def main(args: argparse.Namespace) -> int:
    """`rzero check`: exit 0 iff every check passes, 1 otherwise (the CLI maps bad input to 2)."""
    ops.set_numerics(args.numerics)  # once, for the whole process
    start = time.perf_counter()
    progress = None
    if not args.json and sys.stderr.isatty():
        progress = lambda cid: print(f"  running {cid} ...", file=sys.stderr, flush=True)  # noqa: E731
    results = run_checks(args.model, args.numerics, args.dtype, seed=args.seed, progress=progress)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(report(results, args.model, args.numerics, args.dtype, seconds)))
    else:
        print_table(results, args.model, args.numerics, args.dtype, seconds)
    return 0 if all(r.passed for r in results) else 1
