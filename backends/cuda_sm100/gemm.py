"""cuda_sm100 GEMMs: launchers of gemm_kernels.py with the reference's validation and semantics.

- FP8 block weights: activations quantised per token per 128 channels by quant_fp8_kernel (scales stored
  column-major, as DeepGEMM does, so the GEMM reads them contiguously), then the block-scaled tile GEMM.
- bf16/fp16 dense `linear` goes to cuBLAS (torch.matmul): benchmarks/gemm.py measures the Triton
  tile kernel against it (H200, 2026-11-29: 0.71-1.03x cuBLAS at M=4096, 0.76-1.02x at M=64), so cuBLAS
  stays; grouped dense GEMMs use the Triton kernel. float32 or mixed dtypes run the kernel with IEEE
  float32 dots (exact like the reference, slow; not a serving path).
- NVFP4: weight-only on SM90 (E2M1 x e4m3 block scale dequantised in registers to the activation dtype,
  which is exact, global scale applied to the accumulator). SM100's native block-scaled MMA is not
  wired yet: on SM100 the same weight-only kernel runs (`native_nvfp4_available` gates the switch).
- Grouped: contiguous layout (rows sorted by group, sizes on the device: the tile map is computed in the
  kernel, so the launch is graph-capturable; only the wrapper's value check of the sizes syncs, and it is
  skipped while a graph is being captured), masked layout ([G, cap, K]
  with per-group counts, for decode under CUDA graphs), and gate/up fused with SiLU-and-mul (+ FP8
  quantisation of the result for the down projection).
- One decode token's rows (batch-1 linear, its experts' rows for 16-bit experts, MLA's per-head projections)
  go to the GEMV where gemv.py's predicates take them; other decode-sized E4M3 rows (at most 32 a matrix, or 16 a
  group on average) to the weights-as-M kernel (gemm_wm.py), whose E4M3 wgmmas convert no weight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from deepinfer import quant
from deepinfer.backends.reference.gemm import INT_DTYPES, _check_weight, _check_x, check_fp8_activations
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError
from deepinfer.weights import LinearWeight, WeightFormat

from deepinfer.backends.cuda_sm100 import gemm_gluon, gemm_kernels as K, gemm_wm as WM, triton_interpreter_requested
from deepinfer.backends.cuda_sm100.gemv import (gemv, gemv_grouped, gemv_grouped_usable, gemv_per_head,
                                                gemv_per_head_usable, gemv_usable)
from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

BLOCK = quant.FP8_BLOCK


interpreting = triton_interpreter_requested


@functools.cache
def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


# Host-side arithmetic in plain Python: triton.cdiv is a @jit function and slow to call from the host, and
# these launchers run once per layer per step (launch overhead is what small-M calls are made of).
cdiv = quant.cdiv
next_pow2 = quant.next_pow2


@dataclass(frozen=True)
class TileConfig:
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    group_m: int = 8
    split_k: int = 1
    tma: bool = False  # load A/B tiles through TMA descriptors (where strides allow)
    ws: bool = False  # Triton warp specialisation of the K loop: no effect on SM90 in Triton 3.6 (checked)
    imprecise: int | None = None  # tl.dot max_num_imprecise_acc; None = one promotion per 128-wide K block


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


# Rows per group (grouped GEMMs) and rows (one matrix) up to which the weight streams through 16-row tiles:
# more, narrower CTAs spread it over more SMs. H200, V2-Lite shapes (benchmarks/gemm_decode.py at 93d74ad and
# d6f57ec, 8 weight copies per graph, against 64-row tiles): batch 1 (one row per expert) gate/up+SiLU bf16
# 27.0 vs 31.4 us, FP8 20.7 vs 27.1; down bf16 15.9 vs 17.5, FP8 10.7 vs 12.5; batch 32 (~4 rows per expert)
# gate/up+SiLU bf16 175.9 vs 194.2, FP8 102.1 vs 130.4, down FP8 49.9 vs 51.6 but bf16 94.3 vs 90.5 (with 64-wide
# K steps; 128-wide ones, pick_config, beat both); FP8 q/kv_a at one row 10.7 vs 14.3.
DECODE_GROUP_ROWS = 8
DECODE_ROWS = 16


def rows_per_group(rows: int, groups: int) -> int:
    """The typical rows per group of a grouped GEMM, what its tiles are picked by (at least 1)."""
    return max(1, rows // max(groups, 1))


@functools.lru_cache(maxsize=4096)
def pick_config(rows: int, n: int, k: int, b_kind: int, layout: int, device: torch.device, fused: bool = False,
                ieee: bool = False) -> TileConfig:
    """Tile shape by problem size. `rows` is the typical rows per group (all of M for one matrix).

    Shapes were checked ahead of time for sm_90a (registers, no spills: TMA-fed tiles leave the pointer
    arithmetic out of the registers); the launcher drops TMA where strides are not 16-byte aligned.
    """
    if interpreting():  # few, large numpy programs are what is fast on the CPU
        bk = BLOCK if b_kind == 1 else 64
        return TileConfig(bm=16 if rows <= 16 else 64, bn=BLOCK if fused else 64, bk=bk, warps=4, stages=1)
    if ieee:  # float32 FMA dots (float32 / mixed activations): small tiles, no tensor cores
        return TileConfig(bm=32, bn=64, bk=32, warps=4, stages=2, tma=False)
    fp8 = b_kind == 1
    bk = BLOCK if fp8 else 64
    stages = 5 if fp8 else 4
    decode = rows <= (DECODE_GROUP_ROWS if layout != 0 else DECODE_ROWS)
    # Grouped decode tiles past 2 rows per group step K by 128 for bf16 as for FP8: half the loop trips of 64-wide
    # steps for the same bytes per stage. H200, V2-Lite (2026-11-30): e2e batch 32 3163-3167 vs 3116-3118 tok/s;
    # gemm_decode.py --sweep at batch 32 gate/up+SiLU 172.9 vs 181.6 us, down 91.2 vs 92.8 (the 64-row TMA tile
    # it replaces). At batch 1 the sweep favoured them too (down 15.9 vs 17.3 us), but e2e lost 2% (381 vs 390
    # tok/s, with or without MLA's short-K absorptions): one row per group keeps 64-wide steps, deeper pipelines.
    # NVFP4's dequantised tile keeps 64.
    wide_k = BLOCK if fp8 or (b_kind == 0 and rows > 2) else bk
    if fused:  # two accumulators (+ two promotion temporaries for FP8): halve the rows per tile
        # Decode: 64 columns, FP8 too (a quantised output widens them to its 128-column groups: gate_up_silu's
        # tile_n). H200, V2-Lite FP8 batch 1: twice the CTAs of 128-wide tiles (176 for 132 SMs), gate/up 17.9 vs
        # 18.8 us, e2e 470.8 / 470.2 vs 463.3 / 464.8 tok/s; batch 32 equal (RESULTS.md issue 10, thirteenth session).
        if decode:
            return TileConfig(bm=16, bn=64, bk=wide_k, warps=4, stages=3 if wide_k > bk else 4)
        return TileConfig(bm=64, bn=BLOCK, bk=bk, warps=8, stages=4 if fp8 else 3, tma=True)
    if decode and layout != 0 and (wide_k > bk or fp8):
        return TileConfig(bm=16, bn=128, bk=wide_k, warps=4, stages=4 if fp8 else 3)
    if decode and layout != 0 and rows <= 2:  # past 2 rows, 64-wide K steps do better on the 64-row TMA tiles below
        return TileConfig(bm=16, bn=128, bk=bk, warps=4, stages=6)
    sms = _num_sms(device)
    if layout != 0 and fp8:  # grouped FP8: the large-M tile below at every group size (H200, 2026-11-29: 8 x 512
        # rows 896 vs 805 TFLOPS for 128x128 / 8 warps; 256 experts top-8: 4096 tokens 627 vs 474, 128 tokens 34 vs 32-34)
        return TileConfig(bm=64, bn=128, bk=bk, warps=4, stages=3, tma=True)
    if layout != 0:  # grouped: 64-row tiles while groups are small (decode), else 128 (measured on H200)
        if rows <= 128:
            return TileConfig(bm=64, bn=128, bk=bk, warps=4, stages=stages, tma=True)
        return TileConfig(bm=128, bn=128, bk=bk, warps=8, stages=4 if fp8 else 3, tma=True)
    # One matrix. Small M streams the weight: narrow tiles and split-K so every SM has a share; large M is
    # compute-bound and TMA-fed. (The launcher loads small-M FP8 tiles through pointers when not capturing.)
    if decode:
        cfg = TileConfig(bm=16, bn=64, bk=bk, warps=4, stages=6)
    elif fp8 and rows <= 128:
        # One-warpgroup 64-row tiles, TMA-fed: 128 columns (3 stages) where those tiles alone fill the GPU, else
        # 64 columns (5 stages) split along K to fill it. H200 sweep at M = 64 / 128 over ANCHORS.md's shapes
        # (benchmarks/RESULTS.md issue 9, thirteenth session): within 4% of the best of ~20 tiles on 11 of 12
        # (7% on M = 64, 7168x16384); M = 128 24576x1536 482 TFLOPS against 337 for the 128x128 / 8-warp tile.
        if cdiv(rows, 64) * cdiv(n, 128) >= sms:
            return TileConfig(bm=64, bn=128, bk=bk, warps=4, stages=3, tma=True)
        cfg = TileConfig(bm=64, bn=64, bk=bk, warps=4, stages=5, tma=True)
    elif rows <= 64:
        cfg = TileConfig(bm=64, bn=64, bk=bk, warps=4, stages=stages)
    elif rows <= 128:
        wide_n = cdiv(n, 128) >= sms  # enough 128x128 tiles to fill the GPU without splitting K
        cfg = TileConfig(bm=128, bn=128, bk=bk, warps=8, stages=4) if wide_n else TileConfig(bm=64, bn=64, bk=bk, warps=4, stages=stages)
    elif fp8:
        return TileConfig(bm=64, bn=128, bk=bk, warps=4, stages=_fp8_large_m_stages(rows, n, k, sms), group_m=16, tma=True)
    elif b_kind == 2:
        # NVFP4 weight-only is bound by decoding B: 256 rows a tile decode each B tile for twice the rows of a
        # 128 x 128 tile. H200, M = 4096, 7168x2048 / 2112x7168 / 4096x7168: 247 / 246 / 266 TFLOPS against
        # 104 / 88 / 101 (benchmarks/RESULTS.md issue 9, twentieth session).
        return TileConfig(bm=256, bn=64, bk=bk, warps=8, stages=3)
    else:
        return TileConfig(bm=128, bn=128, bk=bk, warps=8, stages=3, tma=True)
    tiles = cdiv(rows, cfg.bm) * cdiv(n, cfg.bn)
    kb = cdiv(k, bk)
    if tiles < sms and kb >= 8:
        cfg = replace(cfg, split_k=split_divisor(kb, min(sms // tiles, kb // 4, 8)))
    return cfg


def _fp8_large_m_stages(rows: int, n: int, k: int, sms: int) -> int:
    """Pipeline depth of the large-M FP8 tile (64x128, one warpgroup), which sets how many CTAs share an SM.

    Triton retires each K block's MMA before promoting it (the scale FMAs wait for the tensor cores and the
    tensor cores for them), so one 128x128 CTA per SM idles its tensor cores during every promotion. Small
    CTAs overlap instead: with 3 stages (165 registers, 72 KiB of shared memory) three fit on an SM and one's
    promotion runs during another's MMAs: +15-40% over 128x128 / 8 warps at M=4096 (H200, 2026-11-29).
    With long K a tile runs for long, so a last, partly filled wave of CTAs costs more; 4 stages (two CTAs
    per SM) then win where their waves fill better (7168x16384: 995 vs 858 TFLOPS; 4096x7168: 959 vs 900),
    and lose 6-16% elsewhere. (Issuing a half-tile's MMA before promoting the other half, so that one stays
    in flight, measured 5-25% slower: 64-wide MMAs re-read A from shared memory; tiles with more than 64x128
    accumulators per warpgroup spill, since promotion needs two accumulators.)
    """
    if k < 4096:
        return 3
    tiles = cdiv(rows, 64) * cdiv(n, 128)
    fill = lambda per_sm: tiles / (cdiv(tiles, per_sm * sms) * per_sm * sms)  # noqa: E731 - last-wave occupancy
    return 4 if fill(2) > fill(3) else 3


def split_divisor(kb: int, want: int) -> int:
    """The largest divisor of the K-block count that is <= want (the kernel needs equal splits)."""
    return max(d for d in range(1, max(1, want) + 1) if kb % d == 0)


def native_nvfp4_available(device: torch.device) -> bool:
    """SM100's tcgen05 block-scaled FP4 MMA; gates a native path (not implemented yet: weight-only runs)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


