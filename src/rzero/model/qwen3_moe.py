"""Qwen3-MoE: the Qwen3 decoder with sparse mixture-of-experts MLPs.

Checkpoint names follow Hugging Face: `mlp.gate.weight` is the router and
`mlp.experts.{e}.{gate,up,down}_proj.weight` are the experts. Routing (softmax, top-k with a
deterministic tie-break) and the weighted combine of the k expert outputs go through the numerics;
each expert's matmuls run on the rows routed to it, which the invariant matmul keeps independent
of how many other tokens share that expert.
"""

from __future__ import annotations

import torch
from torch import nn

from rzero.model.qwen3 import MLP, DecoderLayer, Linear, Qwen3Config, Qwen3ForCausalLM
from rzero.ops import Numerics


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def route(self, x: torch.Tensor, nx: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k) fp32, expert ids (T, k)) for each row of x."""
        return nx.moe_route(self.gate(x, nx), self.top_k, self.normalize)

    def forward(self, x: torch.Tensor, nx: Numerics) -> torch.Tensor:
        weights, experts = self.route(x, nx)
        outputs = x.new_zeros(x.shape[0], self.top_k, x.shape[1])
        for e in torch.unique(experts).tolist():
            rows, slots = torch.where(experts == e)
            outputs = outputs.index_put((rows, slots), self.experts[e](x[rows], nx))
        return nx.moe_combine(outputs, weights)


class MoeDecoderLayer(DecoderLayer):
    def build_mlp(self, config: Qwen3Config, layer: int) -> nn.Module:
        if config.is_moe_layer(layer):
            return SparseMoeBlock(config)
        return MLP(config.hidden_size, config.intermediate_size)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    layer_cls = MoeDecoderLayer
