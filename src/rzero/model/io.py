"""Hugging Face model directories in and out: config.json + (sharded) safetensors."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM
from rzero.ops import Numerics
from rzero.model.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[Qwen3ForCausalLM]] = {
    cls.architecture: cls for cls in (Qwen3ForCausalLM, Qwen3MoeForCausalLM)
}
MODEL_TYPES = {cls.model_type: cls for cls in ARCHITECTURES.values()}
DTYPE_NAMES = ("fp32", "bf16")  # what configs and the command line offer
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[name]


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err


def model_class(raw: dict[str, Any]) -> type[Qwen3ForCausalLM]:
    for arch in raw.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if raw.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[raw["model_type"]]
    raise ValueError(
        f"unsupported architecture {raw.get('architectures') or raw.get('model_type')!r}; "
        f"rzero implements {', '.join(ARCHITECTURES)}"
    )


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "fp32", numerics: str | Numerics = "invariant"
) -> Qwen3ForCausalLM:
    """Build the model a directory describes and load its weights, cast to dtype; its forward
    passes run the given numerics."""
    model_dir = Path(model_dir)
    raw = read_config(model_dir)
    cls = model_class(raw)
    model = cls(Qwen3Config.from_hf(raw), numerics)
    model.hf_config = raw
    expected = {name: p for name, p in model.named_parameters()}  # tied weights appear once
    found: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: weight shard {path.name} listed in the index is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    found[name] = f.get_tensor(name)
        except SafetensorError as err:  # truncated or not safetensors at all
            raise ValueError(f"{path}: not a valid safetensors file ({err})") from err
    if model.config.tie_word_embeddings:
        found.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        f"{n}: checkpoint {tuple(found[n].shape)}, config expects {tuple(expected[n].shape)}"
        for n in sorted(set(expected) & set(found))
        if found[n].shape != expected[n].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:8]))
    if problems:
        raise ValueError(f"{model_dir}: weights do not match config.json ({' | '.join(problems)})")
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(found[name].to(torch.float32))
    return model.to(parse_dtype(dtype))


def save_model(
    model: Qwen3ForCausalLM,
    out_dir: str | Path,
    *,
    extra_files: Mapping[str, bytes] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> None:
    """Write config.json and safetensors (sharded past max_shard_bytes), atomically.

    The directory is assembled next to out_dir and renamed into place, so a crash mid-write never
    leaves a half-written model. `extra_files` (name -> bytes, e.g. from read_tokenizer_files) are
    written beside the weights. An existing out_dir is replaced only if it is a model directory
    and `overwrite` is set; then only the files rzero writes are replaced, nothing else is deleted.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:
        raise ValueError(f"{out_dir}: cannot create it, a parent is not a directory ({err})") from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_dtype = parse_dtype(dtype) if dtype is not None else model.dtype
        raw = dict(getattr(model, "hf_config", None) or hf_config_dict(model))
        raw["torch_dtype"] = "bfloat16" if save_dtype == torch.bfloat16 else "float32"
        if "dtype" in raw:  # transformers >= 4.56 writes and reads `dtype`; never leave it stale
            raw["dtype"] = raw["torch_dtype"]
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        tensors = {n: p.detach().to(save_dtype).cpu().contiguous() for n, p in model.named_parameters()}
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        # mkdtemp and safetensors create owner-only files; a model directory is meant to be shared.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        for fname, data in (extra_files or {}).items():
            (tmp / fname).write_bytes(data)
            os.chmod(tmp / fname, 0o644)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            # Replace our own files one by one; the user's other files stay where they are.
            for stale in _written_files(out_dir):
                if not (tmp / stale.name).exists():
                    stale.unlink()
            for f in tmp.iterdir():
                os.replace(f, out_dir / f.name)
            tmp.rmdir()
        else:
            if out_dir.is_dir():
                out_dir.rmdir()  # empty
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _written_files(model_dir: Path) -> list[Path]:
    """The files save_model writes into a model directory."""
    names = {"config.json", "model.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES}
    return [f for f in model_dir.iterdir() if f.name in names or (f.name.startswith("model-") and f.suffix == ".safetensors")]


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an output path whose contents rzero did not write (or may not replace)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a directory; refusing to replace it")
    if not any(out_dir.iterdir()):
        return
    if not (out_dir / "config.json").is_file():
        raise ValueError(f"{out_dir}: not empty and not a model directory; refusing to write into it")
    if not overwrite:
        raise ValueError(f"{out_dir}: already holds a model (use --force to overwrite it)")


def read_tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    """The tokenizer files of a model directory, read into memory (so that copies never depend on
    the directory still existing later). tokenizer.json is required."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json (every rzero model directory carries its tokenizer)")
    return {f: (model_dir / f).read_bytes() for f in TOKENIZER_FILES if (model_dir / f).is_file()}


def hf_config_dict(model: Qwen3ForCausalLM) -> dict[str, Any]:
    """A Hugging Face config.json for a model built from a Qwen3Config."""
    c = model.config
    raw: dict[str, Any] = {
        "architectures": [model.architecture],
        "model_type": model.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if c.num_experts:
        raw.update(
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            norm_topk_prob=c.norm_topk_prob,
            decoder_sparse_step=c.decoder_sparse_step,
            mlp_only_layers=list(c.mlp_only_layers),
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    return raw
