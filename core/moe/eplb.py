"""Expert-parallel load balancing: which logical expert each physical expert slot holds.

`rebalance_experts` has the semantics of DeepSeek's EPLB (github.com/deepseek-ai/EPLB):

- hierarchical when the expert groups divide evenly over the nodes: groups are packed onto nodes (equal
  groups per node) so nodes carry even load, the heaviest experts are replicated within each node, and the
  node's replicas are packed onto its GPUs with the same number of slots on every GPU;
- global otherwise: the same with one node and one group.

Replication hands each spare slot to the expert whose per-replica load is highest; packing is greedy
(heaviest item to the lightest GPU with a free slot). Beyond the published policy:

- replicas of one expert are spread over distinct GPUs wherever the domain allows (a GPU holds at most
  ceil(replicas / GPUs) of them): two copies on one GPU split nothing;
- after the greedy pass a local search swaps slots between a heavy GPU and a lighter one while that lowers
  the pair's maximum (the heaviest GPU first), so a packing is never worse than its greedy start;
- replica counts are then adjusted one copy at a time (to or from the expert that dominates the busiest
  GPU) while re-packing lowers the busiest GPU's load.

Spreading replicas can cost balance where slots are scarce (the published policy may park two copies of
an expert on one GPU, in effect idling a slot); on DeepSeek-V3-shaped traces the other steps more than make
up for it (benchmarks/eplb.py, benchmarks/RESULTS.md).

Everything runs on the host in plain Python: a rebalance is rare and the sizes (256 experts, tens of GPUs)
are small. Results are deterministic (ties break by lowest index), so every rank computes the same map.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from deepinfer.errors import InvalidInputError

_EPS = 1e-9
_REPLICA_TRIES = 8  # replica-count moves tried per node and layer (each re-packs the node)


def replicate_experts(weight: Sequence[float], num_physical: int) -> list[int]:
    """Replica count per expert: one each, then every spare slot to the expert with the highest load per
    replica (ties: lowest id), which minimises the largest per-replica load."""
    n = len(weight)
    if num_physical < n:
        raise InvalidInputError(f"{num_physical} physical slots cannot hold {n} experts")
    counts = [1] * n
    heap = [(-float(w), e) for e, w in enumerate(weight)]
    heapq.heapify(heap)
    for _ in range(num_physical - n):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(weight[e]) / counts[e], e))
    return counts


class _Packs:
    """Items (load, key) in `num_packs` packs of `per_pack` items; `caps[key]` bounds one key per pack."""

    def __init__(self, loads: Sequence[float], keys: Sequence[int], num_packs: int, caps: dict[int, int]):
        self.loads, self.keys, self.caps = loads, keys, caps
        self.per_pack = len(loads) // num_packs
        self.members: list[list[int]] = [[] for _ in range(num_packs)]
        self.load = [0.0] * num_packs
        self.held: list[dict[int, int]] = [{} for _ in range(num_packs)]

    def add(self, pack: int, item: int) -> None:
        self.members[pack].append(item)
        self.load[pack] += self.loads[item]
        key = self.keys[item]
        self.held[pack][key] = self.held[pack].get(key, 0) + 1

    def remove(self, pack: int, item: int) -> None:
        self.members[pack].remove(item)
        self.load[pack] -= self.loads[item]
        self.held[pack][self.keys[item]] -= 1

    def room_for(self, pack: int, key: int) -> bool:
        """Whether one more item of `key` keeps the pack within its cap."""
        return self.held[pack].get(key, 0) < self.caps[key]

    def swap(self, a: int, i: int, b: int, j: int) -> None:
        self.remove(a, i)
        self.remove(b, j)
        self.add(a, j)
        self.add(b, i)

    def violation(self) -> tuple[int, int] | None:
        """(pack, item) of an item whose key exceeds its cap in that pack, if any."""
        for p, members in enumerate(self.members):
            for i in members:
                if self.held[p][self.keys[i]] > self.caps[self.keys[i]]:
                    return p, i
        return None


def _greedy(packs: _Packs, order: list[int]) -> None:
    for i in order:
        key = packs.keys[i]
        open_packs = [p for p in range(len(packs.members)) if len(packs.members[p]) < packs.per_pack]
        allowed = [p for p in open_packs if packs.room_for(p, key)] or open_packs  # else repaired below
        packs.add(min(allowed, key=lambda p: (packs.load[p], p)), i)


def _repair(packs: _Packs) -> bool:
    """Swap away every over-cap item; False when some violation has no valid swap (caller falls back)."""
    for _ in range(len(packs.loads) + 1):
        found = packs.violation()
        if found is None:
            return True
        a, i = found
        key = packs.keys[i]
        best = None
        for b in range(len(packs.members)):
            if b == a or not packs.room_for(b, key):
                continue
            for j in packs.members[b]:
                kj = packs.keys[j]
                if kj == key or not packs.room_for(a, kj):
                    continue
                d = packs.loads[i] - packs.loads[j]
                score = max(packs.load[a] - d, packs.load[b] + d)
                if best is None or score < best[0]:
                    best = (score, b, j)
        if best is None:
            return False
        packs.swap(a, i, best[1], best[2])
    return packs.violation() is None


def _improve(packs: _Packs, max_rounds: int) -> None:
    """Swap an item of a heavy pack with a lighter item of a lighter pack while that lowers the pair's
    maximum. The heaviest pack is tried first; when it cannot improve (one item pins it) the next ones are,
    so the remaining packs even out too. Every swap narrows a pair, so this terminates."""
    num = len(packs.members)
    for _ in range(max_rounds):
        for h in sorted(range(num), key=lambda p: (-packs.load[p], p)):
            best = _best_swap(packs, h)
            if best is not None:
                packs.swap(h, best[2], best[1], best[3])
                break
        else:
            return


def _best_swap(packs: _Packs, h: int) -> tuple[float, int, int, int] | None:
    """The swap between pack h and a lighter pack that leaves the lower pair maximum below h's load."""
    top = packs.load[h]
    best = None
    for q in range(len(packs.members)):
        gap = top - packs.load[q]
        if q == h or gap <= _EPS:
            continue
        for i in packs.members[h]:
            ki = packs.keys[i]
            if not packs.room_for(q, ki):
                continue
            for j in packs.members[q]:
                kj = packs.keys[j]
                d = packs.loads[i] - packs.loads[j]
                if kj == ki or d <= _EPS or d >= gap - _EPS or not packs.room_for(h, kj):
                    continue
                score = max(top - d, packs.load[q] + d)
                if best is None or score < best[0] - _EPS:
                    best = (score, q, i, j)
    return best