# --- activation quantisation ----------------------------------------------------------------------
def quantize_fp8(x: torch.Tensor, column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]); column-major scales on request (a
    transposed view of a [KB, M] buffer) for the GEMM."""
    m, k = x.shape
    kb = cdiv(k, BLOCK)
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=quant.FP8_DTYPE, device=x.device)
    s = torch.empty(kb, m, dtype=torch.float32, device=x.device).t() if column_major_scales else \
        torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m:
        bm = 16 if interpreting() else 8
        K.quant_fp8_kernel[(cdiv(m, bm), kb)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                                     BLOCK_M=bm, GROUP=BLOCK, num_warps=4, **launch_kwargs())
    return q, s


# --- the tile GEMM launcher -----------------------------------------------------------------------
def _b_kind(weight: LinearWeight) -> int:
    return {WeightFormat.DENSE: 0, WeightFormat.FP8_BLOCK: 1, WeightFormat.NVFP4: 2}[weight.format]


def _compute_dtype(x_dtype: torch.dtype, weight: LinearWeight) -> torch.dtype:
    if interpreting():  # the interpreter's bf16 dot reads raw bits as integers; float32 is exact for 16-bit inputs
        return torch.float32
    if weight.format is WeightFormat.DENSE:
        return x_dtype if x_dtype == weight.data.dtype and x_dtype != torch.float32 else torch.float32
    return x_dtype  # nvfp4 dequantises exactly into bf16 / fp16 / fp32


def _launch(a, a_scale, weight: LinearWeight, out, *, layout: int, sizes, m: int, groups: int, cap: int, n: int,
            rows_hint: int, out_scale=None, fused: bool = False, round_dtype=None, cfg: TileConfig | None = None,
            invariant: bool = False, group_strides: tuple[int, int, int] = (0, 0, 0), tile_n: int | None = None):
    """One launch of gemm_kernel: a [rows, K] (e4m3 with a_scale, or float), weight [G?, N_b, K] -> out [rows, n].
    Layout 3 (strided groups of cap rows each): a, out and out_scale rows of group g start at g times
    group_strides (a, out, out_scale) and step by their stride(0). tile_n: the tile width the caller needs
    (a quantised output's 128-column groups), whatever the configuration says."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b_kind = _b_kind(weight)
    k = weight.in_features
    a_fp8 = a.dtype == quant.FP8_DTYPE
    # Large M (one matrix, or groups of many rows) on Hopper: the warp-specialised Gluon kernel.
    if (layout in (0, 1) and b_kind == 1 and not fused and cfg is None and not invariant and out_scale is None
            and gemm_gluon.fp8_ws_usable(a, a_scale, weight.data, weight.scale, out, m, groups if layout else 0)):
        gemm_gluon.launch_fp8_ws(a, a_scale, weight.data, weight.scale, out, group_sizes=sizes if layout else None)
        return out
    # ... and a one-row-tile matrix where its persistent loop beats the tile kernel (gemm_gluon.small_m_split).
    if layout == 0 and b_kind == 1 and not fused and cfg is None and not invariant and out_scale is None:
        split = gemm_gluon.small_m_split(a, a_scale, weight.data, weight.scale, out, m, _num_sms(a.device))
        if split:
            gemm_gluon.launch_fp8_ws(a, a_scale, weight.data, weight.scale, out, consumers=2, split=split)
            return out
    # A decode step's few E4M3 rows: the weights-as-M kernel (its E4M3 wgmmas convert no weight).
    if (layout in (0, 1) and cfg is None and not invariant and out_scale is None and tile_n is None
            and (not fused or round_dtype in (None, out.dtype)) and WM.usable(a, a_scale, weight, fused)):
        return WM.launch(a, a_scale, weight, out, sizes if layout else None, gated=fused)
    w = weight.data if weight.data.dim() == 3 else weight.data.unsqueeze(0)
    sc = weight.scale
    if sc is not None and sc.dim() == w.dim() - 1:
        sc = sc.unsqueeze(0)
    bg = weight.global_scale if weight.global_scale is not None else w  # any pointer when unused
    quant_out = out.dtype == quant.FP8_DTYPE
    compute = _compute_dtype(a.dtype, weight) if not a_fp8 else torch.float32
    ieee = compute == torch.float32 and not a_fp8
    if invariant:  # batch-invariant mode: one tile shape whatever M is, no split-K: a row's sums run in a fixed order
        rows_hint = 64
    picked = cfg is None
    cfg = cfg or pick_config(rows_hint, n, k, b_kind, layout if not invariant else 1, a.device, fused, ieee)
    if tile_n is not None and cfg.bn != tile_n:
        cfg = replace(cfg, bn=tile_n)
    even_k = k % cfg.bk == 0
    # TMA needs 16-byte aligned bases and row strides (else the same kernel loads through pointers).
    # Triton 3.6 encodes TMA descriptors on every launch: 20-55 us more host time than pointer loads (H200 host,
    # M <= 128; RESULTS.md issue 9, thirteenth session), more than the GPU time they save on a small one-matrix
    # GEMM. A graph pays it once at capture, so picked tiles there are TMA-fed only then (same tiles, same sums).
    eager_small = picked and layout == 0 and m <= 128 and not (a.is_cuda and torch.cuda.is_current_stream_capturing())
    use_tma = (cfg.tma and not eager_small and b_kind != 2 and layout != 3 and (k * a.element_size()) % 16 == 0
               and (k * w.element_size()) % 16 == 0
               and a.stride(0) > 0 and (a.stride(0) * a.element_size()) % 16 == 0  # (not a broadcast row: no TMA)
               and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
               and w.stride(1) == k and w.stride(0) == w.shape[1] * k)
    a_arg, b_arg = a, w
    if use_tma:
        a_arg = TensorDescriptor(a, list(a.shape), list(a.stride()), [cfg.bm, cfg.bk])
        w2 = w.reshape(-1, w.shape[-1])
        b_arg = TensorDescriptor(w2, list(w2.shape), list(w2.stride()), [cfg.bn, cfg.bk])
    split = split_divisor(cdiv(k, cfg.bk), cfg.split_k) if not fused and layout != 3 else 1
    # Under PDL a one-matrix GEMM asks for its weight rows in L2 before waiting for the kernel before it (which
    # never writes them): at decode sizes their streaming then starts during that kernel's tail. Only the
    # blocks the pipeline's first stages load: prefetching a CTA's whole slice delays its first tile.
    prefetch = 0
    if launch_kwargs() and layout == 0 and not use_tma and not fused and b_kind != 2:
        prefetch = next_pow2(cdiv(min(cdiv(k, split), cfg.stages * cfg.bk) * w.element_size(), 128))
    if layout == 0:
        m_tiles = cdiv(m, cfg.bm)
    elif layout == 1:
        m_tiles = cdiv(m, cfg.bm) + min(groups, m)
    else:
        m_tiles = groups * cdiv(cap, cfg.bm)
    n_tiles = cdiv(n, cfg.bn)
    target = out
    if split > 1:
        # Masked layout: rows past a group's count are never written but are summed by the reduction (into
        # rows the contract leaves undefined): zeroed, so that sum is not of uninitialised memory.
        alloc = torch.zeros if layout == 2 else torch.empty
        target = alloc(split, m, n, dtype=torch.float32, device=a.device)
    a_s = a_scale if a_scale is not None else a
    sc_arg = sc if sc is not None else w
    cs = out_scale if out_scale is not None else out
    sizes_arg = sizes if sizes is not None else a
    s_as = (a_scale.stride(0), a_scale.stride(1)) if a_scale is not None else (0, 0)
    s_bs = (sc.stride(0), sc.stride(1), sc.stride(2)) if sc is not None else (0, 0, 0)
    s_cs = (out_scale.stride(0), out_scale.stride(1)) if out_scale is not None else (0, 0)
    K.gemm_kernel[(m_tiles * n_tiles, split)](
        a_arg, a_s, b_arg, sc_arg, bg, target, cs, sizes_arg,
        m, n, k, groups, cap,
        a.stride(0), *s_as,
        w.stride(0), w.stride(1), w.stride(2), *s_bs,
        out.stride(0), *s_cs, m * n, m_tiles, *group_strides,
        A_FP8=a_fp8, B_KIND=b_kind, LAYOUT=layout, FUSE_SILU=fused, QUANT_OUT=quant_out, SPLIT_K=split, IS_SPLIT=split > 1,
        EVEN_K=even_k, USE_TMA=use_tma, COMPUTE=_tl_dtype(compute), IEEE=ieee,
        ROUND_OUT=_tl_dtype(round_dtype or torch.float32), BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
        G_P=next_pow2(max(groups, 1)), IMPRECISE=cfg.imprecise, WS=cfg.ws, STAGES=cfg.stages,
        K_ITERS=cdiv(k, cfg.bk) // split if interpreting() else 0, EXACT=interpreting(),
        SCALAR_BS=BLOCK % cfg.bn == 0 and (not fused or n % BLOCK == 0),
        num_warps=cfg.warps, num_stages=cfg.stages, PREFETCH=prefetch, **launch_kwargs(),
    )
    if split > 1:
        block = 1024
        K.splitk_reduce_kernel[(cdiv(m * n, block),)](target, out, m * n, SPLIT_K=split, BLOCK=block,
                                                                      EXACT=interpreting(), **launch_kwargs())
    return out


def _prepare_a(x: torch.Tensor, weight: LinearWeight, x_scale: torch.Tensor | None):
    """Activations as the kernel reads them: quantised for FP8 weights (unless already), else as they are."""
    if weight.format is WeightFormat.FP8_BLOCK:
        if x.dtype == quant.FP8_DTYPE:
            return x, x_scale
        return quantize_fp8(x, column_major_scales=True)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, None


# --- public entry points --------------------------------------------------------------------------
def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: LinearWeight, out_dtype=torch.bfloat16,
             cfg: TileConfig | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """Pre-quantised e4m3 activations [M, K] + scales [M, KB] (any strides) @ an fp8_block weight -> out_dtype."""
    m = xq.shape[0]
    out = torch.empty(m, weight.out_features, dtype=out_dtype, device=xq.device)
    if m:
        xq = xq if xq.stride(-1) == 1 else xq.contiguous()  # the kernel steps along K by pointer offsets
        _launch(xq, x_scale, weight, out, layout=0, sizes=None, m=m, groups=1, cap=0, n=weight.out_features,
                rows_hint=m, cfg=cfg, invariant=batch_invariant)
    return out


def linear(x: torch.Tensor, weight: LinearWeight, cfg: TileConfig | None = None, dense_triton: bool | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype; x may be quant.Fp8Activations (fp8_block weights). batch_invariant:
    fixed tiles (and no cuBLAS, which picks kernels by M), so a row's result does not depend on the other rows."""
    weight = _check_weight(weight, 2)
    if isinstance(x, quant.Fp8Activations):
        check_fp8_activations(x, weight)
        if cfg is None and gemv_usable(x, weight, batch_invariant):
            return gemv(x, weight)
        return fp8_gemm(x.data, x.scale, weight, x.dtype, cfg, batch_invariant)
    x = _check_x(x, weight)
    if cfg is None and not dense_triton and gemv_usable(x, weight, batch_invariant):
        return gemv(x, weight)
    dense_triton = dense_triton or batch_invariant
    x2 = x.reshape(-1, weight.in_features)
    m, n = x2.shape[0], weight.out_features
    if weight.format is WeightFormat.DENSE and not (interpreting() if dense_triton is None else dense_triton):
        if x2.dtype == weight.data.dtype:
            out = x2 @ weight.data.t()
        else:
            out = (x2.float() @ weight.data.float().t()).to(x.dtype)
        return out.reshape(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        a, a_scale = _prepare_a(x2, weight, None)
        _launch(a, a_scale, weight, out, layout=0, sizes=None, m=m, groups=1, cap=0, n=n, rows_hint=m, cfg=cfg,
                invariant=batch_invariant)
    return out.reshape(*x.shape[:-1], n)


def _check_sizes(group_sizes: object, groups: int, total: int | None, device: torch.device, validate: bool = True) -> None:
    check_tensor("group_sizes", group_sizes, shape=(groups,), dtypes=INT_DTYPES, device=device)
    if not validate:  # sizes from this process's dispatch; the kernels clamp them to the rows there are anyway
        return
    sizes = group_sizes.tolist()
    if any(s < 0 for s in sizes) or (total is not None and sum(sizes) != total):
        raise InvalidInputError(f"group_sizes must be non-negative and sum to x's {total} rows, got {sizes}")


def grouped_linear(x: torch.Tensor, weight: LinearWeight, group_sizes: torch.Tensor, x_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, cfg: TileConfig | None = None,
                   batch_invariant: bool = False, validate: bool = True, sizes_settled: bool = False) -> torch.Tensor:
    """Contiguous layout: x [M, K] rows sorted by group, group_sizes [G] on the device -> [M, N].

    x may be pre-quantised e4m3 with x_scale [M, KB] (fp8_block weights only); the output is then out_dtype
    (bf16 by default), else x's dtype. The value check of group_sizes syncs with the host unless the
    stream is capturing a graph. sizes_settled: see Backend.grouped_linear (the GEMV then reads the sizes and
    its first weight slab before its PDL wait).
    """
    weight = _check_weight(weight, 3)
    if x_scale is None or x.dtype != quant.FP8_DTYPE:
        x = _check_x(x, weight, ndim=2)
    _check_sizes(group_sizes, weight.num_groups, x.shape[0], x.device, validate)
    if cfg is None and not batch_invariant and gemv_grouped_usable(x, weight, x_scale):
        return gemv_grouped(x, weight, group_sizes, x_scale, out_dtype, sizes_early=sizes_settled)
    m, n = x.shape[0], weight.out_features
    out = torch.empty(m, n, dtype=out_dtype or (x.dtype if x.dtype != quant.FP8_DTYPE else torch.bfloat16), device=x.device)
    if m:
        a, a_scale = _prepare_a(x, weight, x_scale)
        _launch(a, a_scale, weight, out, layout=1, sizes=group_sizes, m=m, groups=weight.num_groups, cap=0, n=n,
                rows_hint=rows_per_group(m, weight.num_groups), cfg=cfg, invariant=batch_invariant)
    return out


def grouped_linear_masked(x: torch.Tensor, weight: LinearWeight, counts: torch.Tensor, x_scale: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None, cfg: TileConfig | None = None) -> torch.Tensor:
    """Masked layout: x [G, cap, K], counts [G] on the device -> [G, cap, N]; row r of group g is computed
    when r < counts[g], other rows are left undefined. No host sync: for decode under CUDA graphs."""
    weight = _check_weight(weight, 3)
    groups = weight.num_groups
    if x_scale is None or x.dtype != quant.FP8_DTYPE:
        x = _check_x(x, weight, ndim=3)
    if x.shape[0] != groups:
        raise InvalidInputError(f"x has {x.shape[0]} groups; the weight has {groups}")
    check_tensor("counts", counts, shape=(groups,), dtypes=INT_DTYPES, device=x.device)
    cap, n = x.shape[1], weight.out_features
    out = torch.empty(groups, cap, n, dtype=out_dtype or (x.dtype if x.dtype != quant.FP8_DTYPE else torch.bfloat16), device=x.device)
    if cap:
        flat = x.reshape(groups * cap, x.shape[2])
        a, a_scale = _prepare_a(flat, weight, None if x_scale is None else x_scale.reshape(groups * cap, -1))
        _launch(a, a_scale, weight, out.view(groups * cap, n), layout=2, sizes=counts, m=groups * cap, groups=groups,
                cap=cap, n=n, rows_hint=cap, cfg=cfg)
    return out


def per_head_linear(x: torch.Tensor, weight: LinearWeight, quantize: bool = False, cfg: TileConfig | None = None,
                    batch_invariant: bool = False) -> torch.Tensor | quant.Fp8Activations:
    """x [T, H, K] (any token and head strides) @ weight[h]^T per head h -> [T, H, N] in x's dtype, or with
    `quantize` the [T, H * N] rows as quant.Fp8Activations (N a multiple of 128): one launch that reads and
    writes the per-token layout in place (layout 3), where the grouped layout needs transposed copies.
    Dense weights with x in their dtype; the callers (CudaSM100Backend.per_head_linear) check that."""
    t, h, k = x.shape
    n = weight.out_features
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cfg is None and gemv_per_head_usable(x, weight, batch_invariant):
        # quantize or not, the plain rows: the FP8 projection's one-row GEMV quantises them itself, to the same
        # bits as quantize_fp8, with one launch fewer
        return gemv_per_head(x, weight)
    if quantize:
        data = torch.empty(t, h * n, dtype=quant.FP8_DTYPE, device=x.device)
        scale = torch.empty(t, h * n // BLOCK, dtype=torch.float32, device=x.device)
        out, result = data.view(t, h, n), quant.Fp8Activations(data, scale, x.dtype)
        strides = (x.stride(1), n, n // BLOCK)
    else:
        out = result = torch.empty(t, h, n, dtype=x.dtype, device=x.device)
        scale, strides = None, (x.stride(1), n, 0)
    if t:
        # 128-wide tiles: a tile row is one quantisation group, and quantised or not the sums run alike (so the
        # quantised rows are exactly the plain rows quantised)
        _launch(x, None, weight, out, layout=3, sizes=None, m=h * t, groups=h, cap=t, n=n, rows_hint=t,
                out_scale=scale, round_dtype=x.dtype, cfg=cfg, invariant=batch_invariant, group_strides=strides,
                tile_n=BLOCK if n % BLOCK == 0 else None)
    return result


def fuse_gate_up(rows: int, groups: int) -> bool:
    """Whether a grouped gate/up runs fused with SiLU: at decode sizes (the 16-row tiles), where the fused
    kernel beats the plain GEMM + silu_and_mul (H200, V2-Lite, d6f57ec: batch 32 bf16 182 vs 189 us, FP8 102
    vs 103). With 64-row tiles it lost from batch 32 (e2e at 91cbfb2: two accumulators halve a tile's rows)."""
    return rows_per_group(rows, groups) <= DECODE_GROUP_ROWS


def gate_up_silu(x: torch.Tensor, gate_up: LinearWeight, group_sizes: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None, quantize: bool = True, cfg: TileConfig | None = None,
                 validate: bool = True, settled_tail: int = 0):
    """silu(x @ gate^T) * (x @ up^T) for a [.., 2I, K] gate/up weight, in one kernel.

    Layout: a 2-D weight (dense MLP), or stacked with group_sizes (contiguous, x [M, K]) or counts (masked,
    x [G, cap, K]). With `quantize` (FP8 weights, I a multiple of 128) the result comes back as e4m3 plus
    fp32 scales per token per 128 channels, ready for the down projection; else in x's dtype. Numerically
    it is silu_and_mul(linear(x, gate_up)) with the same roundings, then quantize_fp8_per_token_group.
    settled_tail: Backend.gated_linear's (taken by the grouped GEMV).
    """
    stacked = group_sizes is not None or counts is not None
    gate_up = _check_weight(gate_up, 3 if stacked else 2)
    x = _check_x(x, gate_up, ndim=3 if counts is not None else 2)
    if gate_up.out_features % 2:
        raise InvalidInputError(f"gate/up weight needs an even number of rows, got {gate_up.out_features}")
    inter = gate_up.out_features // 2
    quantize = quantize and gate_up.format is WeightFormat.FP8_BLOCK
    if quantize and inter % BLOCK:
        raise InvalidInputError(f"fused FP8 output needs the intermediate size to be a multiple of 128, got {inter}")
    groups = gate_up.num_groups
    if counts is not None:
        if x.shape[0] != groups:
            raise InvalidInputError(f"x has {x.shape[0]} groups; the weight has {groups}")
        check_tensor("counts", counts, shape=(groups,), dtypes=INT_DTYPES, device=x.device)
        layout, cap, sizes = 2, x.shape[1], counts
        flat = x.reshape(-1, x.shape[-1])
    else:
        layout, cap, sizes, flat = (1 if stacked else 0), 0, group_sizes, x
        if stacked:
            _check_sizes(group_sizes, groups, x.shape[0], x.device, validate)
    m = flat.shape[0]
    lead = x.shape[:-1]
    # One decode token's expert rows: the grouped GEMV. (A dense MLP's one row never comes here: the backend's
    # gated_linear sends it to the GEMV itself.)
    if not quantize and cfg is None and layout == 1 and gemv_grouped_usable(flat, gate_up, gated=True):
        return gemv_grouped(flat, gate_up, group_sizes, gated=True, settled_tail=settled_tail).reshape(*lead, inter)
    if quantize:
        out = torch.empty(m, inter, dtype=quant.FP8_DTYPE, device=x.device)
        out_scale = torch.empty(m, inter // BLOCK, dtype=torch.float32, device=x.device)
    else:
        out, out_scale = torch.empty(m, inter, dtype=x.dtype, device=x.device), None
    if m:
        a, a_scale = _prepare_a(flat, gate_up, None)
        rows_hint = cap if layout == 2 else rows_per_group(m, groups)
        _launch(a, a_scale, gate_up, out, layout=layout, sizes=sizes, m=m, groups=groups, cap=cap, n=inter,
                rows_hint=rows_hint, out_scale=out_scale, fused=True, round_dtype=x.dtype, cfg=cfg,
                tile_n=BLOCK if quantize else None)
    if quantize:
        return out.reshape(*lead, inter), out_scale.reshape(*lead, inter // BLOCK)
    return out.reshape(*lead, inter)


def silu_and_mul(x: torch.Tensor, quantize: bool = False):
    """[..., 2N] -> silu(gate) * up [..., N] in x's dtype; with `quantize` (N % 128 == 0) as e4m3 + scales."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise InvalidInputError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r = x2.shape[0]
    if quantize and n % BLOCK:
        raise InvalidInputError(f"quantised silu_and_mul needs N to be a multiple of 128, got {n}")
    out = torch.empty(r, n, dtype=quant.FP8_DTYPE if quantize else x.dtype, device=x.device)
    scale = torch.empty(r, n // BLOCK if quantize else 1, dtype=torch.float32, device=x.device)
    if r and n:
        br = 4 if interpreting() else 8
        bn = BLOCK if quantize else min(1024, next_pow2(n))
        K.silu_mul_kernel[(cdiv(r, br), cdiv(n, bn))](
            x2, out, r, n, x2.stride(0), out.stride(0), BLOCK_R=br, BLOCK_N=bn, QUANT=quantize,
            s_ptr=scale, stride_sr=scale.stride(0), stride_sk=scale.stride(1), EXACT=interpreting(), num_warps=4,
            **launch_kwargs())
    if quantize:
        return out.reshape(*x.shape[:-1], n), scale.reshape(*x.shape[:-1], n // BLOCK)
    return out.reshape(*x.shape[:-1], n)
