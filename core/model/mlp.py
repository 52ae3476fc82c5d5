"""Gated SiLU MLPs: the dense MLP / shared experts, and the routed experts of a MoE layer."""

from __future__ import annotations

import torch

from deepinfer.backend import Backend
from deepinfer.quant import FP8_BLOCK
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
        self.gate, self.up = (None, None) if self.gate_up is not None else (gate, up)
        self.down = down

    def _project(self, x: torch.Tensor, weight: LinearWeight, group_sizes: torch.Tensor | None) -> torch.Tensor:
        if group_sizes is None:
            return self.backend.linear(x, weight)
        return self.backend.grouped_linear(x, weight, group_sizes, validate=False)  # sizes from dispatch

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor | None = None) -> torch.Tensor:
        if self.gate_up is not None:
            gate_up = self._project(x, self.gate_up, group_sizes)
        else:
            gate_up = torch.cat([self._project(x, self.gate, group_sizes), self._project(x, self.up, group_sizes)], dim=-1)
        return self._project(self.backend.ops.silu_and_mul(gate_up), self.down, group_sizes)
