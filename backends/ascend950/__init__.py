"""ascend950: Huawei Ascend NPUs through torch_npu + CANN.

Fused torch_npu operators land op by op; until then the reference math runs on the NPU.
torch_npu is imported only inside the probe: without CANN its import breaks `import torch` itself.
"""

from __future__ import annotations

import importlib.util

from deepinfer.backend import Capabilities, Probe
from deepinfer.backends.reference import ReferenceBackend


class Ascend950Backend(ReferenceBackend):
    name = "ascend950"
    CAPABILITIES = Capabilities(
        weight_formats=frozenset({"bf16", "fp8_e4m3"}),
        kv_cache_dtypes=frozenset({"bf16"}),
        graph_capture=False,
        dist_backend="hccl",
    )
    DEFAULT_DEVICE = "npu"

    @classmethod
    def probe(cls) -> Probe:
        if importlib.util.find_spec("torch_npu") is None:
            return Probe(False, "torch_npu is not installed (pip install 'deepinfer[ascend]' on a machine with CANN)")
        try:
            import torch
            import torch_npu  # noqa: F401  (registers the npu device with torch)

            if not torch.npu.is_available() or torch.npu.device_count() == 0:
                return Probe(False, "torch_npu is installed but no Ascend NPU is visible")
            return Probe(True, f"{torch.npu.device_count()} Ascend NPU(s)", "npu:0")
        except Exception as exc:
            return Probe(False, f"torch_npu failed to initialise: {type(exc).__name__}: {exc}")
