"""Where experts live: physical expert slots on the ranks of an expert-parallel group.

A MoE layer with E logical experts runs P >= E physical slots (P - E redundant copies of hot experts),
P / W per rank, rank r holding slots [r * P / W, (r + 1) * P / W). Tokens are dispatched on slot ids, so the
backend's "experts split evenly and in order over ranks" rule is exactly this layout.

`ExpertPlacement` is one layer's map as seen by one rank (what the MoE layer needs); `ModelPlacement` holds
every MoE layer's map (what the balancer computes and migrates).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.errors import InvalidInputError
from deepinfer.moe.eplb import logical_to_physical, rebalance_experts


def check_phy2log(phy2log: torch.Tensor, num_logical: int, num_ranks: int) -> None:
    """Raise InvalidInputError unless phy2log [L, P] is a valid placement of `num_logical` experts on `num_ranks`."""
    if phy2log.dim() != 2 or phy2log.dtype != torch.int64:
        raise InvalidInputError(f"phy2log must be an int64 [layers, slots] tensor, got {phy2log.dtype} {tuple(phy2log.shape)}")
    slots = phy2log.shape[1]
    if num_ranks <= 0 or slots % num_ranks:
        raise InvalidInputError(f"{slots} physical slots do not split evenly over {num_ranks} ranks")
    if phy2log.numel() and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical):
        raise InvalidInputError(f"phy2log names experts outside [0, {num_logical})")
    counts = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if bool((counts == 0).any()):
        layer, expert = (counts == 0).nonzero()[0].tolist()
        raise InvalidInputError(f"layer position {layer}: logical expert {expert} has no physical slot")


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """One MoE layer's slot map on one rank. Tensors are int64 on `device` (routing runs there).

    phy2log [P]: logical expert of each slot; log2phy [E, X]: each expert's slots (-1 padded); logcnt [E].
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_ranks: int
    rank: int
    local_experts: tuple[int, ...] = field(init=False)  # logical id of each of this rank's slots, in order
    _identity: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_ranks:
            raise InvalidInputError(f"rank {self.rank} outside a group of {self.num_ranks}")
        check_phy2log(self.phy2log.cpu()[None], self.num_logical, self.num_ranks)
        s = self.slots_per_rank
        object.__setattr__(self, "local_experts", tuple(self.phy2log[self.rank * s : (self.rank + 1) * s].tolist()))
        identity = self.num_physical == self.num_logical and bool((self.phy2log.cpu() == torch.arange(self.num_logical)).all())
        object.__setattr__(self, "_identity", identity)

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_logical: int, num_ranks: int, rank: int,
                     device: torch.device | str = "cpu") -> ExpertPlacement:
        phy2log = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
        check_phy2log(phy2log[None], num_logical, num_ranks)
        log2phy, logcnt = logical_to_physical(phy2log[None], num_logical)
        # log2phy as wide as any placement of these slots can need (one expert in every spare slot), so
        # that every placement of the layer has the same shapes (see written_into).
        width = phy2log.shape[0] - num_logical + 1
        log2phy = torch.nn.functional.pad(log2phy[0], (0, width - log2phy.shape[2]), value=-1)
        return cls(phy2log.to(device), log2phy.to(device), logcnt[0].to(device), num_ranks, rank)

    def written_into(self, current: ExpertPlacement) -> ExpertPlacement | None:
        """This placement over `current`'s tensors, its values copied there: captured CUDA graphs read those
        addresses, so they route by the new map without a new capture. None where it cannot be (other shapes,
        or one side the identity map, which routing skips altogether)."""
        same = all(a.shape == b.shape for a, b in ((self.phy2log, current.phy2log), (self.log2phy, current.log2phy),
                                                   (self.logcnt, current.logcnt)))
        if not same or self._identity != current._identity or (self.num_ranks, self.rank) != (current.num_ranks, current.rank):
            return None
        return ExpertPlacement(current.phy2log.copy_(self.phy2log), current.log2phy.copy_(self.log2phy),
                               current.logcnt.copy_(self.logcnt), self.num_ranks, self.rank)

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @property
    def first_slot(self) -> int:
        return self.rank * self.slots_per_rank

    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slot ids [T, k].

        A replicated expert's (token, choice) pairs take its replicas in turn, in token order, starting at
        replica `rank`: each replica gets an even share of every rank's tokens, deterministically.
        """
        if self._identity:
            return topk_ids
        flat = topk_ids.reshape(-1).long()
        if flat.numel() == 0:
            return flat.view(topk_ids.shape)
        order = torch.sort(flat, stable=True).indices
        ranked = flat.index_select(0, order)
        # Position of each pair among the pairs that chose the same expert (runs of equal ids in `ranked`).
        within = torch.arange(flat.numel(), device=flat.device) - torch.searchsorted(ranked, ranked)
        ordinal = torch.empty_like(within).index_copy_(0, order, within)
        replica = (ordinal + self.rank) % self.logcnt.index_select(0, flat)
        return self.log2phy[flat, replica].view(topk_ids.shape)


@dataclass(frozen=True, eq=False)
class ModelPlacement:
    """Every MoE layer's slot map: phy2log [len(layer_ids), P] int64 on the CPU, row i for layer layer_ids[i]."""

    layer_ids: tuple[int, ...]
    phy2log: torch.Tensor
    num_logical: int
    num_ranks: int

    def __post_init__(self) -> None:
        if self.phy2log.shape[0] != len(self.layer_ids):
            raise InvalidInputError(f"phy2log has {self.phy2log.shape[0]} rows for {len(self.layer_ids)} MoE layers")
        check_phy2log(self.phy2log, self.num_logical, self.num_ranks)

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    @classmethod
    def static(cls, layer_ids: Sequence[int], num_logical: int, num_ranks: int) -> ModelPlacement:
        """Experts in order, E / W per rank: the plain expert-parallel split."""
        phy2log = torch.arange(num_logical, dtype=torch.int64).repeat(len(layer_ids), 1)
        return cls(tuple(layer_ids), phy2log, num_logical, num_ranks)

    @classmethod
    def balanced(cls, layer_ids: Sequence[int], load: torch.Tensor, num_physical: int, num_groups: int,
                 num_nodes: int, num_ranks: int) -> ModelPlacement:
        """EPLB's placement for `load` [layers, E]."""
        phy2log, _, _ = rebalance_experts(load, num_physical, num_groups, num_nodes, num_ranks)
        return cls(tuple(layer_ids), phy2log, load.shape[1], num_ranks)

    @classmethod
    def initial(cls, layer_ids: Sequence[int], num_logical: int, num_physical: int, num_groups: int,
                num_nodes: int, num_ranks: int) -> ModelPlacement:
        """Before any load is seen: the static split, or with redundant slots EPLB's answer to uniform load."""
        if num_physical == num_logical:
            return cls.static(layer_ids, num_logical, num_ranks)
        load = torch.ones(len(layer_ids), num_logical)
        return cls.balanced(layer_ids, load, num_physical, num_groups, num_nodes, num_ranks)

    def subset(self, layer_ids: Sequence[int]) -> ModelPlacement:
        """The rows of these layers only (e.g. without MTP layers the checkpoint turned out not to have)."""
        rows = [self.layer_ids.index(i) for i in layer_ids]
        return ModelPlacement(tuple(layer_ids), self.phy2log[rows], self.num_logical, self.num_ranks)

    def layer(self, layer_id: int, rank: int, device: torch.device | str = "cpu") -> ExpertPlacement:
        row = self.layer_ids.index(layer_id)
        return ExpertPlacement.from_phy2log(self.phy2log[row], self.num_logical, self.num_ranks, rank, device)

    def rank_experts(self, row: int, rank: int) -> list[int]:
        s = self.slots_per_rank
        return self.phy2log[row, rank * s : (rank + 1) * s].tolist()


