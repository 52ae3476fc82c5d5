"""Launcher of the weights-as-M FP8 GEMM (gemm_wm_kernels.py), and which calls it takes: a decode step's few E4M3
rows against E4M3 block weights, one matrix or rows sorted by group, plain or as a fused gate/up with SiLU.

gemm._launch asks `usable` once the rows are quantised, before it picks a gemm_kernel tile, so the GEMV keeps
what gemv.py's predicates take (one row of 16-bit activations) and this kernel the rest up to WM_MAX_ROWS rows
of one matrix, or WM_MAX_GROUP_ROWS a group (H200, RESULTS.md issue 10, twenty-sixth session: 7.1 against 9.7 us
for a 32-row q/kv_a, 50 against 54 us for batch 32's expert down projections). DEEPINFER_WM=0 turns it off (A/B
runs); batch-invariant mode never takes it (a row's sums would depend on which kernel its batch's size picks).
"""

from __future__ import annotations

import functools
import os

import torch

from deepinfer import quant
from deepinfer.backends.cuda_sm100 import triton_interpreter_requested
from deepinfer.backends.cuda_sm100.pdl import launch_kwargs
from deepinfer.quant import cdiv, next_pow2
from deepinfer.weights import LinearWeight, WeightFormat

BLOCK = quant.FP8_BLOCK
BM = 16  # rows a program takes: the wgmma's N
# Rows it takes: two tiles' for one matrix (a batch-32 decode step: the second tile's weight reads hit L2; H200,
# V2-Lite q/kv_a 7.1 against the GEMM tile's 9.7 us), one tile's on average per group for grouped calls; beyond
# that the GEMM tile's row-major MMAs read each weight tile for more rows at once.
WM_MAX_ROWS = 32
WM_MAX_GROUP_ROWS = 16


@functools.cache
def _arch_ok(device: torch.device) -> bool:
    """E4M3 MMAs: sm_89 (mma.sync) and later; the kernel is written for Hopper's wgmma and Blackwell's tcgen05."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def usable(a: torch.Tensor, a_scale: torch.Tensor | None, weight: LinearWeight, gated: bool = False) -> bool:
    """Rows a [M, K] E4M3 with scales a_scale [M, K / 128], weight [N, K] or stacked [G, N, K] (a's rows sorted by
    group) in E4M3 blocks, M at most WM_MAX_ROWS (one matrix) or WM_MAX_GROUP_ROWS a group on average; gated
    ([gate; up]): N / 2 a multiple of 64."""
    if os.environ.get("DEEPINFER_WM", "1") == "0" or weight.format is not WeightFormat.FP8_BLOCK:
        return False
    if a_scale is None or a.dtype != quant.FP8_DTYPE or not a.is_cuda or not _arch_ok(a.device):
        return False  # (the interpreter's CPU runs call launch directly)
    n = weight.out_features // 2 if gated else weight.out_features
    cap = WM_MAX_GROUP_ROWS * weight.num_groups if weight.data.dim() == 3 else WM_MAX_ROWS
    return (0 < a.shape[0] <= cap and (not gated or n % 64 == 0)
            and a.stride(-1) == 1 and weight.data.is_contiguous() and weight.scale.stride(-1) == 1
            and weight.in_features % BLOCK == 0)


def default_tiles(gated: bool) -> tuple[int, int, int]:
    """(weight rows a program: 64 or 128, pipeline stages, warps)."""
    if triton_interpreter_requested():
        return 64, 1, 4
    return 64, 4 if gated else 6, 4


def launch(a: torch.Tensor, a_scale: torch.Tensor, weight: LinearWeight, out: torch.Tensor,
           sizes: torch.Tensor | None = None, gated: bool = False,
           tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [M, N] = a @ W^T for usable() calls: a [M, K] E4M3, a_scale [M, K / 128] (any strides); sizes [G] on
    the device for a stacked weight (rows sorted by group); gated: out = silu(gate) * up, N = W's rows / 2.
    tiles: default_tiles' (bn, stages, warps) by default."""
    from deepinfer.backends.cuda_sm100 import gemm_wm_kernels as W

    w, ws = weight.data, weight.scale
    m, n = out.shape
    stacked = w.dim() == 3
    groups = w.shape[0] if stacked else 1
    bn, stages, warps = tiles or default_tiles(gated)
    if BLOCK % bn or (gated and n % bn):  # a tile must lie in one 128-row scale block (gate and up rows alike)
        raise ValueError(f"weights-as-M tiles of {bn} rows do not fit {n}-row {'gated ' if gated else ''}blocks")
    # Contiguous layout: each group's rows in ceil(size / 16) tiles, at most M in all (a tile holds at least one row).
    row_tiles = min(m, cdiv(m, BM) + groups) if stacked else cdiv(m, BM)
    kwargs = launch_kwargs()
    W.fp8_wm_kernel[(cdiv(n, bn), row_tiles)](
        a, a_scale, w, ws, out, sizes if stacked else out, m, n, groups, a.stride(0), a_scale.stride(0),
        a_scale.stride(1), w.stride(0) if stacked else 0, w.stride(-2), ws.stride(0) if stacked else 0,
        ws.stride(-2), out.stride(0), K=weight.in_features, BN=bn, BM=BM, GROUPED=stacked, G_P=next_pow2(groups),
        GATED=gated, STAGES=stages, EXACT=triton_interpreter_requested(), PREFETCH=4 if kwargs and not stacked else 0,
        num_warps=warps, num_stages=stages, **kwargs)
    return out
