"""The Python parts of benchmarks/device_check.sh (issue 11): one GPU, its own torch and triton.

    python benchmarks/device_check.py preflight OUT.json
    python benchmarks/device_check.py make-model DIR             # Qwen3-0.6B shape, random bf16 weights
    python benchmarks/device_check.py timing DIR OUT.json        # invariant / standard, 0.6B shape
    python benchmarks/device_check.py engine-vs-hf DIR OUT.json  # engine vs transformers generate
    python benchmarks/device_check.py train-metrics RUN_DIR OUT.json
    python benchmarks/device_check.py summarize PARTS_DIR OUT_DIR  # device_check.json + device_check.md

Each subcommand writes one JSON part; `summarize` joins the parts the script managed to write
(a part that is missing or failed shows as such: nothing is filled in).

DEVICE_CHECK_SMOKE=1 runs `timing` and `engine-vs-hf` on the CPU with tiny shapes and one
repetition: a check of this file's logic on a machine without a GPU, not a measurement.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_invariance's cases

QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)
SMOKE = os.environ.get("DEVICE_CHECK_SMOKE") == "1"
DEVICE = "cpu" if SMOKE else "cuda"
NEEDED = ("rzero", "triton", "safetensors", "tokenizers", "pydantic", "rich", "tomli_w", "transformers")


def write(path: str, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data)[:2000], flush=True)


def preflight(out: str) -> None:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure means the part cannot run
            missing.append(f"{name}: {type(err).__name__}: {err}")
    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "missing": missing}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    write(out, info)


def make_model(out_dir: str) -> None:
    from rzero.model.io import save_model
    from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=QWEN3_06B["intermediate_size"],
                                         **{k: v for k, v in QWEN3_06B.items() if k != "intermediate_size"}))
    model.init_weights(seed=0)
    save_model(model, out_dir, dtype="bf16", overwrite=True)
    print(f"wrote a Qwen3-0.6B-shaped model ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params) to {out_dir}")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _gpu_name() -> str:
    return torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (smoke run on the CPU)"


def _timed(step, reps: int, warmup: int) -> float:
    """Median seconds of a step, synchronised around each repetition."""
    for _ in range(warmup):
        step()
    _sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing(model_dir: str, out: str) -> None:
    from bench_invariance import decode_case, train_case

    from rzero.model.io import load_model

    model = load_model(model_dir, "bf16").to(DEVICE)
    rows = {}
    seqs, length, r = (2, 32, 0) if SMOKE else (16, 512, 1)
    cases = [("decode step, batch 64", decode_case(model, batch=64, ctx=128), 1 + 19 * r, 3 * r),
             (f"train step fwd+bwd, {seqs} x {length}", train_case(model, num_seqs=seqs, min_len=length, max_len=length),
              1 + 4 * r, 2 * r)]
    for name, case, reps, warmup in cases:
        seconds = {}
        for mode in ("standard", "invariant"):
            step = case.setup(mode)
            seconds[mode] = _timed(step, reps, warmup)
            del step
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        rows[name] = {"invariant_s": seconds["invariant"], "standard_s": seconds["standard"],
                      "ratio": seconds["invariant"] / seconds["standard"], "target": 1.3}
    write(out, {"gpu": _gpu_name(), "dtype": "bf16", "rows": rows})


def engine_vs_hf(model_dir: str, out: str, batch: int = 64, new_tokens: int = 128) -> None:
    from rzero.engine import Engine, SamplingParams
    from rzero.model.io import load_model, read_config

    if SMOKE:
        batch, new_tokens = 4, 4
    gen = torch.Generator().manual_seed(0)
    vocab = read_config(model_dir)["vocab_size"]
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(16, 64, (batch,), generator=gen)]
    result = {"batch": batch, "new_tokens": new_tokens, "gpu": _gpu_name()}
    model = load_model(model_dir, "bf16").to(DEVICE)  # the made model has no tokenizer: token ids in, ids out
    for mode in ("invariant", "standard"):
        engine = Engine(model, numerics=mode, dtype="bf16", device=DEVICE, eos_token_ids=[],
                        kv_cache_bytes=(64 if SMOKE else 8192) * 1024**2, max_num_seqs=batch, max_num_batched_tokens=8192)
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=1)
        engine.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True, seed=0))  # compile, warm up
        _sync()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync()
        assert all(len(o.token_ids) == new_tokens for o in outs)
        result[f"engine_{mode}_tok_s"] = batch * new_tokens / (time.perf_counter() - start)
        del engine
    del model
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        result["hf_error"] = f"transformers not importable: {err}"
        write(out, result)
        return
    # torch_dtype: understood by every transformers version (newer ones also take dtype=).
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to(DEVICE).eval()
    assert next(hf.parameters()).dtype == torch.bfloat16, "transformers did not load the model in bf16"
    result["transformers"] = importlib.import_module("transformers").__version__
    width = max(len(p) for p in prompts)
    ids = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)

    def hf_generate(n: int):
        with torch.inference_mode():
            return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=True, top_k=0, top_p=1.0, pad_token_id=0)

    hf_generate(8)
    _sync()
    start = time.perf_counter()
    got = hf_generate(new_tokens)
    _sync()
    assert got.shape == (batch, width + new_tokens), got.shape
    result["hf_tok_s"] = batch * new_tokens / (time.perf_counter() - start)
    for mode in ("invariant", "standard"):
        result[f"engine_{mode}_over_hf"] = result[f"engine_{mode}_tok_s"] / result["hf_tok_s"]
    result["target"] = 2.0
    write(out, result)


def train_metrics(run_dir: str, out: str) -> None:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kernel = [r.get("mismatch/kernel_max_abs") for r in rows]
    write(out, {
        "steps": len(rows),
        "kernel_max_abs_per_step": kernel,
        "all_exactly_zero": bool(rows) and all(k == 0.0 for k in kernel),
        "steps_without_the_metric": sum(k is None for k in kernel),
        "reward_mean_last": rows[-1].get("reward/mean") if rows else None,
    })


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def summarize(parts_dir: str, out_dir: str) -> None:
    parts = {}
    for path in sorted(Path(parts_dir).glob("*.json")):
        try:
            parts[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            parts[path.stem] = {"error": f"unreadable: {err}"}
    lines = ["# rzero device check (issue 11)", ""]
    pre = parts.get("preflight", {})
    lines += [f"GPU: {pre.get('gpu', '?')}, torch {pre.get('torch', '?')}, CUDA {pre.get('cuda', '?')}, "
              f"triton {pre.get('triton', '?')}", ""]
    if pre.get("missing"):
        lines += ["Missing modules: " + "; ".join(pre["missing"]), ""]
    lines += ["## rzero check --device cuda", "", "| model | dtype | numerics | passed | nonzero checks |", "|---|---|---|---|---|"]
    for name, part in parts.items():
        if not name.startswith("check_"):
            continue
        if "checks" not in part:
            lines.append(f"| {name} | | | error | {part.get('error', 'no output')} |")
            continue
        bad = [f"{c['id']}={c['max_abs_diff']}" for c in part["checks"] if c["max_abs_diff"] not in (0.0, "n/a")]
        lines.append(f"| {Path(part['model']).name} | {part['dtype']} | {part['numerics']} | {part['passed']} | "
                     f"{', '.join(bad) or 'none (all 0.0)'} |")
    if "timing" in parts:
        lines += ["", "## invariant / standard time (0.6B shape, bf16)", "", "| case | invariant s | standard s | ratio |",
                  "|---|---|---|---|"]
        if "error" in parts["timing"]:
            lines.append(f"| error: {parts['timing']['error']} | | | |")
        for case, row in parts["timing"].get("rows", {}).items():
            lines.append(f"| {case} | {_fmt(row['invariant_s'])} | {_fmt(row['standard_s'])} | {_fmt(row['ratio'])} |")
    if "engine_vs_hf" in parts:
        e = parts["engine_vs_hf"]
        lines += ["", "## engine vs transformers generate (batch 64, 128 new tokens)", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in e.items() if k.endswith(("tok_s", "over_hf", "error"))]
    if "train" in parts:
        t = parts["train"]
        if "error" in t:
            lines += ["", "## 50 steps of the default job on cuda", "", f"- error: {t['error']}"]
        else:
            lines += ["", "## 50 steps of the default job on cuda", "",
                      f"- steps: {t.get('steps')}; mismatch/kernel_max_abs exactly 0.0 at every step: "
                      f"{t.get('all_exactly_zero')}", f"- per step: {t.get('kernel_max_abs_per_step')}"]
    Path(out_dir, "device_check.json").write_text(json.dumps(parts, indent=1) + "\n")
    Path(out_dir, "device_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


COMMANDS = {"preflight": preflight, "make-model": make_model, "timing": timing, "engine-vs-hf": engine_vs_hf,
            "train-metrics": train_metrics, "summarize": summarize}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: device_check.py {{{','.join(COMMANDS)}}} ARGS...")
    COMMANDS[sys.argv[1]](*sys.argv[2:])
