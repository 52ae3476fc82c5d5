"""DeepSeek MoE layer: gate, routed experts reached through dispatch/combine, shared experts.

In one process the layer holds every expert and dispatches on logical ids. Under expert parallelism it gets
an `ExpertPlacement`: it holds only this rank's physical slots (replicas are copies), maps each chosen
logical expert to one of its physical slots and dispatches on slot ids over the EP group. The layer never
asks which rank or device it is on: the placement and the group say all it needs.

In one process the shared experts are usually folded into the routed ones (see DecoderLayer._build_moe): the
stacked experts then end with `folded_shared` shared slices, which the gate appends to every token's choices
with weight 1.0, so one grouped GEMM pair and the combine's weighted sum do the work of the separate shared
MLP and its add (6 launches per layer instead of 16 at one bf16 token on cuda_sm100). Past FOLD_MAX_TOKENS
the GEMMs are compute-bound and launches no longer matter: the slices then run as plain GEMMs on all tokens
(cuBLAS for bf16), as the separate MLP did, without gathering every token once per slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer.backend import Backend
from deepinfer.errors import ConfigError
from deepinfer.model.mlp import GatedMLP
from deepinfer.moe.placement import ExpertPlacement
from deepinfer.ops import ExpertLayout, ExpertSum, RoutingSpec
from deepinfer.weights import LinearWeight

# Tokens up to which a folded layer runs its shared slices inside the routed grouped GEMMs (to be tuned on the
# device: the grouped GEMM against cuBLAS on the shared share of the FLOPs, against the launches saved).
FOLD_MAX_TOKENS = 512


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
        folded_shared: int = 0,
    ):
        """folded_shared: how many of `experts`' last groups are shared-expert slices (one process only)."""
        if folded_shared and (placement is not None or shared_experts is not None):
            raise ConfigError("folded shared experts are for a single process with no separate shared MLP")
        self.backend = backend
        self.routing = routing
        # The router runs in float32, as DeepSeek's and transformers' do: near-tied scores decide experts.
        self.gate = LinearWeight.dense(gate_weight.float())
        self.correction_bias = None if correction_bias is None else correction_bias.float()
        self.experts = experts  # stacked: every logical expert, or this rank's slots in slot order
        self.shared_experts = shared_experts
        self.folded_shared = folded_shared
        self.fold_max_tokens = FOLD_MAX_TOKENS
        # Views of the folded slices, for batches past fold_max_tokens.
        first = routing.num_experts
        self._shared_slices = [experts.expert(first + j) for j in range(folded_shared)]
        self.placement = placement
        self.group = group  # the expert-parallel process group (None: the default group)
        self.load_hook: Callable[[torch.Tensor], None] | None = None  # EPLB: sees the logical choices [T, k]

    def set_placement(self, placement: ExpertPlacement) -> bool:
        """Switch to a new slot map (between steps, on every rank; the local expert weights were migrated in
        place: deepinfer.moe.migration). True when the switch kept the routing tensors' addresses, so captured
        decode graphs stay valid; False when it could not (they must be captured again)."""
        if self.folded_shared:
            raise ConfigError("a layer built for one process (shared experts folded in) cannot take a placement")
        kept = None if self.placement is None else placement.written_into(self.placement)
        self.placement = kept or placement
        return kept is not None

    def _route(self, x: torch.Tensor, shared: int = 0, sort: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout | None]:
        """-> (weights, ids, layout): weights and ids [T, top_k + shared], the routed choices then `shared` folded
        shared experts; with `sort`, their layout where the backend's router computes it
        (FusedOps.route_sorted), else None."""
        be = self.backend
        if x.shape[0] == 0:  # an idle expert-parallel rank joining the collectives with no tokens
            k = self.routing.top_k + shared
            return (torch.empty(0, k, dtype=torch.float32, device=x.device),
                    torch.empty(0, k, dtype=torch.int64, device=x.device), None)
        if sort:
            return be.ops.route_sorted(x, self.gate, self.routing, self.correction_bias, linear=be.linear, shared=shared)
        return (*be.ops.route(x, self.gate, self.routing, self.correction_bias, linear=be.linear, shared=shared), None)

    def _shared_apart(self, x: torch.Tensor) -> torch.Tensor:
        """The folded shared slices as plain MLPs on every token, summed."""
        out = self._shared_slices[0].forward(x)
        for mlp in self._shared_slices[1:]:
            out = out + mlp.forward(x)
        return out

    def forward(self, x: torch.Tensor, capacity: int | None = None, defer_combine: bool = False
                ) -> torch.Tensor | ExpertSum:
        """capacity: under expert parallelism, the token bound every rank's dispatch passes alike.
        defer_combine (the output goes to ops.add_rms_norm only): the backend may hand the combine back unformed
        (Backend.combine(defer=True)), for that norm to form it in its launch."""
        be = self.backend
        fold = self.folded_shared if x.shape[0] <= self.fold_max_tokens else 0
        # In one process with every slice in the choices, the router may lay them out for the dispatch too.
        weights, ids, layout = self._route(x, fold, sort=self.placement is None and fold == self.folded_shared)
        if self.load_hook is not None:
            self.load_hook(ids[:, : self.routing.top_k] if fold else ids)
        if self.placement is None:
            # The shared slices' groups are there either way (empty when not folded for this batch).
            num_experts = self.routing.num_experts + self.folded_shared
            pending = be.dispatch(x, ids, weights, num_experts, validate=False, layout=layout)  # ids from the router
        else:
            pending = be.dispatch(x, self.placement.route(ids), weights, self.placement.num_physical, self.group,
                                  validate=False, capacity=capacity)
        # Shared experts need no routed tokens: compute them while the dispatch is in flight.
        shared = None
        if self.shared_experts is not None:
            shared = self.shared_experts.forward(x)
        elif self.folded_shared and not fold:
            shared = self._shared_apart(x)
        dispatched = pending.wait()
        # Laid out by the router, every shared slice folded: the shared slices are the last groups, a row each.
        # Where the dispatch handed x itself on (one token, no copy), its rows were written before the router's
        # launch.
        tail = fold if layout is not None and dispatched.hidden_is_input else 0
        expert_out = self.experts.forward(dispatched.hidden, dispatched.group_sizes, settled_tail=tail)
        # The shared output joins the routed sum.
        return be.combine(dispatched, expert_out, add=shared, defer=defer_combine).wait()
