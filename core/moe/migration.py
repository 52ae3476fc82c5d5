"""Live expert-weight migration: move one MoE layer's expert weights from an old placement to a new one.

Every rank derives the same plan from the two slot maps: a new slot is copied locally when the rank already
holds that expert, else fetched from a rank that holds it (the least-loaded sender, so hot experts'
copies come from several ranks). The transfer is one all_to_all per weight tensor, carried as raw bytes so
any dtype (bf16, FP8, NVFP4 and their scales) travels unchanged: the moved weights are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.errors import InvalidInputError
from deepinfer.weights import LinearWeight


@dataclass(frozen=True)
class MigrationPlan:
    """sources[r][j] = (source rank, source slot index on that rank) of rank r's new local slot j."""

    sources: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.sources)

    @property
    def transfers(self) -> int:
        """Expert copies that cross ranks (what a migration costs in bandwidth)."""
        return sum(src != r for r, slots in enumerate(self.sources) for src, _ in slots)

    def sends(self, rank: int) -> list[list[int]]:
        """For each destination rank: this rank's old slot indices to send, in the destination's slot order."""
        out: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for dst, slots in enumerate(self.sources):
            if dst != rank:
                out[dst] += [slot for src, slot in slots if src == rank]
        return out


def plan_migration(old: list[int], new: list[int], num_ranks: int) -> MigrationPlan:
    """Plan the move of one layer from slot map `old` to `new` (lists of P logical ids)."""
    if len(old) != len(new) or len(old) % num_ranks:
        raise InvalidInputError(f"slot maps of {len(old)} and {len(new)} slots over {num_ranks} ranks")
    per = len(old) // num_ranks
    holders: dict[int, list[tuple[int, int]]] = {}
    for s, e in enumerate(old):
        holders.setdefault(e, []).append((s // per, s % per))
    missing = set(new) - set(holders)
    if missing:
        raise InvalidInputError(f"experts {sorted(missing)} are in no slot of the old placement")
    sent = [0] * num_ranks
    sources = []
    for r in range(num_ranks):
        local = {e: j for j, e in reversed(list(enumerate(old[r * per : (r + 1) * per])))}
        slots = []
        for e in new[r * per : (r + 1) * per]:
            if e in local:
                slots.append((r, local[e]))
                continue
            src = min(holders[e], key=lambda h: (sent[h[0]], h[0]))
            sent[src[0]] += 1
            slots.append(src)
        sources.append(tuple(slots))
    return MigrationPlan(tuple(sources))


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[S, ...] of any dtype -> [S, bytes] uint8 view (contiguous)."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def migrate_tensor(t: torch.Tensor, plan: MigrationPlan, rank: int, group: Any = None) -> torch.Tensor:
    """This rank's stacked per-slot tensor [S, ...] under the old map -> the same under the new one."""
    rows = _as_rows(t)
    sends = plan.sends(rank)
    send_splits = [len(s) for s in sends]
    recv_splits = [sum(src == peer for src, _ in plan.sources[rank]) if peer != rank else 0 for peer in range(plan.num_ranks)]
    received = rows.new_empty((sum(recv_splits), rows.shape[1]))
    if plan.num_ranks > 1:
        # Every rank joins, even with nothing to move: a collective must be entered by all.
        index = torch.tensor([i for s in sends for i in s], dtype=torch.int64, device=rows.device)
        send = rows.index_select(0, index)
        dist.all_to_all_single(received, send, recv_splits, send_splits, group=group)
    offsets, start = {}, 0
    for peer, n in enumerate(recv_splits):
        offsets[peer] = start
        start += n
    taken = dict.fromkeys(range(plan.num_ranks), 0)
    pieces = []
    for src, slot in plan.sources[rank]:
        if src == rank:
            pieces.append(rows[slot])
        else:
            pieces.append(received[offsets[src] + taken[src]])
            taken[src] += 1
    out = torch.stack(pieces) if pieces else rows[:0]
    return out.reshape(-1).view(t.dtype).reshape(t.shape)


def migrate_experts_in_place(experts: Any, plan: MigrationPlan, rank: int, group: Any = None) -> None:
    """Move a stacked-experts GatedMLP's weights to the new placement's local experts, each tensor rewritten
    in place (same shape, same address: captured decode graphs keep reading the right weights)."""
    for name in ("gate_up", "gate", "up", "down"):
        w: LinearWeight | None = getattr(experts, name)
        for t in () if w is None else (w.data, w.scale, w.global_scale):
            if t is not None:
                t.copy_(migrate_tensor(t, plan, rank, group))
