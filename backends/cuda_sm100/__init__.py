"""cuda_sm100: NVIDIA Hopper (SM90) and Blackwell (SM100) backend.

Its Triton kernels (FlashMLA-style attention, FP8/FP4 GEMM, grouped MoE GEMM) land op by op; until an op
has a kernel it runs the reference math on the GPU, so the backend is usable on its hardware now.
Triton is imported only where a kernel is launched, never here: listing backends must stay cheap.
"""

from __future__ import annotations

import importlib.util

from deepinfer.backend import Capabilities, Probe
from deepinfer.backends.reference import ReferenceBackend

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
    )
    DEFAULT_DEVICE = "cuda"

    def __init__(self, device=None):
        if device is None:
            device = "cuda" if not triton_interpreter_requested() or self._cuda_available() else "cpu"
        super().__init__(device)

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
