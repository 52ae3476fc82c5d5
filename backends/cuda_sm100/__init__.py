"""cuda_sm100: NVIDIA Hopper (SM90) and Blackwell (SM100) backend.

Its Triton kernels (FlashMLA-style attention, FP8/FP4 GEMM, grouped MoE GEMM) land op by op; until an op
has a kernel it runs the reference math on the GPU, so the backend is usable on its hardware now.
Triton is imported only where a kernel is launched, never here: listing backends must stay cheap.
"""

from __future__ import annotations

import importlib.util

from deepinfer.backend import Capabilities, Probe, check_per_head
from deepinfer.backends.reference import ReferenceBackend
from deepinfer.quant import FP8_BLOCK
from deepinfer.weights import WeightFormat

MIN_CAPABILITY = (9, 0)
INTERPRETER_ENV = "TRITON_INTERPRET"


def triton_interpreter_requested() -> bool:
    """TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors: how CI exercises them without a GPU."""
    import os

    return os.environ.get(INTERPRETER_ENV, "") not in ("", "0")


class CudaSM100Backend(ReferenceBackend):
    name = "cuda_sm100"
    CAPABILITIES = Capabilities(
        weight_formats=frozenset({"bf16", "fp8_e4m3", "nvfp4"}),
        kv_cache_dtypes=frozenset({"bf16", "fp8_e4m3"}),
        graph_capture=True,
        dist_backend="nccl",
        decompressed_prefill=True,
    )
    DEFAULT_DEVICE = "cuda"

    def __init__(self, device=None, batch_invariant=None):
        if device is None:
            device = "cuda" if not triton_interpreter_requested() or self._cuda_available() else "cpu"
        super().__init__(device, batch_invariant)
        from deepinfer.backends.cuda_sm100.mla_launch import TileChoices

        self._mla_tile_choices = TileChoices()  # which MLA tile candidates fit this GPU, learnt per shape

    @property
    def capabilities(self):
        # Batch invariance needs every query reduced the same way whatever its chunk: absorbed attention only.
        caps = self.__dict__.get("_capabilities")
        if caps is None:
            import dataclasses

            caps = type(self).CAPABILITIES
            if self.batch_invariant:
                caps = dataclasses.replace(caps, decompressed_prefill=False)
            self.__dict__["_capabilities"] = caps
        return caps

    @staticmethod
    def _cuda_available() -> bool:
        import torch

        return torch.cuda.is_available()

    @classmethod
    def probe(cls) -> Probe:
        try:
            import torch

            if not torch.cuda.is_available():
                if triton_interpreter_requested() and importlib.util.find_spec("triton") is not None:
                    return Probe(True, "no GPU: Triton interpreter on CPU (TRITON_INTERPRET=1), for testing only", "cpu")
                return Probe(False, "no CUDA device visible to torch (torch.cuda.is_available() is False)")
            best = None
            for index in range(torch.cuda.device_count()):
                cap = torch.cuda.get_device_capability(index)
                if cap >= MIN_CAPABILITY:
                    best = (index, cap, torch.cuda.get_device_name(index))
                    break
            if best is None:
                caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
                return Probe(False, f"needs CUDA compute capability >= 9.0 (SM90/SM100); found {caps}")
            index, cap, gpu = best
            return Probe(True, f"{gpu}, compute capability {cap[0]}.{cap[1]}", f"cuda:{index}")
        except Exception as exc:  # a broken driver must read as "unusable", not crash listing
            return Probe(False, f"CUDA probe failed: {type(exc).__name__}: {exc}")

    # --- attention: Triton MLA kernels in attention.py / mla_kernels.py, imported on first use ------------
    def allocate_kv_cache(self, spec):
        """Contiguous and zeroed: the kernels read FP8 rows through float32/bf16 views of the same bytes."""
        import torch

        return torch.zeros(spec.shape, dtype=spec.torch_dtype, device=self.device)

    def plan_attention(self, batch, spec, *, max_seq_len=None, into=None, split_tokens=None):
        """Host schedule in device tensors. For CUDA graphs: capture with a plan made with max_seq_len, then
        re-plan later steps (same sequences and query lengths) with into=that plan."""
        from deepinfer.backends.cuda_sm100.attention import plan_mla

        return plan_mla(batch, spec, self.device, batch_invariant=getattr(self, "batch_invariant", False),
                        split_tokens=split_tokens, max_seq_len=max_seq_len, into=into)

    def write_cache(self, plan, cache, c_kv, k_pe):
        from deepinfer.backends.cuda_sm100 import attention

        attention.write_cache(plan, cache, c_kv, k_pe)

    def run_attention(self, plan, cache, q_nope, q_pe, softmax_scale, return_lse=False):
        from deepinfer.backends.cuda_sm100 import attention

        return attention.run_attention(plan, cache, q_nope, q_pe, softmax_scale, return_lse,
                                       getattr(self, "batch_invariant", False), self._mla_tile_choices)

    def rope_norm_and_write_cache(self, plan, cache, q_pe, kv, kv_norm_weight, eps, cos_sin_cache, interleaved, *,
                                  validate=True):
        # One launch (the "fused cache write, rope applied"): mla_rope_and_norm's kernel, then the cache write
        # from the rows it just stored.
        if self._triton_runs_here() and self.ops.mla_rope_and_norm_in_one_launch(
                q_pe, kv, kv_norm_weight, plan.positions, cos_sin_cache, validate):
            from deepinfer.backends.cuda_sm100 import attention

            if attention.fuses_cache_write(plan, cache, kv, kv_norm_weight):
                return attention.rope_norm_and_write(plan, cache, q_pe, kv, kv_norm_weight, eps, cos_sin_cache,
                                                     interleaved)
            validate = False  # the positions were just checked
        return super().rope_norm_and_write_cache(plan, cache, q_pe, kv, kv_norm_weight, eps, cos_sin_cache,
                                                 interleaved, validate=validate)

    # --- GEMM and fused ops: Triton kernels in gemm.py / fused_ops.py, imported on first use -------------
    def _triton_runs_here(self) -> bool:
        return self.device.type == "cuda" or triton_interpreter_requested()

    @property
    def ops(self):
        ops = self.__dict__.get("_fused_ops")
        if ops is None:
            if not self._triton_runs_here():
                return super().ops
            from deepinfer.backends.cuda_sm100.fused_ops import CudaFusedOps

            ops = self.__dict__["_fused_ops"] = CudaFusedOps(batch_invariant=getattr(self, "batch_invariant", False))
        return ops

    def linear(self, x, weight):
        if not self._triton_runs_here():
            return super().linear(x, weight)
        from deepinfer.backends.cuda_sm100 import gemm

        return gemm.linear(x, weight, batch_invariant=getattr(self, "batch_invariant", False))

    def grouped_linear(self, x, weight, group_sizes, *, validate=True, sizes_settled=False):
        if not self._triton_runs_here():
            return super().grouped_linear(x, weight, group_sizes, validate=validate)
        from deepinfer.backends.cuda_sm100 import gemm

        return gemm.grouped_linear(x, weight, group_sizes, batch_invariant=self.batch_invariant, validate=validate,
                                   sizes_settled=sizes_settled)

    def per_head_linear(self, x, weight, *, quantize=False):
        from deepinfer.backends.cuda_sm100 import gemm

        check_per_head(x, weight)
        # One launch over the per-token layout (no transposed copies; the quantisation in its epilogue) for
        # 16-bit or float32 dense weights in x's dtype, as MLA's absorbed projections are.
        if (self._triton_runs_here() and weight.format is WeightFormat.DENSE and x.dtype == weight.data.dtype
                and (not quantize or weight.out_features % FP8_BLOCK == 0)):
            return gemm.per_head_linear(x, weight, quantize, batch_invariant=self.batch_invariant)
        return super().per_head_linear(x, weight, quantize=quantize)

    def gated_linear(self, x, gate_up, group_sizes=None, *, validate=True, settled_tail=0):
        from deepinfer.backends.cuda_sm100 import gemm, gemv

        # A dense MLP's one decode row: the GEMV with SiLU-and-mul in its epilogue (one launch).
        if (group_sizes is None and gate_up.out_features % 2 == 0 and self._triton_runs_here()
                and gemv.gemv_usable(x, gate_up, self.batch_invariant)):
            return gemv.gemv(x, gate_up, gated=True)
        # Experts at decode sizes: SiLU-and-mul in the grouped GEMM's epilogue (one launch, and no [M, 2I]
        # intermediate). Larger batches keep the plain grouped GEMM's wider tiles (see gemm.fuse_gate_up);
        # batch-invariant mode keeps one path for every size.
        if (group_sizes is not None and self._triton_runs_here() and not self.batch_invariant
                and gemm.fuse_gate_up(x.shape[0], gate_up.num_groups)):
            return gemm.gate_up_silu(x, gate_up, group_sizes, quantize=False, validate=validate,
                                     settled_tail=settled_tail)
        return super().gated_linear(x, gate_up, group_sizes, validate=validate)

    # --- MoE communication: a device-side counting sort and a fused combine in one process (moe_comm.py);
    # under expert parallelism one row per (token, rank) over all_to_all (ep_comm.py) ---
    def _expert_parallel(self, group) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    def dispatch(self, x, topk_ids, topk_weights, num_experts, group=None, *, validate=True, capacity=None,
                 layout=None):
        if not self._triton_runs_here():
            return super().dispatch(x, topk_ids, topk_weights, num_experts, group, validate=validate, layout=layout)
        from deepinfer.backends.cuda_sm100 import ep_comm, moe_comm

        if self._expert_parallel(group):
            return ep_comm.dispatch(self.ops, x, topk_ids, topk_weights, num_experts, group, validate, capacity)
        return moe_comm.dispatch(self.ops, x, topk_ids, topk_weights, num_experts, validate, layout=layout)

    def combine(self, dispatched, expert_out, add=None, *, defer=False):
        from deepinfer.backends.cuda_sm100 import ep_comm, moe_comm

        state = getattr(dispatched, "state", None)
        if isinstance(state, moe_comm.LocalState):
            return moe_comm.combine(dispatched, expert_out, add, defer=defer)
        if isinstance(state, ep_comm.EPState):
            return ep_comm.combine(dispatched, expert_out, add)
        return super().combine(dispatched, expert_out, add)