def gpu_loads(phy2log: torch.Tensor, load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Per-GPU load [L, G] when each expert's load [L, E] splits evenly over its replicas."""
    _, logcnt = logical_to_physical(phy2log.cpu(), load.shape[1])
    per_slot = (load.double().cpu() / logcnt.clamp(min=1)).gather(1, phy2log.cpu())
    return per_slot.view(phy2log.shape[0], num_gpus, -1).sum(-1)


def imbalance(phy2log: torch.Tensor, load: torch.Tensor, num_gpus: int) -> float:
    """Modelled MoE time over its ideal: sum over layers of the busiest GPU's load / of the mean GPU load (>= 1)."""
    per_gpu = gpu_loads(phy2log, load, num_gpus)
    mean = float(per_gpu.mean(-1).sum())
    return float(per_gpu.amax(-1).sum()) / mean if mean > 0 else 1.0


def align_to(previous: torch.Tensor, new: torch.Tensor, num_gpus: int, num_nodes: int = 1) -> torch.Tensor:
    """Relabel `new` [L, P] so as much as possible stays where `previous` has it.

    Balance does not depend on which node or GPU gets which slot set, so nodes are matched to nodes and
    GPUs to GPUs within a node (greedily, by experts in common), and experts a GPU keeps keep their slot.
    Fewer experts then move when the balancer migrates weights.
    """
    layers, slots = new.shape
    per_gpu, gpus_per_node = slots // num_gpus, num_gpus // num_nodes
    out = torch.empty_like(new)
    for row in range(layers):
        old_sets = [previous[row, g * per_gpu : (g + 1) * per_gpu].tolist() for g in range(num_gpus)]
        new_sets = [new[row, g * per_gpu : (g + 1) * per_gpu].tolist() for g in range(num_gpus)]
        node_old = [sum(old_sets[n * gpus_per_node : (n + 1) * gpus_per_node], []) for n in range(num_nodes)]
        node_new = [sum(new_sets[n * gpus_per_node : (n + 1) * gpus_per_node], []) for n in range(num_nodes)]
        for n_old, n_new in _match(node_old, node_new):
            olds = range(n_old * gpus_per_node, (n_old + 1) * gpus_per_node)
            news = range(n_new * gpus_per_node, (n_new + 1) * gpus_per_node)
            for g_old, g_new in _match([old_sets[g] for g in olds], [new_sets[g] for g in news]):
                gpu_old, gpu_new = olds[g_old], news[g_new]
                out[row, gpu_old * per_gpu : (gpu_old + 1) * per_gpu] = torch.tensor(
                    _keep_slots(old_sets[gpu_old], new_sets[gpu_new]), dtype=new.dtype)
    return out


def _match(olds: list[list[int]], news: list[list[int]]) -> list[tuple[int, int]]:
    """Greedy maximum-overlap pairing of old and new multisets (ties: lowest indices)."""
    old_counts, new_counts = [Counter(o) for o in olds], [Counter(n) for n in news]
    scored = sorted((-sum((o & n).values()), i, j) for i, o in enumerate(old_counts) for j, n in enumerate(new_counts))
    used_old, used_new, pairs = set(), set(), []
    for _, i, j in scored:
        if i not in used_old and j not in used_new:
            used_old.add(i)
            used_new.add(j)
            pairs.append((i, j))
    return pairs


def _keep_slots(old: list[int], new: list[int]) -> list[int]:
    """The experts of `new` ordered so that those also in `old` sit in the same slots."""
    left = list(new)
    out: list[int | None] = [None] * len(old)
    for s, e in enumerate(old):
        if e in left:
            left.remove(e)
            out[s] = e
    fill = iter(left)
    return [e if e is not None else next(fill) for e in out]
