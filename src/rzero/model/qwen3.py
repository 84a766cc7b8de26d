"""Qwen3 dense decoder, one definition for the trainer and the engine.

Parameter names follow the Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`, ...)
so safetensors files load without renaming. Every floating-point reduction goes through the
model's `numerics` (an `rzero.ops.Numerics`, handed down to each layer in the forward pass), which
is what makes the trainer's and the engine's numbers equal bit for bit.

The forward pass works on a flat list of tokens from any number of sequences, described by an
`AttentionMeta`: whole sequences for the trainer, prompt chunks and decode steps for the engine.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rzero.ops import (
    ATTN_BLOCK, AttentionMeta, AttentionParams, DecodeBatch, DenseLayerWeights, MLPParams, Numerics, joined, packed,
    private_cache,
)
from rzero.model.qwen3_config import Qwen3Config  # noqa: F401  (the model's config, named here too)
from rzero.ops import numerics as numerics_of

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: (num_blocks, ATTN_BLOCK, Hkv, D) each


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, nx: Numerics) -> torch.Tensor:
        return nx.rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """A bias-free projection whose matmul goes through the numerics' linear."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor, nx: Numerics) -> torch.Tensor:
        return nx.linear(x, self.weight)


class Packed:
    """The weights of Linear modules that read one input, stored in one tensor whose views the
    modules' parameters are (`Qwen3ForCausalLM.pack_weights`): one GEMM for all of them, while
    parameter names, shapes and in-place weight loads (the trainer's optimizer, engine weight
    updates) stay as they were."""

    def __init__(self, linears: list[Linear]):
        self.weight, views = packed([lin.weight for lin in linears])
        for lin, view in zip(linears, views):
            lin.weight = nn.Parameter(view, requires_grad=lin.weight.requires_grad)
        self.ptrs = [v.data_ptr() for v in views]
        self.sizes = [v.shape[0] for v in views]  # each module's columns of the joined output

    def usable(self, linears: list[Linear]) -> bool:
        """Whether the modules' parameters are still views of the packed tensor."""
        return all(lin.weight.data_ptr() == ptr for lin, ptr in zip(linears, self.ptrs))


def project(x: torch.Tensor, owner: nn.Module, linears: list[Linear], nx: Numerics) -> tuple[torch.Tensor, ...]:
    """Each of `linears` applied to x, in one GEMM (the same bits as one GEMM each): on the packed
    weight when no gradient is wanted, else on the weights joined for this pass (in training,
    autograd hands each weight its rows of the gradient). Column views of one output, split by
    `split_with_sizes` (Tensor.split's Python wrapper cost as much as a small GEMM's call)."""
    packed_weights = owner.__dict__.get("packed")
    usable = packed_weights is not None and packed_weights.usable(linears)
    if usable and not torch.is_grad_enabled():  # the engine's path, with the sizes kept
        return nx.linear(x, packed_weights.weight).split_with_sizes(packed_weights.sizes, dim=-1)
    weights = [lin.weight for lin in linears]
    grad = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
    fused = packed_weights.weight if usable and not grad else joined(weights)
    return nx.linear(x, fused).split_with_sizes([w.shape[0] for w in weights], dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor, nx: Numerics) -> torch.Tensor:
        gate, up = project(x, self, [self.gate_proj, self.up_proj], nx)
        return self.down_proj(nx.silu_mul(gate, up), nx)


class Attention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMeta,
        cache: KVCache | None,
        nx: Numerics,
    ) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = project(x, self, [self.q_proj, self.k_proj, self.v_proj], nx)
        q = q.view(rows, self.num_heads, self.head_dim)
        k = k.view(rows, self.num_kv_heads, self.head_dim)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        if cache is not None:  # the engine: its paged cache, written in place
            out = nx.cached_attention(
                q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, cache, meta, self.scale
            )
            return self.o_proj(out.reshape(rows, self.num_heads * self.head_dim), nx)
        q, k = self.q_norm(q, nx), self.k_norm(k, nx)
        q, k = nx.apply_rotary(q, cos, sin), nx.apply_rotary(k, cos, sin)
        # Whole sequences (the trainer): a private cache of their own, which autograd flows through.
        out = nx.attention(q, private_cache(k, meta), private_cache(v, meta), meta, self.scale)
        return self.o_proj(out.reshape(rows, self.num_heads * self.head_dim), nx)


