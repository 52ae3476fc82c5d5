"""Gated SiLU MLPs: the dense MLP / shared experts, and the routed experts of a MoE layer.

A shared-expert MLP of intermediate size S * I is exactly S experts of size I (its intermediate channels split
into S slices: gate/up rows, down columns; the down projection's sum over channels is the sum of the slices'
outputs), so a single-process MoE layer can run it inside the routed grouped GEMM (`split_into_experts`).
"""

from __future__ import annotations

import copy

import torch

from deepinfer.backend import Backend
from deepinfer.quant import FP8_BLOCK, NVFP4_BLOCK
from deepinfer.weights import LinearWeight, WeightFormat


def concat_out_features(a: LinearWeight, b: LinearWeight) -> LinearWeight | None:
    """[..., Na, K] ++ [..., Nb, K] -> [..., Na+Nb, K] when that is exact in the stored format, else None.

    FP8 blocks concatenate only when Na is a multiple of the 128-row block; NVFP4's per-matrix global
    scale forbids it.
    """
    if a.format is not b.format or a.in_features != b.in_features:
        return None
    if a.format is WeightFormat.DENSE:
        return LinearWeight.dense(torch.cat([a.data, b.data], dim=-2))
    if a.format is WeightFormat.FP8_BLOCK and a.out_features % FP8_BLOCK == 0:
        return LinearWeight.fp8_block(torch.cat([a.data, b.data], dim=-2), torch.cat([a.scale, b.scale], dim=-2))
    return None


def pad_fp8_to_block(weight: LinearWeight, rows: bool) -> LinearWeight:
    """A 2-D fp8_block weight with zero rows (else columns) up to the next 128 multiple: its scales already cover
    the partial block, so they stay as they are and every product is unchanged (the padding adds zeros)."""
    n, k = weight.data.shape
    pad = -(n if rows else k) % FP8_BLOCK
    if not pad:
        return weight
    zeros = weight.data.new_zeros((pad, k) if rows else (n, pad))
    return LinearWeight.fp8_block(torch.cat([weight.data, zeros], dim=0 if rows else 1), weight.scale)


def _slice_exact(weight: LinearWeight, size: int, rows: bool) -> bool:
    """Whether cutting `weight` into slices of `size` rows (else columns) keeps its stored values and scales."""
    total = weight.out_features if rows else weight.in_features
    if weight.data.dim() != 2 or size <= 0 or total % size:
        return False
    if weight.format is WeightFormat.FP8_BLOCK:  # 128x128 scale blocks must not straddle a cut
        return size % FP8_BLOCK == 0
    if weight.format is WeightFormat.NVFP4:  # rows carry their own 16-wide scales; columns come in 16-wide blocks
        return rows or size % NVFP4_BLOCK == 0
    return True


