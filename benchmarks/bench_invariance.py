"""Invariant vs standard numerics: tokens/s side by side, in one run (target <= 1.10x, docs/benchmarks.md).

    python benchmarks/bench_invariance.py [--dtype bf16|fp32] [--preset tiny-dense|tiny-moe]

Measures, interleaving invariant and standard repetitions (this machine is noisy; we report the
median over repetitions, after warm-up):

  train    forward + backward of an RL-like packed batch (16 sequences of 64-192 tokens) through
           Trainer.forward_backward, loss = -mean token logprob (Trainer.token_logprobs)
  decode   one model-level decode step: 64 sequences with ~128 cached tokens in a paged cache,
           one query token each, plus the logits of those rows
  prefill  64 prompts of ~64 tokens into a paged cache, plus the logits of each last token

Overhead = standard tokens/s / invariant tokens/s (1.00 means free; the target is <= 1.10).
`measure_modes` takes any callable, so the engine's real decode loop can be added as another row
(see `engine_decode_case`).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rzero import ops
from rzero.model.io import load_model
from rzero.model.presets import init_model
from rzero.ops import ATTN_BLOCK, AttentionMeta
from rzero.rollout.record import Rollout
from rzero.train.trainer import Trainer, TrainerSettings

MODES = ("invariant", "standard")


@dataclass
class Case:
    """One benchmark row: `setup(mode)` returns a zero-argument step that runs that numerics mode
    and processes `tokens` tokens. Setup (model copy, meta building, cache allocation) is not timed."""

    name: str
    tokens: int
    setup: Callable[[str], Callable[[], object]]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure_modes(case: Case, reps: int, warmup: int, clock: str = "wall") -> dict[str, float]:
    """Median tokens/s per mode; repetitions alternate modes (and which goes first) so drifts in
    machine load hit both alike. clock="cpu" counts CPU seconds of all threads instead of wall
    time: steadier on a shared, oversubscribed machine, blind to idle threads."""
    now = CLOCKS[clock]
    steps = {}
    for mode in MODES:
        steps[mode] = case.setup(mode)
        for _ in range(warmup):
            steps[mode]()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            start = now()
            steps[mode]()
            times[mode].append(now() - start)
    return {m: case.tokens / statistics.median(times[m]) for m in MODES}


def _random_ids(vocab: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=gen)


def _model_copy(model, mode: str):
    """A copy of the model that runs the given numerics (each mode's step has its own)."""
    model = copy.deepcopy(model)
    model.numerics = ops.numerics(mode)
    return model


def train_case(model, num_seqs: int = 16, min_len: int = 64, max_len: int = 192, seed: int = 0) -> Case:
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    gen = torch.Generator().manual_seed(seed)
    seqs = [_random_ids(model.config.vocab_size, n, gen).tolist() for n in lengths]
    # One prompt token, the rest a completion the trainer scores (random stand-in tokens).
    rollouts = [Rollout(s[:1], s[1:], [0.0] * (len(s) - 1), [0] * (len(s) - 1), 0.0) for s in seqs]

    def loss_fn(batch, logprobs):
        return -torch.cat(logprobs).mean()

    def setup(mode: str):
        trainer = Trainer(copy.deepcopy(model), model.dtype, TrainerSettings(), numerics=mode)

        def step():
            with torch.enable_grad():
                trainer.forward_backward([rollouts], loss_fn)
            trainer.zero_grad()

        return step

    return Case(f"train fwd+bwd ({num_seqs} seqs, {min_len}-{max_len} tok)", sum(lengths), setup)


def _paged_tables(total_lens: list[int]) -> tuple[list[list[int]], int]:
    tables, nxt = [], 1  # block 0 stays unused, so padding entries in block tables point at junk
    for n in total_lens:
        count = -(-n // ATTN_BLOCK)
        tables.append(list(range(nxt, nxt + count)))
        nxt += count
    return tables, nxt


def decode_case(model, batch: int = 64, ctx: int = 128, seed: int = 0) -> Case:
    rng = random.Random(seed)
    ctx_lens = [ctx + rng.randint(-16, 16) for _ in range(batch)]
    tables, num_blocks = _paged_tables([c + 1 for c in ctx_lens])
    gen = torch.Generator().manual_seed(seed)
    ids = _random_ids(model.config.vocab_size, batch, gen)

    def setup(mode: str):
        m = _model_copy(model, mode)
        caches = m.new_kv_caches(num_blocks)
        for k, v in caches:  # plausible cached keys/values; the values do not change the timing
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))
        meta = AttentionMeta.build([1] * batch, ctx_lens, tables, row_tile=m.numerics.row_tile)

        def step():
            with torch.inference_mode():
                return m.logits(m(ids, meta, caches))

        return step

    return Case(f"decode step (batch {batch}, ~{ctx} cached)", batch, setup)


def prefill_case(model, batch: int = 64, length: int = 64, seed: int = 0) -> Case:
    rng = random.Random(seed)
    q_lens = [length + rng.randint(-8, 8) for _ in range(batch)]
    tables, num_blocks = _paged_tables(q_lens)
    gen = torch.Generator().manual_seed(seed)
    ids = _random_ids(model.config.vocab_size, sum(q_lens), gen)
    last = torch.tensor(q_lens).cumsum(0) - 1

    def setup(mode: str):
        m = _model_copy(model, mode)
        caches = m.new_kv_caches(num_blocks)
        meta = AttentionMeta.build(q_lens, [0] * batch, tables, row_tile=m.numerics.row_tile)

        def step():
            with torch.inference_mode():
                return m.logits(m(ids, meta, caches)[last])

        return step

    return Case(f"prefill ({batch} prompts, ~{length} tok)", sum(q_lens), setup)


def engine_decode_case(name: str, tokens: int, run: Callable[[str], object]) -> Case:
    """Hook for the engine: `run(mode)` generates `tokens` tokens with an engine of that numerics
    mode (it must build its own state per call or be reusable). Add the result to the table via
    `report([...])`."""
    return Case(name, tokens, lambda mode: lambda: run(mode))


def report(rows: list[tuple[str, dict[str, float]]], command: str) -> None:
    print(f"\ncommand: {command}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}")
    width = max(len(name) for name, _ in rows)
    print(f"{'case':<{width}}  {'invariant tok/s':>15}  {'standard tok/s':>15}  {'overhead':>8}")
    for name, tps in rows:
        ratio = tps["standard"] / tps["invariant"]
        print(f"{name:<{width}}  {tps['invariant']:>15.0f}  {tps['standard']:>15.0f}  {ratio:>7.3f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--preset", default="tiny-dense", choices=("tiny-dense", "tiny-moe"))
    parser.add_argument("--reps", type=int, default=11, help="timed repetitions per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cases", default="train,decode,prefill")
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCKS), help="wall time or process CPU time")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(init_model(args.preset, f"{tmp}/model"), args.dtype)
    builders = {"train": train_case, "decode": decode_case, "prefill": prefill_case}
    rows = []
    for name in args.cases.split(","):
        case = builders[name](model)
        rows.append((case.name, measure_modes(case, args.reps, args.warmup, args.clock)))
        print(f"  done: {case.name}", file=sys.stderr)
    report(rows, f"python benchmarks/bench_invariance.py {' '.join(sys.argv[1:]) if argv is None else ' '.join(argv)}".strip())
    print(
        f"preset {args.preset}, dtype {args.dtype}, {args.clock} clock, median of {args.reps} interleaved reps "
        f"after {args.warmup} warm-up; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
