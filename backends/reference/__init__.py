"""The reference backend: every op in plain PyTorch with float32 accumulation, on any torch device.

It is the golden implementation every other backend is tested against, so it favours clarity over speed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from deepinfer.attention import AttentionBatch, AttentionPlan, KVCacheSpec
from deepinfer.backend import Backend, Capabilities, Dispatched, Pending, Probe
from deepinfer.ops import ExpertLayout, check_layout
from deepinfer.weights import LinearWeight

from deepinfer.backends.reference import attention, comm, gemm


class ReferenceBackend(Backend):
    name = "reference"
    CAPABILITIES = Capabilities(
        weight_formats=frozenset({"bf16", "fp8_e4m3", "nvfp4"}),
        kv_cache_dtypes=frozenset({"bf16", "fp16", "fp32", "fp8_e4m3"}),
        graph_capture=False,
        dist_backend="gloo",
    )
    DEFAULT_DEVICE = "cpu"

    def __init__(self, device: str | torch.device | None = None, batch_invariant: bool | None = None):
        """batch_invariant (default: $DEEPINFER_BATCH_INVARIANT): every row's reductions run alone, in a fixed
        order, so a request's results do not depend on what else is in the batch."""
        self._device = torch.device(device if device is not None else self.DEFAULT_DEVICE)
        if batch_invariant is None:
            batch_invariant = os.environ.get("DEEPINFER_BATCH_INVARIANT", "0") not in ("", "0")
        self.batch_invariant = batch_invariant

    @classmethod
    def probe(cls) -> Probe:
        return Probe(True, "plain PyTorch; runs on any torch device", cls.DEFAULT_DEVICE)

    @property
    def device(self) -> torch.device:
        return self._device

    def allocate_kv_cache(self, spec: KVCacheSpec) -> torch.Tensor:
        return torch.zeros(spec.shape, dtype=spec.torch_dtype, device=self.device)

    def plan_attention(self, batch: AttentionBatch, spec: KVCacheSpec) -> AttentionPlan:
        return AttentionPlan.build(batch, spec, self.device)

    def write_cache(self, plan: AttentionPlan, cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        attention.write_cache(plan, cache, c_kv, k_pe)

    def run_attention(self, plan, cache, q_nope, q_pe, softmax_scale, return_lse=False):
        return attention.run_attention(plan, cache, q_nope, q_pe, softmax_scale, return_lse, self.batch_invariant)

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        return gemm.linear(x, weight, self.batch_invariant)

    def grouped_linear(self, x: torch.Tensor, weight: LinearWeight, group_sizes: torch.Tensor, *,
                       validate: bool = True, sizes_settled: bool = False) -> torch.Tensor:
        return gemm.grouped_linear(x, weight, group_sizes, self.batch_invariant)  # reads the sizes anyway

    def dispatch(self, x, topk_ids, topk_weights, num_experts: int, group: Any = None, *,
                 validate: bool = True, capacity: int | None = None, layout: ExpertLayout | None = None
                 ) -> Pending[Dispatched]:
        # capacity is only an allowance: this backend always sizes its buffers from exchanged counts; a layout
        # is checked but not needed (it sorts anyway).
        if layout is not None:
            check_layout(layout, num_experts, topk_ids)
        return comm.dispatch(x, topk_ids, topk_weights, num_experts, group, validate)

    def combine(self, dispatched: Dispatched, expert_out: torch.Tensor, add: torch.Tensor | None = None, *,
                defer: bool = False) -> Pending[torch.Tensor]:
        return comm.combine(dispatched, expert_out, add)  # always formed: the reference has no launches to save

    def all_reduce(self, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        return comm.all_reduce(x, group)
