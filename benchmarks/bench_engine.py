"""rzero engine generation vs transformers `generate`, same model, in one run (target >= 5x, docs/benchmarks.md).

    python benchmarks/bench_engine.py [--model DIR | --preset tiny-dense] [--dtype bf16,fp32]
                                      [--numerics invariant,standard] [--sampling sample|greedy]

Workload: `--batch` prompts (default 64, random token ids, lengths spread over
[--prompt-min, --prompt-max]), `--new-tokens` new tokens each (default 128), all generated:
rzero with ignore_eos, transformers with min_new_tokens == max_new_tokens, so both produce
exactly batch * new_tokens tokens. Sampling: temperature 1, no top-k / top-p, for both (default),
or greedy for both (`--sampling greedy`). Timing covers prefill and decode (whole generation),
not model loading or KV-cache allocation.

transformers: AutoModelForCausalLM.from_pretrained(dir, dtype=...), one left-padded batch,
model.generate(use_cache=True), its default attention (SDPA). It has no invariant numerics, so
its row is the same for both numerics modes (measured once per repetition).

Repetitions interleave the contenders (and reverse the order every other repetition) so drifts in
machine load hit all alike; each number is the median over `--reps` after `--warmup` warm-ups.
rzero gets a fresh Engine per repetition (same loaded model), so the prefix cache of an earlier
repetition never skips a later one's prefill. `--profile` adds a cProfile of one rzero generation.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from rzero.engine.engine import Engine  # noqa: E402
from rzero.engine.sequence import SamplingParams  # noqa: E402
from rzero.model.io import load_model, parse_dtype  # noqa: E402
from rzero.model.presets import init_model  # noqa: E402
from rzero.ops import ATTN_BLOCK  # noqa: E402


def make_prompts(vocab: int, batch: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(batch)]


def rzero_runner(model, prompts: list[list[int]], new_tokens: int, greedy: bool, mode: str):
    """Returns run(): a fresh engine per call (not timed) and the timed generation."""
    longest = max(len(p) for p in prompts) + new_tokens
    # Enough blocks that nothing is preempted, whatever the model's size.
    num_blocks = len(prompts) * -(-longest // ATTN_BLOCK) + 1
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=new_tokens, ignore_eos=True, seed=None)

    def run() -> float:
        engine = Engine(
            model, numerics=mode, dtype=model.dtype, num_kv_blocks=num_blocks, max_num_seqs=len(prompts),
            eos_token_ids=[],
        )
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return elapsed

    return run


def hf_runner(model_dir: Path, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int, greedy: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = 0  # any id: padded positions are masked out
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

    def run() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                use_cache=True,
                pad_token_id=pad,
                **sampling,
            )
        elapsed = time.perf_counter() - start
        assert out.shape == (len(prompts), width + new_tokens), out.shape
        return elapsed

    return run


def measure(runners: dict[str, callable], reps: int, warmup: int) -> dict[str, float]:
    """Median seconds per contender; repetitions alternate the order."""
    for run in runners.values():
        for _ in range(warmup):
            run()
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            times[name].append(runners[name]())
    return {n: statistics.median(t) for n, t in times.items()}


def profile_once(run, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="Hugging Face model directory (default: build --preset in a temp dir)")
    parser.add_argument("--preset", default="tiny-dense", choices=("tiny-dense",))
    parser.add_argument("--dtype", default="bf16,fp32", help="comma list of bf16, fp32")
    parser.add_argument("--numerics", default="invariant,standard", help="comma list of invariant, standard")
    parser.add_argument("--sampling", default="sample", choices=("sample", "greedy"),
                        help="sample: temperature 1 for both; greedy: argmax for both")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile one rzero generation per dtype/numerics")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:] if argv is None else argv)
    dtypes = args.dtype.split(",")
    modes = args.numerics.split(",")
    greedy = args.sampling == "greedy"
    tokens = args.batch * args.new_tokens

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else init_model(args.preset, Path(tmp) / args.preset, seed=0)
        rows = []
        for dtype in dtypes:
            model = load_model(model_dir, dtype)
            prompts = make_prompts(model.config.vocab_size, args.batch, args.prompt_min, args.prompt_max, args.seed)
            runners = {"transformers": hf_runner(model_dir, parse_dtype(dtype), prompts, args.new_tokens, greedy)}
            for mode in modes:
                runners[f"rzero {mode}"] = rzero_runner(model, prompts, args.new_tokens, greedy, mode)
            secs = measure(runners, args.reps, args.warmup)
            for mode in modes:
                rows.append((dtype, mode, tokens / secs[f"rzero {mode}"], tokens / secs["transformers"]))
            print(f"  done: {dtype}", file=sys.stderr)
            if args.profile:
                for mode in modes:
                    print(f"\n== cProfile: rzero {mode} {dtype} (sorted by tottime) ==")
                    profile_once(runners[f"rzero {mode}"], 30)

    print(f"\ncommand: {command}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}; "
        f"model {args.model or args.preset}; batch {args.batch} x {args.new_tokens} new tokens, "
        f"prompts {args.prompt_min}-{args.prompt_max} tokens; "
        f"{'greedy' if greedy else 'sampling at temperature 1'} for both; "
        f"median of {args.reps} interleaved reps after {args.warmup} warm-up"
    )
    print(f"{'dtype':<5}  {'numerics':<9}  {'rzero tok/s':>11}  {'HF tok/s':>9}  {'rzero/HF':>8}")
    for dtype, mode, ours, hf in rows:
        print(f"{dtype:<5}  {mode:<9}  {ours:>11.0f}  {hf:>9.0f}  {ours / hf:>7.2f}x")


if __name__ == "__main__":
    main()
