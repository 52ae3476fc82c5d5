"""The published EPLB policy (github.com/deepseek-ai/EPLB, eplb.py) re-implemented step for step as the
baseline the simulator and tests compare DeepInfer's `deepinfer.moe.eplb` against.

Faithful to its three steps and their tie-breaking:
1. hierarchical when num_groups % num_nodes == 0 (else one group on one node): pack expert groups onto
   nodes, num_groups / num_nodes per node, heaviest group first to the lightest node with room (one group
   per node keeps the input order);
2. within each node, hand each spare slot to the expert with the largest load per replica (first maximum);
3. pack the node's replicas onto its GPUs the same greedy way, slots per GPU equal.
No co-location rule and no local search: two replicas of one expert may share a GPU.
"""

from __future__ import annotations

import torch


def _pack(loads: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """(pack of each item, its position in the pack): heaviest first (a stable descending order) to the
    lightest pack that still has room (lowest index on ties)."""
    n = len(loads)
    per = n // num_packs
    if per == 1:
        return list(range(n)), [0] * n
    pack_of, rank_in = [-1] * n, [-1] * n
    weight, items = [0.0] * num_packs, [0] * num_packs
    for i in sorted(range(n), key=lambda i: -loads[i]):
        best = min((p for p in range(num_packs) if items[p] < per), key=weight.__getitem__)
        pack_of[i], rank_in[i] = best, items[best]
        weight[best] += loads[i]
        items[best] += 1
    return pack_of, rank_in


def _replicate(loads: list[float], num_physical: int) -> tuple[list[int], list[int]]:
    """(expert of each physical slot, replica count per expert): slot i >= E copies argmax(load / count)."""
    counts = [1] * len(loads)
    phy2log = list(range(len(loads)))
    for _ in range(len(loads), num_physical):
        best = max(range(len(loads)), key=lambda e: (loads[e] / counts[e], -e))
        phy2log.append(best)
        counts[best] += 1
    return phy2log, counts


def _layer(w: list[float], num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> list[int]:
    num_logical = len(w)
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    group_pack, group_rank = _pack([sum(w[g * group_size : (g + 1) * group_size]) for g in range(num_groups)], num_nodes)
    # "Middle" ids: node n's experts are [n * E / nodes, (n + 1) * E / nodes), groups in their pack order.
    mlog2log = [0] * num_logical
    for e in range(num_logical):
        g = e // group_size
        mlog2log[(group_pack[g] * groups_per_node + group_rank[g]) * group_size + e % group_size] = e
    per_node, phys_per_node, per_gpu = num_logical // num_nodes, num_physical // num_nodes, num_physical // num_gpus
    out: list[int] = []
    for node in range(num_nodes):
        experts = mlog2log[node * per_node : (node + 1) * per_node]
        loads = [w[e] for e in experts]
        phy2m, counts = _replicate(loads, phys_per_node)
        gpu_of, rank_in = _pack([loads[m] / counts[m] for m in phy2m], num_gpus // num_nodes)
        slots = [0] * phys_per_node
        for phy, m in enumerate(phy2m):
            slots[gpu_of[phy] * per_gpu + rank_in[phy]] = experts[m]
        out += slots
    return out


def published_rebalance(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> torch.Tensor:
    """phy2log [layers, num_replicas] of the published policy for loads `weight` [layers, experts]."""
    w = weight.double().cpu()
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    rows = [_layer(w[i].tolist(), num_replicas, num_groups, num_nodes, num_gpus) for i in range(w.shape[0])]
    return torch.tensor(rows, dtype=torch.int64)
