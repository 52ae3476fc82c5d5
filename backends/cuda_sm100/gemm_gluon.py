"""When and how an FP8 GEMM runs on gemm_gluon_kernels' warp-specialised kernel (Hopper, large M): one matrix,
or the contiguous grouped layout (MoE prefill) with enough rows per group; and, under graph capture, a matrix of one
128-row tile at very long or very short K (`small_m_split`), long K in two K slices.

gemm._launch asks `fp8_ws_usable`, then `small_m_split`; everything else (small M or small groups, the masked layout, fused epilogues,
bf16 and NVFP4 weights, batch-invariant mode) stays on gemm_kernels' tile kernel. DEEPINFER_GEMM_GLUON=0 forces
the tile kernel (A/B benchmarks).
"""

from __future__ import annotations

import functools
import os

import torch

from deepinfer import quant
from deepinfer.backends.cuda_sm100 import gluon_gate

# From this many rows on (H200, benchmarks/RESULTS.md issue 9, eleventh and thirteenth sessions): at M = 512 the
# kernel beat the tile kernel on all 6 DeepSeek-V3 shapes (by 3-27%); at M = 256 it lost on 4 of 6 (too few
# 128-row tiles to fill 132 SMs).
MIN_ROWS = 512
# Grouped: rows per group (on average) from which it runs. H200: 8 groups x 512 rows (N 4096, K 7168) 1068
# TFLOPS vs the tile kernel's 890; 256 experts top-8 at 4096 tokens (128 rows a group) 632 vs 638 (padding at
# each group's end), so small groups stay on the tile kernel.
MIN_GROUP_ROWS = 256


def _aligned(t: torch.Tensor) -> bool:
    """TMA: 16-byte aligned base and row stride, unit column stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def fp8_ws_usable(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
                  out: torch.Tensor, m: int, groups: int = 0) -> bool:
    """a [M, K] e4m3 with scales, w [N, K] (or [G, N, K] with groups = G, rows sorted by group) e4m3 with 128x128
    block scales, out [M, N] bf16/fp16; M large (and M / G large)."""
    if m < MIN_ROWS or a.device.type != "cuda" or os.environ.get("DEEPINFER_GEMM_GLUON", "1") == "0":
        return False
    if a.dtype != quant.FP8_DTYPE or w.dtype != quant.FP8_DTYPE or a_scale is None or w_scale is None:
        return False
    if w.dim() != (3 if groups else 2) or out.dtype not in (torch.bfloat16, torch.float16) or out.dim() != 2:
        return False
    if groups and (m < MIN_GROUP_ROWS * groups or not w.is_contiguous()):
        return False
    return all(_aligned(t) for t in (a, w, out)) and gluon_gate.runs_on(a.device, "gemm_gluon_kernels")


# Below MIN_ROWS, one matrix of SMALL_M_ROWS rows (one 128-row tile high, both consumers busy) runs here where the
# tile kernel lost on the H200 (benchmarks/RESULTS.md issue 9, thirty-second session; M = 128, TFLOPS, tile kernel /
# this kernel / cuBLAS row-wise FP8, gemm.py): long K, 7168 x 16384 528 / 540 (two K slices) / 592; short K,
# 32768 x 512 258 / 306 / 305. At middle K (1536-7168) the tile kernel led by 4-90% (one probe call), and stays.
SMALL_M_ROWS = (65, 128)
LONG_K = 8192
SHORT_K = 512


def small_m_split(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
                  out: torch.Tensor, m: int, sms: int) -> int:
    """K slices (>= 1) for a one-matrix call below MIN_ROWS that this kernel takes (SMALL_M_ROWS rows, long K:
    two slices when twice the tiles still fit one wave; very short K with a wave of tiles or more); 0 for the
    tile kernel. Only while a CUDA graph is captured: eager calls at these sizes are host-bound, and the
    descriptors' host time is paid there once."""
    lo, hi = SMALL_M_ROWS
    if not lo <= m <= hi or w.dim() != 2 or not torch.cuda.is_current_stream_capturing():
        return 0
    if not fp8_ws_usable(a, a_scale, w, w_scale, out, MIN_ROWS):
        return 0
    n, k = w.shape
    tiles = quant.cdiv(n, 128)
    if k >= LONG_K:
        return 2 if 2 * tiles <= sms else 1
    return 1 if k <= SHORT_K and tiles >= sms else 0


