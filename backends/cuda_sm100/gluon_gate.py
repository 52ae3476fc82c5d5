"""Where the Gluon kernels (mla_gluon_kernels, gemm_gluon_kernels) may run, and their modules.

Gluon is Triton's experimental explicit-layout language: its API moves between releases, so only the release
the kernels were written and tested against runs them (a kernel module is imported only then), and only on
Hopper (they issue wgmma, which SM100 replaces with tcgen05) with the shared memory the kernel declares in
SMEM_BYTES. Elsewhere the Triton kernels serve.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

TESTED_TRITON = (3, 6)


@functools.cache
def gluon_release() -> bool:
    import triton

    return tuple(int(v) for v in triton.__version__.split(".")[:2]) == TESTED_TRITON


@functools.cache
def kernels(name: str) -> ModuleType:
    """The Gluon kernel module backends/cuda_sm100/<name>.py (import it only where gluon_release())."""
    return importlib.import_module(f"deepinfer.backends.cuda_sm100.{name}")


@functools.cache
def runs_on(device: torch.device, name: str) -> bool:
    """A Hopper GPU, the tested Triton, and the shared memory a CTA of module `name`'s kernel takes."""
    if device.type != "cuda" or not gluon_release() or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin >= kernels(name).SMEM_BYTES
