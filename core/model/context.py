"""ForwardContext: what one model forward needs beyond the token ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.attention import AttentionPlan


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """plan: the step's attention plan (its positions drive rope); kv_caches: one cache tensor per layer,
    in layer order (MTP layers after the main ones); moe_capacity: under expert parallelism, the tokens per
    rank that every rank's MoE dispatch of this step is sized for (Backend.dispatch's capacity)."""

    plan: AttentionPlan
    kv_caches: tuple[torch.Tensor, ...]
    moe_capacity: int | None = None

    @property
    def positions(self) -> torch.Tensor:
        return self.plan.positions