def _slice(weight: LinearWeight, i: int, size: int, rows: bool) -> LinearWeight:
    """Slice i of `size` rows (else columns) of a 2-D weight, in its stored format (_slice_exact checked)."""
    if rows:
        cut = lambda t, unit: t[i * size // unit : (i + 1) * size // unit]  # noqa: E731
    else:
        cut = lambda t, unit: t[:, i * size // unit : (i + 1) * size // unit]  # noqa: E731
    if weight.format is WeightFormat.DENSE:
        return LinearWeight.dense(cut(weight.data, 1))
    if weight.format is WeightFormat.FP8_BLOCK:
        return LinearWeight.fp8_block(cut(weight.data, 1), cut(weight.scale, FP8_BLOCK))
    if rows:
        return LinearWeight.nvfp4(cut(weight.data, 1), cut(weight.scale, 1), weight.global_scale, weight.in_features)
    return LinearWeight.nvfp4(cut(weight.data, 2), cut(weight.scale, NVFP4_BLOCK), weight.global_scale, size)


def _fp8_mlp(gate: LinearWeight, up: LinearWeight, down: LinearWeight) -> bool:
    """A plain (2-D) gated MLP of fp8_block weights whose shapes chain: gate and up [I, H], down [H, I]."""
    return (all(w.format is WeightFormat.FP8_BLOCK and w.data.dim() == 2 for w in (gate, up, down))
            and gate.out_features == up.out_features == down.in_features and gate.in_features == up.in_features)


def split_into_experts(gate: LinearWeight, up: LinearWeight, down: LinearWeight, like: LinearWeight
                       ) -> list[tuple[LinearWeight, LinearWeight, LinearWeight]] | None:
    """A gated MLP [S*I] -> S (gate, up, down) experts of intermediate size I = like.out_features (a routed
    expert's gate), in the routed experts' format and dtype so that they stack with them; None unless every
    cut is exact in the stored format (FP8: I a multiple of 128; NVFP4 down: of 16)."""
    inter = like.out_features
    parts = (gate, up, down)
    if any(w.format is not like.format or w.data.dtype != like.data.dtype for w in parts):
        return None
    if gate.in_features != like.in_features or up.in_features != like.in_features or down.out_features != like.in_features:
        return None
    if gate.out_features != up.out_features or down.in_features != gate.out_features:
        return None
    if not (_slice_exact(gate, inter, True) and _slice_exact(up, inter, True) and _slice_exact(down, inter, False)):
        return None
    return [(_slice(gate, i, inter, True), _slice(up, i, inter, True), _slice(down, i, inter, False))
            for i in range(gate.out_features // inter)]


def expert_weight(stacked: LinearWeight, g: int) -> LinearWeight:
    """Matrix g of a stacked [E, N, K] weight as a 2-D weight over views of its tensors (no copy)."""
    pick = lambda t: None if t is None else t[g]  # noqa: E731
    return LinearWeight(stacked.data[g], stacked.format, stacked.in_features, pick(stacked.scale), pick(stacked.global_scale))


def stack_experts(weights: list[LinearWeight]) -> LinearWeight:
    """Per-expert [N, K] weights -> one stacked [E, N, K] weight for the grouped GEMM."""
    first = weights[0]
    data = torch.stack([w.data for w in weights])
    if first.format is WeightFormat.DENSE:
        return LinearWeight.dense(data)
    if first.format is WeightFormat.FP8_BLOCK:
        return LinearWeight.fp8_block(data, torch.stack([w.scale for w in weights]))
    return LinearWeight.nvfp4(
        data, torch.stack([w.scale for w in weights]), torch.stack([w.global_scale for w in weights]), first.in_features
    )


class GatedMLP:
    """down(silu(gate(x)) * up(x)): gate and up run as one GEMM when their weights concatenate exactly.

    With `group_sizes` the weights are stacked per expert and every projection is a grouped GEMM.
    """

    def __init__(self, backend: Backend, gate: LinearWeight, up: LinearWeight, down: LinearWeight):
        self.backend = backend
        self.gate_up = concat_out_features(gate, up)
        if self.gate_up is None and _fp8_mlp(gate, up, down):
            # An intermediate size off the 128 grid (V2-Lite's dense MLP: 10944) splits a scale block at the cut:
            # zero channels pad it (gate and up rows, down columns; silu(0) * 0 = 0 adds nothing), so that gate
            # and up still run as one projection: one launch, fused with SiLU, instead of two, a cat and silu_mul.
            gate, up, down = pad_fp8_to_block(gate, True), pad_fp8_to_block(up, True), pad_fp8_to_block(down, False)
            self.gate_up = concat_out_features(gate, up)
        self.gate, self.up = (None, None) if self.gate_up is not None else (gate, up)
        self.down = down

    def expert(self, g: int) -> GatedMLP:
        """Expert g of a stacked MLP as a plain one, over views of the stacked weights."""
        view = copy.copy(self)
        view.gate_up, view.gate, view.up, view.down = (
            None if w is None else expert_weight(w, g) for w in (self.gate_up, self.gate, self.up, self.down))
        return view

    def _project(self, x: torch.Tensor, weight: LinearWeight, group_sizes: torch.Tensor | None,
                 settled: bool = False) -> torch.Tensor:
        """settled: an earlier projection of this forward already read group_sizes (Backend.grouped_linear)."""
        if group_sizes is None:
            return self.backend.linear(x, weight)
        return self.backend.grouped_linear(x, weight, group_sizes, validate=False, sizes_settled=settled)  # from dispatch

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor | None = None, settled_tail: int = 0) -> torch.Tensor:
        """settled_tail: Backend.gated_linear's (x's last rows are the shared-expert slices' own)."""
        if self.gate_up is not None:  # sizes come from dispatch: no value check
            hidden = self.backend.gated_linear(x, self.gate_up, group_sizes, validate=False, settled_tail=settled_tail)
        else:
            gate_up = torch.cat([self._project(x, self.gate, group_sizes),
                                 self._project(x, self.up, group_sizes, settled=True)], dim=-1)
            hidden = self.backend.ops.silu_and_mul(gate_up)
        return self._project(hidden, self.down, group_sizes, settled=True)