def choose_consumers(m: int, n: int, k: int, sms: int) -> int:
    """Consumer warpgroups a CTA (tile height 64 x that): the larger last-wave fill, three weighted by speed.

    Three consumers take 192-row tiles and wait once per K block; two take 128-row tiles and wait once per two
    (their registers hold two partials). Since the producer stages the scales, three beat two on most of
    ANCHORS.md's shapes at M = 1024-4096 on the H200, by up to 21%; two led by 3-4% on two shapes at M = 1024
    (benchmarks/RESULTS.md, issue 9, fifteenth session). So three get a 1.1 weight at every K (before: below
    K = 4096 only).
    """
    def fill(rows: int) -> float:
        tiles = quant.cdiv(m, rows) * quant.cdiv(n, 128)
        return tiles / (quant.cdiv(tiles, sms) * sms)

    return 3 if fill(192) * 1.1 > fill(128) else 2


@functools.cache
def _launch_constants(device: torch.device, out_dtype: torch.dtype):
    """(SM count, A / B / C shared layouts): built once, not per launch (host time: eager prefill launches many)."""
    from triton.experimental.gluon import language as gl

    G = gluon_gate.kernels("gemm_gluon_kernels")
    half, bn, bk = G.HALF.value, G.BN.value, G.BK.value
    out_gl = gl.bfloat16 if out_dtype == torch.bfloat16 else gl.float16
    return (torch.cuda.get_device_properties(device).multi_processor_count,
            gl.NVMMASharedLayout.get_default_for([half, bk], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([half, bn], out_gl))


def launch_fp8_ws(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  out: torch.Tensor, group_sizes: torch.Tensor | None = None, consumers: int | None = None,
                  split: int = 1) -> None:
    """out = (a x a_scale) @ (w x w_scale)^T on the persistent warp-specialised kernel (one CTA per SM).

    With group_sizes (on the device: no host sync, graph-capturable), w is [G, N, K] and a's rows are sorted by
    group; a tile map kernel first gives each row tile its group and rows. split > 1 (one matrix): each tile's K
    blocks in that many slices, their float32 partials summed by splitk_reduce_kernel (split_for's calls).
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from deepinfer.backends.cuda_sm100 import gemm_kernels

    G = gluon_gate.kernels("gemm_gluon_kernels")
    bn, bk, half = G.BN.value, G.BK.value, G.HALF.value
    m, k = a.shape
    n = w.shape[-2]
    sms, al, bl, cl = _launch_constants(a.device, out.dtype)
    # Grouped: 128-row tiles waste less at each group's end than 192-row ones.
    consumers = consumers or (2 if group_sizes is not None else choose_consumers(m, n, k, sms))
    stages, regs, maxnreg, _ = G.CONFIGS[consumers]
    bm = consumers * half
    if group_sizes is None:
        m_tiles, tmap, bsg = quant.cdiv(m, bm), out, 0  # (tmap: any pointer, unread)
    else:
        groups = w.shape[0]
        m_tiles = quant.cdiv(m, bm) + min(groups, m)  # an upper bound on the tiles the groups cut the rows into
        tmap = torch.empty(m_tiles, 3, dtype=torch.int32, device=a.device)
        gemm_kernels.group_tile_map_kernel[(m_tiles,)](group_sizes, tmap, m, groups, m_tiles, BM=bm,
                                                       G_P=quant.next_pow2(groups))
        bsg = w_scale.stride(0)
    split = split if group_sizes is None else 1
    w2 = w.reshape(-1, k)
    partials = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    G.fp8_gemm_ws_kernel[(min(m_tiles * quant.cdiv(n, bn) * split, sms),)](
        TensorDescriptor(a, a.shape, a.stride(), [half, bk], al),
        TensorDescriptor(w2, w2.shape, w2.stride(), [bn, bk], bl),
        TensorDescriptor(out, out.shape, out.stride(), [half, bn], cl), partials, partials.stride(-2),
        m * n, a_scale, a_scale.stride(0), a_scale.stride(1), w_scale, bsg, w_scale.stride(-2), w_scale.stride(-1),
        tmap, m, n, k, m_tiles, GROUP_M=G.GROUP_M, CONSUMERS=consumers, STAGES=stages, CONSUMER_REGS=regs,
        LAYOUT=0 if group_sizes is None else 1, SPLIT=split, num_warps=G.NUM_WARPS, maxnreg=maxnreg,
    )
    if split > 1:
        from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

        block = 1024
        gemm_kernels.splitk_reduce_kernel[(quant.cdiv(m * n, block),)](partials, out, m * n, SPLIT_K=split,
                                                                       BLOCK=block, EXACT=False, **launch_kwargs())