def _round_robin(loads: Sequence[float], keys: Sequence[int], num_packs: int) -> list[list[int]]:
    """Always valid: each key's items are consecutive, so position t -> pack t % num_packs spreads them."""
    by_key: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    blocks = sorted(by_key.values(), key=lambda items: (-max(loads[i] for i in items), keys[items[0]]))
    out: list[list[int]] = [[] for _ in range(num_packs)]
    for t, i in enumerate(i for block in blocks for i in block):
        out[t % num_packs].append(i)
    return out


def balanced_packing(loads: Sequence[float], keys: Sequence[int], num_packs: int) -> list[list[int]]:
    """Split items into `num_packs` packs of exactly len/num_packs items, balancing the packs' load sums.

    Items sharing a key (replicas of one expert) land at most ceil(count / num_packs) per pack.
    Returns the item indices of each pack.
    """
    n = len(loads)
    if num_packs <= 0 or n % num_packs:
        raise InvalidInputError(f"{n} items do not split evenly into {num_packs} packs")
    counts: dict[int, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    caps = {k: math.ceil(c / num_packs) for k, c in counts.items()}
    packs = _Packs(loads, keys, num_packs, caps)
    if n // num_packs == 1:
        for p in range(num_packs):
            packs.add(p, p)  # one item per pack: nothing to balance, keep the input order
        return packs.members
    _greedy(packs, sorted(range(n), key=lambda i: (-loads[i], keys[i], i)))
    if not _repair(packs):
        packs = _Packs(loads, keys, num_packs, caps)
        for p, items in enumerate(_round_robin(loads, keys, num_packs)):
            for i in items:
                packs.add(p, i)
    _improve(packs, max_rounds=4 * n)
    return packs.members


def _pack_replicas(weight: list[float], experts: list[int], counts: list[int], num_gpus: int) -> tuple[list[list[int]], float]:
    """Pack the replicas of `experts` (counts[i] copies of experts[i], load split evenly) onto GPUs:
    (expert ids per GPU, the busiest GPU's load)."""
    loads, keys = [], []
    for e, c in zip(experts, counts):
        loads += [weight[e] / c] * c
        keys += [e] * c
    packs = balanced_packing(loads, keys, num_gpus)
    top = max(sum(loads[i] for i in pack) for pack in packs)
    return [sorted(keys[i] for i in pack) for pack in packs], top


def _replicate_and_pack(weight: list[float], experts: list[int], num_slots: int, num_gpus: int, tries: int) -> list[list[int]]:
    """Replicate (heaviest per replica first) and pack; then move single replicas between experts while
    that lowers the busiest GPU's load.

    Spreading replicas over distinct GPUs can leave the greedy replica counts badly shaped for packing
    (e.g. seven copies of one expert on eight GPUs, one GPU holding a copy next to another hot expert);
    taking a copy from the expert that owns the busiest GPU's heaviest item, or giving it one, fixes that.
    """
    w = [weight[e] for e in experts]
    counts = replicate_experts(w, num_slots)
    best, top = _pack_replicas(weight, experts, counts, num_gpus)
    index = {e: i for i, e in enumerate(experts)}
    for _ in range(tries):
        busiest = max(best, key=lambda pack: sum(weight[e] / counts[index[e]] for e in pack))
        hot = index[max(busiest, key=lambda e: weight[e] / counts[index[e]])]
        candidates = []
        donors = [i for i in range(len(w)) if counts[i] > 1 and i != hot]
        if donors:  # one more copy of the hot expert, from the expert that misses one least
            donor = min(donors, key=lambda i: (w[i] / (counts[i] - 1), i))
            candidates.append((donor, hot))
        if counts[hot] > 1:  # one copy fewer of the hot expert, to the expert that needs one most
            taker = max((i for i in range(len(w)) if i != hot), key=lambda i: (w[i] / counts[i], -i), default=None)
            if taker is not None:
                candidates.append((hot, taker))
        improved = None
        for src, dst in candidates:
            trial = list(counts)
            trial[src] -= 1
            trial[dst] += 1
            packs, trial_top = _pack_replicas(weight, experts, trial, num_gpus)
            if trial_top < top * (1 - 1e-9) and (improved is None or trial_top < improved[2]):
                improved = (trial, packs, trial_top)
        if improved is None:
            break
        counts, best, top = improved
    return best


def _place_layer(weight: list[float], num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> list[int]:
    """phy2log of one layer under the hierarchical policy (global = one group on one node)."""
    num_logical = len(weight)
    group_size = num_logical // num_groups
    group_load = [sum(weight[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_groups = balanced_packing(group_load, list(range(num_groups)), num_nodes)
    gpus_per_node = num_gpus // num_nodes
    phy2log: list[int] = []
    for groups in node_groups:
        experts = [g * group_size + j for g in sorted(groups) for j in range(group_size)]
        for pack in _replicate_and_pack(weight, experts, num_physical // num_nodes, gpus_per_node, _REPLICA_TRIES):
            phy2log += pack
    return phy2log


def logical_to_physical(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log [L, P] -> (log2phy [L, E, X] with each expert's slots ascending, -1 padded; logcnt [L, E])."""
    layers, num_physical = phy2log.shape
    logcnt = torch.zeros(layers, num_logical, dtype=torch.int64)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    width = max(1, int(logcnt.max())) if logcnt.numel() else 1
    log2phy = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    # Stable sort by expert: slots of one expert stay ascending; each slot's rank among them is its column.
    order = torch.sort(phy2log, dim=1, stable=True).indices
    experts = phy2log.gather(1, order)
    starts = torch.cumsum(logcnt, dim=1) - logcnt
    column = torch.arange(num_physical).expand(layers, -1) - starts.gather(1, experts)
    log2phy[torch.arange(layers)[:, None].expand(-1, num_physical), experts, column] = order
    return log2phy, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Balance expert load over GPUs.

    weight [layers, num_logical_experts]: load of each logical expert (token counts);
    num_replicas: physical expert slots, a multiple of num_gpus and at least the expert count;
    num_groups: expert groups (the router's n_group); num_nodes: nodes, whose GPUs share the fast
    intra-node network; num_gpus: a multiple of num_nodes.

    Returns int64 CPU tensors: phy2log [layers, num_replicas] (slot s lives on GPU s // (num_replicas /
    num_gpus)), log2phy [layers, num_logical_experts, max replicas] (each expert's slots, ascending, -1
    padded) and logcnt [layers, num_logical_experts] (replicas per expert).
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InvalidInputError(f"weight must be a 2-D tensor [layers, experts], got {getattr(weight, 'shape', weight)!r}")
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    layers, num_logical = weight.shape
    w = weight.detach().double().cpu()
    if num_logical == 0 or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise InvalidInputError("weight must hold finite, non-negative loads for at least one expert")
    if num_replicas % num_gpus:
        raise InvalidInputError(f"num_replicas {num_replicas} must be a multiple of num_gpus {num_gpus}")
    if num_replicas < num_logical:
        raise InvalidInputError(f"num_replicas {num_replicas} cannot hold {num_logical} logical experts")
    if num_gpus % num_nodes:
        raise InvalidInputError(f"num_gpus {num_gpus} must be a multiple of num_nodes {num_nodes}")
    if num_groups % num_nodes == 0:
        if num_logical % num_groups:
            raise InvalidInputError(f"num_groups {num_groups} must divide the {num_logical} experts")
        groups, nodes = num_groups, num_nodes
    else:
        groups, nodes = 1, 1
    rows = [_place_layer(w[layer].tolist(), num_replicas, groups, nodes, num_gpus) for layer in range(layers)]
    phy2log = torch.tensor(rows, dtype=torch.int64).reshape(layers, num_replicas)
    log2phy, logcnt = logical_to_physical(phy2log, num_logical)
    return phy2log, log2phy, logcnt
