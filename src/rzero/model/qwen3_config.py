"""The Qwen3 / Qwen3-MoE config: the fields of a Hugging Face config.json the forward pass uses."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Qwen3Config:
    """The fields of a Hugging Face Qwen3 / Qwen3-MoE config.json that the forward pass uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    # Qwen3-MoE only (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> Qwen3Config:
        """Read a parsed config.json; reject what this implementation does not compute."""
        raw = dict(raw)
        if "head_dim" not in raw and "hidden_size" in raw and "num_attention_heads" in raw:
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        raw.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
        raw.setdefault("num_experts", raw.get("num_local_experts", 0))  # transformers 5 saves this name
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"config.json: rope type {rope.get('rope_type')!r} is not supported (only default RoPE)")
        if "rope_theta" not in raw and "rope_theta" in rope:
            raw["rope_theta"] = rope["rope_theta"]
        if raw.get("attention_bias"):
            raise ValueError("config.json: attention_bias=true is not supported (Qwen3 checkpoints have no biases)")
        if raw.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim") if raw.get(n) is None]
        if missing:
            raise ValueError(f"config.json is missing required fields: {', '.join(missing)}")
        config = cls(**{k: v for k, v in raw.items() if k in names})
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})"
            )
        return config

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )
