"""EPLB on one rank: record expert load, decide with the other ranks when to rebalance, migrate the weights.

Every call here is collective over the expert-parallel group and must be made by all ranks at the same
engine step (the expert-parallel runtime calls `after_step` once per lockstep step). Rank 0 computes the new
placement and broadcasts it, so float ties or platform differences can never split the ranks' views.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.backend import Backend
from deepinfer.errors import ConfigError
from deepinfer.model.moe import MoE
from deepinfer.moe.migration import migrate_experts_in_place, plan_migration
from deepinfer.moe.placement import ModelPlacement, align_to, imbalance
from deepinfer.moe.policy import EPLBConfig, RebalanceTrigger
from deepinfer.moe.recorder import ExpertLoadRecorder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceEvent:
    step: int
    reason: str
    transfers: int  # expert copies moved between ranks, over all layers
    imbalance_before: float  # modelled max/mean GPU load of the window under the old placement
    imbalance_after: float
    in_place: bool = True  # weights and routing tables kept their addresses: captured graphs are still valid


class ExpertLoadBalancer:
    def __init__(self, backend: Backend, moe_layers: dict[int, MoE], placement: ModelPlacement, config: EPLBConfig, *,
                 rank: int, num_nodes: int, num_groups: int, group: Any = None, cpu_group: Any = None):
        """moe_layers: the model's MoE layers by layer index (those of `placement.layer_ids`); group: the
        expert-parallel group (device collectives); cpu_group: a gloo group over the same ranks (host tensors)."""
        missing = set(placement.layer_ids) - set(moe_layers)
        if missing:
            raise ConfigError(f"the placement covers layers {sorted(missing)} that are not MoE layers of the model")
        self.backend = backend
        self.layers = moe_layers
        self.placement = placement
        self.config = config
        self.rank, self.num_nodes, self.num_groups = rank, num_nodes, num_groups
        self.group, self.cpu_group = group, cpu_group
        self.trigger = RebalanceTrigger(config)
        self.recorder = ExpertLoadRecorder(len(placement.layer_ids), placement.num_logical, config.window_size, backend.device)
        for row, layer_id in enumerate(placement.layer_ids):
            moe_layers[layer_id].load_hook = self.recorder.hook(row)
        self.events: list[RebalanceEvent] = []

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def global_load(self) -> torch.Tensor:
        """The window's token counts [layers, E] summed over the ranks (collective), on the CPU."""
        load = self.recorder.window_load()
        if self.num_ranks > 1:
            load = self.backend.all_reduce(load.clone(), self.group)
        return load.cpu()

    def after_step(self) -> RebalanceEvent | None:
        """Close the step in the recorder; rebalance when the trigger says so (collective, every rank)."""
        self.recorder.advance()
        reason = self.trigger.tick()
        if reason is None:
            return None
        load = self.global_load()
        if reason == "interval":
            self.trigger.rebalanced()  # the next interval starts now, whether or not weights move
        # Every rank sees the same load and step count, hence makes the same call here.
        if not self.trigger.worth_checking(reason, self.placement.phy2log, load, self.num_ranks):
            return None
        return self._switch(load, lambda candidate: self.trigger.decide(reason, self.placement.phy2log, candidate, load, self.num_ranks))

    def rebalance(self, load: torch.Tensor | None = None, reason: str = "requested") -> RebalanceEvent:
        """Compute EPLB's placement for `load` (default: the window's), move the weights, switch every layer.

        Collective: all ranks call it together; rank 0's placement is the one used.
        """
        load = self.global_load() if load is None else load.detach().cpu().to(torch.float64)
        event = self._switch(load, lambda candidate: reason or "requested")
        if event is None:  # unreachable: rank 0 always says yes here
            raise RuntimeError("rank 0 declined a requested rebalance")
        return event

    def _switch(self, load: torch.Tensor, decide: Callable[[torch.Tensor], str | None]) -> RebalanceEvent | None:
        """Rank 0 computes the placement and decides; one broadcast carries both (row 0 of the message is
        the verdict) so the ranks cannot disagree."""
        old = self.placement
        message = torch.zeros(1 + old.phy2log.shape[0], old.num_physical, dtype=torch.int64)
        reason = ""
        if self.rank == 0:
            fresh = ModelPlacement.balanced(old.layer_ids, load, old.num_physical, self.num_groups, self.num_nodes, self.num_ranks)
            message[1:] = align_to(old.phy2log, fresh.phy2log, self.num_ranks, self.num_nodes)
            reason = decide(message[1:]) or ""
            message[0, 0] = int(bool(reason))
        if self.num_ranks > 1:
            dist.broadcast(message, src=0, group=self.cpu_group)  # global rank 0: the EP group is the world
        if not int(message[0, 0]):
            return None
        reason = reason or "rank 0's decision"
        new = ModelPlacement(old.layer_ids, message[1:].clone(), old.num_logical, self.num_ranks)
        transfers, in_place = 0, True
        for row, layer_id in enumerate(old.layer_ids):
            plan = plan_migration(old.phy2log[row].tolist(), new.phy2log[row].tolist(), self.num_ranks)
            transfers += plan.transfers
            moe = self.layers[layer_id]
            migrate_experts_in_place(moe.experts, plan, self.rank, self.group)
            in_place &= moe.set_placement(new.layer(layer_id, self.rank, self.backend.device))
        self.placement = new
        self.trigger.rebalanced()
        event = RebalanceEvent(self.recorder.steps, reason, transfers, imbalance(old.phy2log, load, self.num_ranks),
                               imbalance(new.phy2log, load, self.num_ranks), in_place)
        self.events.append(event)
        logger.info("EPLB rebalance at step %d (%s): %d expert copies moved, imbalance %.3f -> %.3f",
                    event.step, reason, transfers, event.imbalance_before, event.imbalance_after)
        return event
