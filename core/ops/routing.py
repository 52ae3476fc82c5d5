"""MoE gate: choose top-k experts per token and their weights.

DeepSeek-V3 ("noaux_tc"): sigmoid scores; `correction_bias` is added for selection only; groups ranked by
the sum of their top-2 biased scores, the best `topk_group` groups kept, top-k experts among them; weights
are the unbiased scores, renormalised if norm_topk_prob, times routed_scaling_factor.
DeepSeek-V2: softmax scores; "greedy" top-k over all experts, or "group_limited_greedy" (groups ranked by
their best expert); weights renormalised when norm_topk_prob and top_k > 1, else times routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.checks import check_tensor
from deepinfer.errors import InvalidInputError

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class RoutingSpec:
    num_experts: int
    top_k: int
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise InvalidInputError(f"scoring_func {self.scoring_func!r} is not one of {SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise InvalidInputError(f"topk_method {self.topk_method!r} is not one of {TOPK_METHODS}")
        if self.topk_method == "noaux_tc" and self.scoring_func != "sigmoid":
            raise InvalidInputError("topk_method 'noaux_tc' needs scoring_func 'sigmoid'")
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidInputError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise InvalidInputError(f"n_group {self.n_group} must divide num_experts {self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise InvalidInputError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.grouped and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise InvalidInputError(f"top_k {self.top_k} exceeds the experts in {self.topk_group} groups")

    @property
    def grouped(self) -> bool:
        return self.topk_method in ("noaux_tc", "group_limited_greedy") and self.n_group > 1


def select_experts(
    router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    check_tensor("router_logits", router_logits, ndim=2, shape=[None, spec.num_experts])
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, ndim=1, shape=[spec.num_experts], device=router_logits.device)
    logits = router_logits.float()
    scores = logits.sigmoid() if spec.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.grouped:
        t = choice.shape[0]
        grouped = choice.view(t, spec.n_group, -1)
        if spec.topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(spec.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.topk_method == "noaux_tc":
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * spec.routed_scaling_factor
    elif spec.norm_topk_prob and spec.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def append_shared_experts(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, shared: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Append `shared` always-chosen experts num_experts, num_experts+1, ... with weight 1.0 to every token's
    choices: shared experts folded into the routed ones (DeepSeek adds their output unweighted; the
    routed_scaling_factor applies to routed experts only)."""
    if shared <= 0:
        return weights, ids
    t = ids.shape[0]
    extra = torch.arange(num_experts, num_experts + shared, dtype=ids.dtype, device=ids.device).expand(t, shared)
    return (torch.cat([weights, weights.new_ones(t, shared)], dim=1), torch.cat([ids, extra], dim=1))


@dataclass(frozen=True, eq=False)
class ExpertLayout:
    """The contiguous layout of a step's (token, choice) pairs: rows sorted by expert, ties in pair order.

    group_sizes [E] int64: pairs per expert; row_of_pair [T, k] int32: the row each pair takes. A router that
    computes it on the way (FusedOps.route_sorted) saves the dispatch its sort (Backend.dispatch's layout).
    """

    group_sizes: torch.Tensor
    row_of_pair: torch.Tensor


def check_layout(layout: object, num_experts: int, topk_ids: torch.Tensor) -> None:
    """A layout handed to dispatch must fit its choices: [E] sizes and a [T, k] row per pair on their device."""
    if not isinstance(layout, ExpertLayout):
        raise InvalidInputError(f"layout must be an ExpertLayout, got {type(layout).__name__}")
    check_tensor("layout.group_sizes", layout.group_sizes, shape=(num_experts,), dtypes=(torch.int64,),
                 device=topk_ids.device)
    check_tensor("layout.row_of_pair", layout.row_of_pair, shape=tuple(topk_ids.shape), dtypes=(torch.int32,),
                 device=topk_ids.device)
