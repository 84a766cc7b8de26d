"""rzero engine generation vs transformers `generate`, same model, in one run (target >= 5x, docs/benchmarks.md).

    python benchmarks/bench_engine.py [--model DIR | --model qwen3-0.6b-shape | --preset tiny-dense]
                                      [--workload uniform|rl] [--dtype bf16,fp32]
                                      [--numerics invariant,standard] [--sampling sample|greedy]
                                      [--threads N] [--clock wall|cpu] [--decode-steps-per-call K]

Workloads:

- `uniform` (default): `--batch` prompts (default 64, random token ids, lengths spread over
  [--prompt-min, --prompt-max]), `--new-tokens` new tokens each (default 128), all generated:
  rzero with ignore_eos, transformers with min_new_tokens == max_new_tokens.
- `rl`: an RL rollout step. `--prompts` prompts (default 16) that share a `--prefix`-token
  prefix (default 32; a system prompt) followed by 8-40 tokens of their own, `--n` samples each
  (default 8; rzero `SamplingParams(n=8)`, transformers `num_return_sequences=8`), at most
  `--new-tokens`. Samples end at EOS: a set of stop ids sized so that, for a near-uniform
  next-token distribution, a sample stops with probability 2 / new_tokens per token (lengths
  roughly geometric, mean about new_tokens / 2, none forced). tok/s counts the tokens each
  contender really generated (up to and including the stop token); transformers' padding after
  a row stops is not counted.

Sampling: temperature 1, no top-k / top-p, for both (default), or greedy (`--sampling greedy`).
Timing covers prefill and decode (whole generation), not model loading or KV-cache allocation.

`--model qwen3-0.6b-shape` builds a model of Qwen3-0.6B's shape (28 layers, hidden 1024, MLP
3072, 16 query / 8 KV heads of 128, vocab 151936, tied embeddings) with random weights in a
temporary directory: no download. The report then adds the FLOP/s each contender achieved
(matmul and attention FLOPs of the tokens it processed, prompt included) and this CPU's bf16
and fp32 matmul peaks measured in the same process (best of a few 2048 x 1024 x 4096 `torch.mm`).

transformers: AutoModelForCausalLM.from_pretrained(dir, dtype=...), one left-padded batch,
model.generate(use_cache=True), its default attention (SDPA). It has no invariant numerics, so
its row is the same for both numerics modes (measured once per repetition).

Repetitions interleave the contenders (and reverse the order every other repetition) so drifts in
machine load hit all alike; each number is the median over `--reps` after `--warmup` warm-ups.
`--clock cpu` times CPU seconds of the process instead of wall time (steadier on a loaded
machine; use it with `--threads 1`). rzero gets a fresh Engine per repetition (same loaded
model), so the prefix cache of an earlier repetition never skips a later one's prefill.
`--profile` adds a cProfile of one rzero generation. `--decode-steps-per-call 1` runs rzero's engine
one decode step per model call (its default runs up to 16 in one call where the batch allows:
docs/design.md, "Several decode steps per call").
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from rzero.engine.engine import Engine  # noqa: E402
from rzero.engine.sequence import SamplingParams  # noqa: E402
from rzero.model.io import load_model, parse_dtype, save_model  # noqa: E402
from rzero.model.presets import init_model  # noqa: E402
from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from rzero.ops import ATTN_BLOCK  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
QWEN3_06B_SHAPE = Qwen3Config(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
)


@dataclass
class Workload:
    prompts: list[list[int]]  # one entry per distinct prompt
    n: int  # samples per prompt
    new_tokens: int  # at most (uniform: exactly)
    stop_ids: list[int]  # empty: every sample generates exactly new_tokens


def make_prompts(vocab: int, batch: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]


def make_workload(args, vocab: int) -> Workload:
    if args.workload == "uniform":
        return Workload(make_prompts(vocab, args.batch, args.prompt_min, args.prompt_max, args.seed), 1, args.new_tokens, [])
    rng = random.Random(args.seed)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix)]
    prompts = [prefix + p for p in make_prompts(vocab, args.prompts, 8, 40, args.seed + 1)]
    stops = max(1, round(vocab * 2 / args.new_tokens))
    return Workload(prompts, args.n, args.new_tokens, rng.sample(range(vocab), stops))


def generated_length(tokens: list[int], stop_ids: set[int]) -> int:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i + 1
    return len(tokens)


def flops(config: Qwen3Config, prompt_lens: list[int], gen_lens: list[int]) -> float:
    """Matmul FLOPs of the linear layers and of attention (q.k and p.v) for every token processed:
    each prompt once per sample (the useful work, whatever a contender shares or pads)."""
    c = config
    attn_out = c.num_attention_heads * c.head_dim
    per_token = 2 * c.num_hidden_layers * (
        c.hidden_size * (attn_out + 2 * c.num_key_value_heads * c.head_dim) + attn_out * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
    ) + 2 * c.hidden_size * c.vocab_size
    total = 0.0
    for p, g in zip(prompt_lens, gen_lens):
        tokens = p + g
        total += per_token * tokens + 4 * c.num_hidden_layers * attn_out * tokens * (tokens + 1) / 2
    return total


def matmul_peak(now, dtype: torch.dtype, reps: int = 5) -> float:
    """GFLOP/s of the best of `reps` (2048 x 1024) @ (1024 x 4096) torch.mm in `dtype` on this
    process's threads, timed with the run's clock (CPU time of all threads with --clock cpu). Both
    are printed: on CPUs without AMX rzero's invariant bf16 linears run the fp32 GEMM."""
    a, b = torch.randn(2048, 1024).to(dtype), torch.randn(1024, 4096).to(dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b), now) for _ in range(reps))
    return 2 * 2048 * 1024 * 4096 / best / 1e9


