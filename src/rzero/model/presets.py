"""Tiny locally built models: `rzero init-model --preset tiny-dense|tiny-moe`."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rzero.model.io import check_output_dir, read_tokenizer_files, save_model
from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM
from rzero.model.qwen3_moe import Qwen3MoeForCausalLM
from rzero.model.tokenizer import build_tokenizer

_COMMON = dict(
    vocab_size=1024,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
)

# ~1.2 M parameters dense; ~1.9 M MoE (8 experts, top-2): both train on two CPU cores in minutes.
PRESETS: dict[str, tuple[type[Qwen3ForCausalLM], Qwen3Config]] = {
    "tiny-dense": (Qwen3ForCausalLM, Qwen3Config(intermediate_size=512, **_COMMON)),
    "tiny-moe": (
        Qwen3MoeForCausalLM,
        Qwen3Config(
            intermediate_size=512,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            norm_topk_prob=True,
            **_COMMON,
        ),
    ),
}


def init_model(preset: str, out_dir: str | Path, seed: int = 0, dtype: str = "fp32", overwrite: bool = False) -> Path:
    """Write a randomly initialised model directory with its tokenizer; returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cls, config = PRESETS[preset]
    model = cls(config)
    model.init_weights(seed)
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)  # before any work, and before writing the tokenizer beside it
    with tempfile.TemporaryDirectory() as tok_dir:
        build_tokenizer(Path(tok_dir), vocab_size=config.vocab_size)
        tokenizer_files = read_tokenizer_files(tok_dir)
    save_model(model, out_dir, extra_files=tokenizer_files, dtype=dtype, overwrite=overwrite)
    return out_dir
