"""Where the Gluon kernels (mla_gluon_kernels, gemm_gluon_kernels) may run.

Gluon is Triton's experimental explicit-layout language: its API moves between releases, so only the release
the kernels were written and tested against runs them, and only on Hopper (they issue wgmma, which SM100
replaces with tcgen05). Elsewhere the Triton kernels serve.
"""

from __future__ import annotations

import functools

import torch

TESTED_TRITON = (3, 6)


@functools.cache
def gluon_release() -> bool:
    import triton

    return tuple(int(v) for v in triton.__version__.split(".")[:2]) == TESTED_TRITON


def hopper_gluon(device: torch.device, smem_bytes: int) -> bool:
    """A Hopper GPU, the tested Triton, and smem_bytes of shared memory a CTA."""
    if device.type != "cuda" or not gluon_release() or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin >= smem_bytes
