"""DeepSeek MoE layer: gate, routed experts reached through dispatch/combine, shared experts.

In one process the layer holds every expert and dispatches on logical ids. Under expert parallelism it gets
an `ExpertPlacement`: it holds only this rank's physical slots (replicas are copies), maps each chosen
logical expert to one of its physical slots and dispatches on slot ids over the EP group. The layer never
asks which rank or device it is on: the placement and the group say all it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer.backend import Backend
from deepinfer.model.mlp import GatedMLP
from deepinfer.moe.placement import ExpertPlacement
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
        placement: ExpertPlacement | None = None,
        group: Any = None,
    ):
        self.backend = backend
        self.routing = routing
        # The router runs in float32, as DeepSeek's and transformers' do: near-tied scores decide experts.
        self.gate = LinearWeight.dense(gate_weight.float())
        self.correction_bias = None if correction_bias is None else correction_bias.float()
        self.experts = experts  # stacked: every logical expert, or this rank's slots in slot order
        self.shared_experts = shared_experts
        self.placement = placement
        self.group = group  # the expert-parallel process group (None: the default group)
        self.load_hook: Callable[[torch.Tensor], None] | None = None  # EPLB: sees the logical choices [T, k]

    def set_placement(self, placement: ExpertPlacement, experts: GatedMLP) -> None:
        """Switch to a new slot map and the matching local expert weights (between steps, on every rank)."""
        self.placement, self.experts = placement, experts

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        be = self.backend
        if x.shape[0] == 0:  # an idle expert-parallel rank joining the collectives with no tokens
            k = self.routing.top_k
            return (torch.empty(0, k, dtype=torch.float32, device=x.device), torch.empty(0, k, dtype=torch.int64, device=x.device))
        logits = be.linear(x.float(), self.gate)
        return be.ops.select_experts(logits, self.routing, self.correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        be = self.backend
        weights, ids = self._route(x)
        if self.load_hook is not None:
            self.load_hook(ids)
        if self.placement is None:
            pending = be.dispatch(x, ids, weights, self.routing.num_experts, validate=False)  # ids from the router
        else:
            pending = be.dispatch(x, self.placement.route(ids), weights, self.placement.num_physical, self.group,
                                  validate=False)
        # Shared experts need no routed tokens: compute them while the dispatch is in flight.
        shared = self.shared_experts.forward(x) if self.shared_experts is not None else None
        dispatched = pending.wait()
        expert_out = self.experts.forward(dispatched.hidden, dispatched.group_sizes)
        out = be.combine(dispatched, expert_out).wait()
        return out if shared is None else out + shared
