"""DeepSeek MoE layer: gate, routed experts reached through dispatch/combine, shared experts."""

from __future__ import annotations

import torch

from deepinfer.backend import Backend
from deepinfer.model.mlp import GatedMLP
from deepinfer.ops import RoutingSpec
from deepinfer.weights import LinearWeight


class MoE:
    def __init__(
        self,
        backend: Backend,
        routing: RoutingSpec,
        gate_weight: torch.Tensor,
        correction_bias: torch.Tensor | None,
        experts: GatedMLP,
        shared_experts: GatedMLP | None,
    ):
        self.backend = backend
        self.routing = routing
        # The router runs in float32, as DeepSeek's and transformers' do: near-tied scores decide experts.
        self.gate = LinearWeight.dense(gate_weight.float())
        self.correction_bias = None if correction_bias is None else correction_bias.float()
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        be = self.backend
        logits = be.linear(x.float(), self.gate)
        weights, ids = be.ops.select_experts(logits, self.routing, self.correction_bias)
        pending = be.dispatch(x, ids, weights, self.routing.num_experts)
        # Shared experts need no routed tokens: compute them while the dispatch is in flight.
        shared = self.shared_experts.forward(x) if self.shared_experts is not None else None
        dispatched = pending.wait()
        expert_out = self.experts.forward(dispatched.hidden, dispatched.group_sizes)
        out = be.combine(dispatched, expert_out).wait()
        return out if shared is None else out + shared