# Each layer's DenseLayerWeights, beside the layer rather than on it: copies and pickles of a model
# (an engine's own copy, a Ray actor's) build their own.
_DENSE_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, DenseLayerWeights] = weakref.WeakKeyDictionary()


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.build_mlp(config, layer)

    def build_mlp(self, config: Qwen3Config, layer: int) -> nn.Module:
        return MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMeta,
        cache: KVCache | None,
        nx: Numerics,
    ) -> torch.Tensor:
        if cache is not None and not torch.is_grad_enabled():  # an engine step: the same bits in fewer calls?
            weights = self.dense_weights()
            out = None if weights is None else nx.decoder_layer(h, weights, cos, sin, cache, meta, self.self_attn.scale)
            if out is not None:
                return out
        elif cache is None and torch.is_grad_enabled():  # training: each block as one autograd node?
            h2 = nx.train_attention(h, self.attention_params(), cos, sin, meta)
            if h2 is not None:
                out = nx.train_mlp(h2, self.mlp_params()) if type(self.mlp) is MLP else None
                return out if out is not None else h2 + self.mlp(self.post_attention_layernorm(h2, nx), nx)
        h = h + self.self_attn(self.input_layernorm(h, nx), cos, sin, meta, cache, nx)
        return h + self.mlp(self.post_attention_layernorm(h, nx), nx)

    def attention_params(self) -> AttentionParams:
        """This layer's attention block for `Numerics.train_attention`."""
        a = self.self_attn
        return AttentionParams(self.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                               a.q_norm.weight, a.k_norm.weight, a.o_proj.weight,
                               (self.input_layernorm.eps, a.q_norm.eps, a.k_norm.eps), a.scale, a.num_heads, a.num_kv_heads)

    def mlp_params(self) -> MLPParams:
        """This (dense) layer's MLP block for `Numerics.train_mlp`."""
        m, norm = self.mlp, self.post_attention_layernorm
        return MLPParams(norm.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, norm.eps)

    def dense_weights(self) -> DenseLayerWeights | None:
        """This layer's weights for `Numerics.decoder_layer`: a dense MLP, q/k/v and gate/up packed
        (`Qwen3ForCausalLM.pack_weights`); None otherwise. Kept while they are current."""
        kept = _DENSE_WEIGHTS.get(self)
        if kept is not None and kept.current():
            return kept
        attn, mlp = self.self_attn, self.mlp
        if type(mlp) is not MLP:
            return None
        qkv, gate_up = attn.__dict__.get("packed"), mlp.__dict__.get("packed")
        projections = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        if qkv is None or gate_up is None or not qkv.usable(projections[0]) or not gate_up.usable(projections[1]):
            return None
        norms = [self.input_layernorm, attn.q_norm, attn.k_norm, self.post_attention_layernorm]
        kept = _DENSE_WEIGHTS[self] = DenseLayerWeights(
            self.input_layernorm.weight, qkv.weight, attn.q_norm.weight, attn.k_norm.weight, attn.o_proj.weight,
            self.post_attention_layernorm.weight, gate_up.weight, gate_up.sizes, mlp.down_proj.weight,
            self.input_layernorm.eps, sources=(*norms, *projections[0], attn.o_proj, *projections[1], mlp.down_proj),
        )
        return kept