def _timed(fn, now) -> float:
    start = now()
    fn()
    return now() - start


def rzero_runner(model, work: Workload, greedy: bool, mode: str, now, steps_per_call: int | None = None):
    """Returns run() -> (seconds, generated tokens, FLOPs): a fresh engine per call (not timed)."""
    longest = max(len(p) for p in work.prompts) + work.new_tokens
    # Enough blocks that nothing is preempted, whatever the model's size.
    num_blocks = len(work.prompts) * work.n * -(-longest // ATTN_BLOCK) + 1
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0, max_tokens=work.new_tokens, ignore_eos=not work.stop_ids, seed=None, n=work.n
    )

    def run():
        engine = Engine(
            model, numerics=mode, dtype=model.dtype, num_kv_blocks=num_blocks,
            max_num_seqs=len(work.prompts) * work.n, eos_token_ids=work.stop_ids,
            **({} if steps_per_call is None else {"decode_steps_per_call": steps_per_call}),
        )
        start = now()
        outs = engine.generate(work.prompts, params)
        elapsed = now() - start
        lens = [len(o.token_ids) for o in outs]
        assert work.stop_ids or all(n == work.new_tokens for n in lens)
        prompt_lens = [len(p) for p in work.prompts for _ in range(work.n)]
        return elapsed, sum(lens), flops(model.config, prompt_lens, lens)

    return run


def hf_runner(model_dir: Path, dtype: torch.dtype, work: Workload, greedy: bool, config: Qwen3Config, now):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    stops = set(work.stop_ids)
    pad = next(i for i in range(config.vocab_size) if i not in stops)  # padded positions are masked out
    width = max(len(p) for p in work.prompts)
    ids = torch.full((len(work.prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(work.prompts), width), dtype=torch.long)
    for i, p in enumerate(work.prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    if work.stop_ids:
        lengths = dict(max_new_tokens=work.new_tokens, eos_token_id=work.stop_ids)
    else:
        lengths = dict(max_new_tokens=work.new_tokens, min_new_tokens=work.new_tokens)

    def run():
        start = now()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, use_cache=True, pad_token_id=pad,
                num_return_sequences=work.n, **lengths, **sampling,
            )
        elapsed = now() - start
        lens = [generated_length(row, stops) for row in out[:, width:].tolist()]
        assert work.stop_ids or all(n == work.new_tokens for n in lens), out.shape
        prompt_lens = [len(p) for p in work.prompts for _ in range(work.n)]
        return elapsed, sum(lens), flops(config, prompt_lens, lens)

    return run


def measure(runners: dict[str, callable], reps: int, warmup: int) -> dict[str, tuple[float, float]]:
    """Median (tokens/s, FLOP/s) per contender; repetitions alternate the order."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    names = list(runners)
    rates: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            # The previous repetition's garbage (rzero's fresh engine holds reference cycles) is
            # collected before the clock starts, for every contender alike; a full collection
            # inside a timed run read ~25 ms.
            gc.collect()
            secs, tokens, work = runners[name]()
            rates[name].append((tokens / secs, work / secs))
    return {n: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for n, v in rates.items()}


def profile_once(run, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(buf.getvalue())


def build_model_dir(args, tmp: Path) -> Path:
    if args.model == "qwen3-0.6b-shape":
        model = Qwen3ForCausalLM(QWEN3_06B_SHAPE)
        model.init_weights(0)
        out = tmp / "qwen3-0.6b-shape"
        save_model(model, out, dtype="bf16")
        return out
    return Path(args.model) if args.model else init_model(args.preset, tmp / args.preset, seed=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="Hugging Face model directory, or qwen3-0.6b-shape (random weights; "
                        "default: build --preset in a temp dir)")
    parser.add_argument("--preset", default="tiny-dense", choices=("tiny-dense",))
    parser.add_argument("--workload", default="uniform", choices=("uniform", "rl"))
    parser.add_argument("--dtype", default="bf16,fp32", help="comma list of bf16, fp32")
    parser.add_argument("--numerics", default="invariant,standard", help="comma list of invariant, standard")
    parser.add_argument("--sampling", default="sample", choices=("sample", "greedy"),
                        help="sample: temperature 1 for both; greedy: argmax for both")
    parser.add_argument("--batch", type=int, default=64, help="uniform: prompts")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-min", type=int, default=16, help="uniform: shortest prompt")
    parser.add_argument("--prompt-max", type=int, default=48, help="uniform: longest prompt")
    parser.add_argument("--prompts", type=int, default=16, help="rl: distinct prompts")
    parser.add_argument("--n", type=int, default=8, help="rl: samples per prompt")
    parser.add_argument("--prefix", type=int, default=32, help="rl: tokens of the prefix every prompt shares")
    parser.add_argument("--decode-steps-per-call", type=int,
                        help="rzero's Engine(decode_steps_per_call=...) (default: the engine's, 16)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCKS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile one rzero generation per dtype/numerics")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:] if argv is None else argv)
    dtypes = args.dtype.split(",")
    modes = args.numerics.split(",")
    greedy = args.sampling == "greedy"
    now = CLOCKS[args.clock]
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(args, Path(tmp))
        rows = []
        for dtype in dtypes:
            model = load_model(model_dir, dtype)
            work = make_workload(args, model.config.vocab_size)
            runners = {"transformers": hf_runner(model_dir, parse_dtype(dtype), work, greedy, model.config, now)}
            for mode in modes:
                runners[f"rzero {mode}"] = rzero_runner(model, work, greedy, mode, now, args.decode_steps_per_call)
            rates = measure(runners, args.reps, args.warmup)
            for mode in modes:
                rows.append((dtype, mode, *rates[f"rzero {mode}"], *rates["transformers"]))
            print(f"  done: {dtype}", file=sys.stderr)
            if args.profile:
                for mode in modes:
                    print(f"\n== cProfile: rzero {mode} {dtype} (sorted by tottime) ==")
                    profile_once(runners[f"rzero {mode}"], 30)
            del model, runners
    peaks = {name: matmul_peak(now, dt) for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}

    print(f"\ncommand: {command}")
    if args.workload == "uniform":
        shape = (f"uniform: batch {args.batch} x {args.new_tokens} new tokens, prompts {args.prompt_min}-"
                 f"{args.prompt_max} tokens")
    else:
        shape = (f"rl: {args.prompts} prompts x n={args.n}, {args.prefix}-token shared prefix + 8-40 tokens, "
                 f"at most {args.new_tokens} new tokens, ending at {len(work.stop_ids)} stop ids")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}, "
        f"{args.clock} clock; model {args.model or args.preset}; {shape}; "
        f"{'greedy' if greedy else 'sampling at temperature 1'} for both; "
        f"median of {args.reps} interleaved reps after {args.warmup} warm-up; "
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(f"matmul peak of this process ({torch.get_num_threads()} threads, {args.clock} clock): "
          + ", ".join(f"{name} {value:.0f} GFLOP/s" for name, value in peaks.items()))
    print(f"{'dtype':<5}  {'numerics':<9}  {'rzero tok/s':>11}  {'HF tok/s':>9}  {'rzero/HF':>8}  "
          f"{'rzero GFLOP/s':>13}  {'HF GFLOP/s':>10}")
    for dtype, mode, ours, our_flops, hf, hf_flops in rows:
        print(f"{dtype:<5}  {mode:<9}  {ours:>11.0f}  {hf:>9.0f}  {ours / hf:>7.2f}x  "
              f"{our_flops / 1e9:>13.1f}  {hf_flops / 1e9:>10.1f}")


if __name__ == "__main__":
    main()
