"""cuda_sm100 fused ops: the MoE gate (from logits, or from hidden states in one launch for few tokens: see
moe_gate.py), activation quantisation and SiLU-and-mul as Triton kernels, plus the token sort that lays routed
tokens out for the grouped GEMM (contiguous or masked).

rms_norm, add_rms_norm, apply_rope and MLA's norm + two ropes (mla_rope_and_norm) are one Triton launch each
(norm_rope_kernels.py) in place of the reference's chain of torch elementwise kernels; shapes and dtypes the
kernels do not cover fall back to the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from deepinfer import quant
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import ConfigError, InvalidInputError
from deepinfer.ops import ExpertLayout, ExpertSum, FusedOps, RoutingSpec, append_shared_experts, check_argmax
from deepinfer.ops.rope import check_mla_rope_and_norm
from deepinfer.weights import LinearWeight, WeightFormat

from deepinfer.backends.cuda_sm100 import gemm, moe_gate
from deepinfer.backends.cuda_sm100 import norm_rope_kernels as NR
from deepinfer.backends.cuda_sm100 import routing_kernels as RK


@dataclass(frozen=True, eq=False)
class SortedTokens:
    """Routed (token, slot) pairs laid out by expert for the grouped GEMM.

    group_sizes [E] int64: pairs per expert (uncapped counts in the masked layout).
    pair_of_row [rows] int32: pair index p (token p // top_k, choice p % top_k) of each row; -1 for padding
      rows: the masked layout's, and the contiguous layout's last rows when some ids lie outside [0, E) (those
      pairs are left out). Contiguous: rows = T * top_k; masked: rows = E * capacity.
    row_of_pair [T, top_k] int32: the row each pair went to (-1 if it overflowed its expert's capacity).
    """

    group_sizes: torch.Tensor
    pair_of_row: torch.Tensor
    row_of_pair: torch.Tensor
    top_k: int
    capacity: int | None = None

    def token_of_row(self) -> torch.Tensor:
        """Source token of each row (0 for padding rows), for gathering hidden states."""
        return torch.where(self.pair_of_row >= 0, self.pair_of_row // self.top_k, 0)


def _triton_device(t: torch.Tensor) -> bool:
    """Triton runs CUDA tensors, or CPU tensors under the interpreter."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and gemm.interpreting())


def _norm_kernel_takes(x: torch.Tensor) -> bool:
    """Whether the Triton RMSNorm covers x (a whole row in registers); the reference takes the rest."""
    return x.dim() > 0 and x.shape[-1] <= NR.MAX_NORM_DIM and _triton_device(x)


class CudaFusedOps(FusedOps):
    def __init__(self, batch_invariant: bool = False, prefill_attention: str | None = None):
        self.batch_invariant = batch_invariant
        self.prefill_impl = prefill_attention or os.environ.get("DEEPINFER_PREFILL_ATTENTION", "triton")
        if self.prefill_impl not in ("triton", "cudnn"):
            raise ConfigError(f"DEEPINFER_PREFILL_ATTENTION must be 'triton' or 'cudnn', got {self.prefill_impl!r}")
        self._cudnn_refused: set = set()  # (dtype, dk, dv) cuDNN's SDPA refused once: not retried
        self._tickets: dict[torch.device, torch.Tensor] = {}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        check_tensor("x", x, dtypes=FLOAT_DTYPES)
        if not _norm_kernel_takes(x):
            return super().rms_norm(x, weight, eps)
        check_tensor("weight", weight, ndim=1, shape=[x.shape[-1]], dtypes=FLOAT_DTYPES, device=x.device)
        return NR.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor | ExpertSum, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     quantize: bool = False) -> tuple[torch.Tensor | quant.Fp8Activations, torch.Tensor]:
        # An MoE's deferred combine (ExpertSum, built by moe_comm.combine) is formed in the norm's launch.
        if not isinstance(x, ExpertSum):
            check_tensor("x", x, dtypes=FLOAT_DTYPES)
        if not _norm_kernel_takes(x.rows if isinstance(x, ExpertSum) else x):
            return super().add_rms_norm(x, residual, weight, eps, quantize=quantize)
        check_tensor("residual", residual, shape=list(x.shape), dtypes=(x.dtype,), device=x.device)
        check_tensor("weight", weight, ndim=1, shape=[x.shape[-1]], dtypes=FLOAT_DTYPES, device=x.device)
        if quantize and not isinstance(x, ExpertSum):  # FP8 GEMMs' activation quantisation in the norm's launch
            check_tensor("x", x, ndim=2)
        return NR.add_rms_norm(x, residual, weight, eps, quantize)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool,
                   validate: bool = True) -> torch.Tensor:
        # the reference's checks, in its order
        check_tensor("x", x, dtypes=FLOAT_DTYPES)
        check_tensor("positions", positions, ndim=1, shape=[x.shape[0]], dtypes=(torch.int32, torch.int64), device=x.device)
        check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, shape=[None, x.shape[-1]], device=x.device)
        if x.dim() < 2 or x.shape[-1] % 2 or cos_sin_cache.dtype not in FLOAT_DTYPES or not _triton_device(x):
            return super().apply_rope(x, positions, cos_sin_cache, interleaved, validate)
        if validate and x.numel():
            self._check_positions(positions, cos_sin_cache)
        return NR.apply_rope(x, positions, cos_sin_cache, interleaved)

    def mla_rope_and_norm(self, q_pe: torch.Tensor, kv: torch.Tensor, kv_norm_weight: torch.Tensor, eps: float,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool, *,
                          validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.mla_rope_and_norm_in_one_launch(q_pe, kv, kv_norm_weight, positions, cos_sin_cache, validate):
            return super().mla_rope_and_norm(q_pe, kv, kv_norm_weight, eps, positions, cos_sin_cache, interleaved,
                                             validate=validate)
        return NR.mla_rope_and_norm(q_pe, kv, kv_norm_weight, eps, positions, cos_sin_cache, interleaved)

    def mla_rope_and_norm_in_one_launch(self, q_pe: torch.Tensor, kv: torch.Tensor, kv_norm_weight: torch.Tensor,
                                        positions: torch.Tensor, cos_sin_cache: torch.Tensor, validate: bool) -> bool:
        """Check mla_rope_and_norm's inputs; whether its one-launch kernel (also the fused cache write's first
        half) covers them. Not where rms_norm or apply_rope would fall back, or without heads (H is a kernel
        constant): the reference composition of those methods runs there, and checks the positions itself."""
        check_mla_rope_and_norm(q_pe, kv, kv_norm_weight, positions, cos_sin_cache)
        if (kv_norm_weight.shape[0] > NR.MAX_NORM_DIM or q_pe.shape[-1] % 2 or cos_sin_cache.dtype not in FLOAT_DTYPES
                or not q_pe.shape[1] or not _triton_device(q_pe)):
            return False
        if validate and kv.shape[0] * q_pe.shape[-1]:  # k_pe.numel(): whether the reference's ropes would check
            self._check_positions(positions, cos_sin_cache)
        return True

    @staticmethod
    def _check_positions(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
        """apply_rope's range check (a read-back; the kernels write NaN rows for positions outside the cache)."""
        if positions.min() < 0 or positions.max() >= cos_sin_cache.shape[0]:
            raise InvalidInputError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (the rope cache's length)")

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None) -> torch.Tensor:
        """16-bit on the GPU: the Triton flash kernel (prefill_attention_kernels.py; one compile serves every
        shape; rope parts read in place), or with DEEPINFER_PREFILL_ATTENTION=cudnn cuDNN's SDPA split in two
        (prefill_attention.py: ~20% faster on 16k-query chunks once warm, but a plan build of 40 ms to ~1 s per
        new bucketed shape). Float32 and the CPU go to the reference (PyTorch's SDPA)."""
        from deepinfer.ops.prefill_attention import check_prefill_attention, joined_keys

        check_prefill_attention(q, k, v, scale, q_rope, k_rope)
        if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[0]:
            if self.prefill_impl == "triton":
                from deepinfer.backends.cuda_sm100.prefill_attention_kernels import flash_prefill

                return flash_prefill(q, k, v, scale, q_rope=q_rope, k_rope=k_rope)
            from deepinfer.backends.cuda_sm100 import prefill_attention as PA

            q, k = joined_keys(q, k, q_rope, k_rope)
            q_rope = k_rope = None
            key = (q.dtype, k.shape[-1], v.shape[-1])
            if PA.cudnn_usable(q, k, v) and key not in self._cudnn_refused:
                try:
                    return PA.split_prefill_attention(q, k, v, scale)
                except RuntimeError:  # this build's cuDNN does not take the shape: not tried again
                    self._cudnn_refused.add(key)
        if q.device.type != "cuda":
            return super().prefill_attention(q, k, v, scale, q_rope, k_rope)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # Off cuDNN: PyTorch would pick it for square causal chunks and build a plan per new shape.
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return super().prefill_attention(q, k, v, scale, q_rope, k_rope)

    def quantize_fp8_per_token_group(self, x: torch.Tensor, group: int = quant.FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        check_tensor("x", x, dtypes=FLOAT_DTYPES)
        if group != quant.FP8_BLOCK or x.dim() == 0:  # the kernel is specialised for DeepSeek's 128
            return super().quantize_fp8_per_token_group(x, group)
        k = x.shape[-1]
        q, s = gemm.quantize_fp8(x.reshape(-1, k))
        return q.reshape(x.shape), s.reshape(*x.shape[:-1], s.shape[-1])

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.silu_and_mul(x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        check_argmax(x)
        if not _triton_device(x) or x.stride(-1) != 1 or x.shape[1] >= 2**31:
            return super().argmax(x)
        from deepinfer.backends.cuda_sm100.argmax_kernels import argmax_rows

        return argmax_rows(x)

    def silu_and_mul_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """silu_and_mul rounded to x's dtype, then quantised per token per 128 channels, in one kernel."""
        return gemm.silu_and_mul(x, quantize=True)

    def select_experts(self, router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None):
        self._check_routing(router_logits, spec, correction_bias)
        if spec.num_experts > moe_gate.MAX_EXPERTS:
            return super().select_experts(router_logits, spec, correction_bias)
        return moe_gate.select(router_logits, spec, correction_bias)

    def route(self, x: torch.Tensor, gate: LinearWeight, spec: RoutingSpec, correction_bias: torch.Tensor | None = None,
              *, linear, shared: int = 0):
        """Few tokens: the float32 GEMV and the selection in one launch (moe_gate.gate_route). Else the backend's
        GEMM, then the route kernel writing the shared columns itself. Batch-invariant mode keeps one path for
        every token count: the backend's fixed-tile GEMM, whose row sums do not depend on the batch."""
        if self._gate_route_takes(x, gate, spec, correction_bias):
            return moe_gate.gate_route(x, gate.data, spec, correction_bias, self._gate_tickets(x.device), shared)[:2]
        logits = linear(x.float(), gate)
        self._check_routing(logits, spec, correction_bias)
        if spec.num_experts > moe_gate.MAX_EXPERTS:
            return append_shared_experts(*super().select_experts(logits, spec, correction_bias), spec.num_experts, shared)
        return moe_gate.select(logits, spec, correction_bias, shared)

    def route_sorted(self, x: torch.Tensor, gate: LinearWeight, spec: RoutingSpec,
                     correction_bias: torch.Tensor | None = None, *, linear, shared: int = 0):
        """At one token the one-launch gate's routing program also writes the layout (a few integer ops), and
        the dispatch then launches nothing (moe_comm.dispatch)."""
        if x.dim() == 2 and x.shape[0] == 1 and self._gate_route_takes(x, gate, spec, correction_bias):
            weights, ids, sizes, row_of_pair = moe_gate.gate_route(
                x, gate.data, spec, correction_bias, self._gate_tickets(x.device), shared, layout=True)
            return weights, ids, ExpertLayout(sizes, row_of_pair)
        return super().route_sorted(x, gate, spec, correction_bias, linear=linear, shared=shared)

    def _gate_route_takes(self, x: torch.Tensor, gate: LinearWeight, spec: RoutingSpec,
                          correction_bias: torch.Tensor | None) -> bool:
        """Whether the one-launch gate (moe_gate.gate_route) takes this routing; checks x and the bias."""
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
        if not (not self.batch_invariant and gate.format is WeightFormat.DENSE and _triton_device(x)
                and moe_gate.gate_route_fits(x, gate.data, spec) and gate.in_features == x.shape[1]
                and gate.out_features == spec.num_experts and gate.device == x.device):
            return False
        if correction_bias is not None:
            check_tensor("correction_bias", correction_bias, ndim=1, shape=[spec.num_experts], device=x.device)
        return True

    @staticmethod
    def _check_routing(router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None) -> None:
        check_tensor("router_logits", router_logits, ndim=2, shape=[None, spec.num_experts])
        if correction_bias is not None:
            check_tensor("correction_bias", correction_bias, ndim=1, shape=[spec.num_experts], device=router_logits.device)

    def _gate_tickets(self, device: torch.device) -> torch.Tensor:
        """gate_route's per-device tickets: zeros once, left at zero by every launch (graph-capturable)."""
        tickets = self._tickets.get(device)
        if tickets is None:
            tickets = self._tickets[device] = torch.zeros(moe_gate.GATE_ROUTE_TICKETS, dtype=torch.int32, device=device)
        return tickets

    def sort_tokens(self, topk_ids: torch.Tensor, num_experts: int, capacity: int | None = None) -> SortedTokens:
        """Stable counting sort of (token, choice) pairs by expert; capacity=None gives the contiguous layout
        (rows = T * top_k), else the masked one (rows = num_experts * capacity). No host sync."""
        check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        if num_experts < 1 or (capacity is not None and capacity < 0):
            raise InvalidInputError(f"need num_experts >= 1 and capacity >= 0, got {num_experts}, {capacity}")
        dev = topk_ids.device
        t, k = topk_ids.shape
        p = t * k
        ids = topk_ids.reshape(-1) if topk_ids.is_contiguous() else topk_ids.contiguous().reshape(-1)
        e_p = gemm.next_pow2(num_experts)
        bp = 128
        nb = max(1, gemm.cdiv(p, bp))
        masked = capacity is not None
        rows = num_experts * capacity if masked else p
        hist = torch.empty(nb, e_p, dtype=torch.int32, device=dev)
        base = torch.empty(nb, e_p, dtype=torch.int32, device=dev)
        sizes = torch.empty(num_experts, dtype=torch.int64, device=dev)
        row_of_pair = torch.empty(p, dtype=torch.int32, device=dev)
        pair_of_row = torch.full((rows,), -1, dtype=torch.int32, device=dev)  # rows no pair takes: padding
        cap = capacity or 0
        RK.sort_hist_kernel[(nb,)](ids, hist, p, num_experts, E_P=e_p, BP=bp, num_warps=4)
        RK.sort_scan_kernel[(1,)](hist, base, sizes, nb, num_experts, cap, E_P=e_p, RB=16, MASKED=masked,
                                   NB_C=nb if gemm.interpreting() else 0, num_warps=8)
        if p:
            RK.sort_scatter_kernel[(nb,)](ids, base, row_of_pair, pair_of_row, p, num_experts, cap, E_P=e_p, BP=bp,
                                          MASKED=masked, num_warps=4)
        return SortedTokens(sizes, pair_of_row, row_of_pair.reshape(t, k), k, capacity)