class Backbone(nn.Module):
    """`model.*` in the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, config: Qwen3Config, layer_cls: type[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: Qwen3Config, numerics: str | Numerics = "invariant"):
        super().__init__()
        self.config = config
        # The ops every forward pass of this model runs. Engines and trainers set it on their own
        # copies (`Engine(numerics=...)`, `Trainer(numerics=...)`).
        self.numerics = numerics_of(numerics)
        self.gradient_checkpointing = False  # recompute each layer in backward instead of storing it
        self.model = Backbone(config, self.layer_cls)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rotary_table(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMeta, kv_caches: list[KVCache] | None = None
    ) -> torch.Tensor:
        """Final hidden states (T, hidden) of the flat token list input_ids (T,)."""
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} input ids for an AttentionMeta of {meta.num_tokens} tokens")
        # Callers build ids and meta on the CPU from Python lists; the model runs where its weights are.
        device = self.device
        if input_ids.device != device:  # under inference_mode even a no-op .to() is an aten op (C0 counts them)
            input_ids = input_ids.to(device)
        meta = meta.to(device)
        if meta.max_position >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {meta.max_position} is beyond max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        nx = self.numerics
        if meta.padded_tokens != -(-meta.num_tokens // nx.row_tile) * nx.row_tile:
            raise ValueError(
                f"AttentionMeta pads {meta.num_tokens} tokens to {meta.padded_tokens} rows, but {nx.mode} numerics "
                f"pads to a multiple of {nx.row_tile}: build it with row_tile=model.numerics.row_tile"
            )
        # Pad the token rows once, up front, to the numerics' row tile (see rzero.ops).
        ids = nn.functional.pad(input_ids, (0, meta.padded_tokens - meta.num_tokens))
        parts = self._backbone() if kv_caches is not None and not torch.is_grad_enabled() else None
        if parts is not None:  # an engine step: the backbone in one call?
            embed, rope, layers, norm, scale = parts
            out = nx.decoder_stack(ids, meta, embed, rope, layers, kv_caches, norm, scale)
            if out is not None:
                return out[: meta.num_tokens]
        cos = self.rope_cos[meta.positions].to(self.dtype).unsqueeze(1)
        sin = self.rope_sin[meta.positions].to(self.dtype).unsqueeze(1)
        h = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            cache = None if kv_caches is None else kv_caches[i]
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, meta, cache, nx, use_reentrant=False)
            else:
                h = layer(h, cos, sin, meta, cache, nx)
        return self.model.norm(h, nx)[: meta.num_tokens]

    def _backbone(self) -> tuple | None:
        """(embedding, rotary tables, dense layers' weights, final norm and eps, attention scale) as
        the numerics' one-call paths take them; None where a layer is not dense."""
        layers = [layer.dense_weights() for layer in self.model.layers]
        return None if None in layers else (self.model.embed_tokens.weight, (self.rope_cos, self.rope_sin), layers,
                                            (self.model.norm.weight, self.model.norm.eps), self.model.layers[0].self_attn.scale)

    def decode_steps(self, batch: DecodeBatch, kv_caches: list[KVCache]) -> tuple[torch.Tensor, ...] | None:
        """Several engine decode steps in one call where the numerics has it (Numerics.decode_steps:
        the tokens and logprobs the steps one by one would give, and each row's count); None elsewhere."""
        parts = self._backbone()
        return None if parts is None else self.numerics.decode_steps(batch, kv_caches, self.lm_head.weight, *parts)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits in fp32 for the given rows of hidden states."""
        return self.lm_head(hidden, self.numerics).float()

    def pack_weights(self) -> None:
        """Store q/k/v and gate/up weights in one tensor each, and bf16 weights row-major (K, N)
        (`rzero.ops.packed`), for no-grad forward passes (the engine calls this after its cast).
        Bits unchanged; state_dict names and shapes unchanged. A later cast or weight swap only
        falls back to the unpacked path; call again to pack anew."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, Attention):
                    module.packed = Packed([module.q_proj, module.k_proj, module.v_proj])
                    singles = [module.o_proj]
                elif isinstance(module, MLP):
                    module.packed = Packed([module.gate_proj, module.up_proj])
                    singles = [module.down_proj]
                else:
                    continue
                if self.dtype == torch.bfloat16:  # only the layout changes (fp32 has nothing to gain)
                    for lin in singles:
                        Packed([lin])
            if self.dtype == torch.bfloat16:
                Packed([self.lm_head])
                if self.config.tie_word_embeddings:
                    self.model.embed_tokens.weight = self.lm_head.weight

    def new_kv_caches(self, num_blocks: int) -> list[KVCache]:
        shape = (num_blocks, ATTN_BLOCK, self.config.num_key_value_heads, self.config.head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.config.num_hidden_layers)
        ]

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Random initialisation for locally built models (normal(0, std), norms at one)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)


def rotary_table(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin for every position, computed once: every path then reads the same numbers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()
