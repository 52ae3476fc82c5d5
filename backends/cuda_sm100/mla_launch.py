"""Which kernel and tile shape each cuda_sm100 MLA launch takes: the Triton kernel's configuration table, the
Gluon kernels for 64-row tiles and (keys as the MMA's M) for tiles of at most 16 rows where they run, and the
combine's program shape. attention.run_attention asks;
plain Python (the tables are tested on CPU), kernels imported at launch.
"""

from __future__ import annotations

import os

import torch

from deepinfer.attention import KVCacheSpec
from deepinfer.backends.cuda_sm100 import gluon_gate
from deepinfer.errors import InvalidInputError
from deepinfer.quant import cdiv, next_pow2


def pow2(n: int) -> int:
    """The next power of two, at least 16 (Triton block sizes)."""
    return max(16, next_pow2(n))


# --- the Triton kernel's tiles ------------------------------------------------------------------------------

# (BM, BN, num_warps, num_stages[, fold, cvt]) candidates, best first; a launch that runs out of shared memory
# or registers moves down the list (remembered per shape), so an untried GPU never fails a step. fold / cvt
# (FP8 only): fold the scales into scores and probabilities, and which E4M3 conversion (fp8_operand's CVT);
# without them the tile is dequantised by the cvt chain.
# Rank 512 (DeepSeek): candidates from sm_90 compiles (benchmarks/triton_sm90_report.py: few or no spills,
# asynchronous copies in the key loop) ordered by H200 timings (benchmarks/mla_decode.py --sweep). 64-row
# tiles use wgmma and need 8 warps for the 64 x 512 fp32 accumulator; 16 / 32-row tiles use mma.sync. Splitting
# the output columns over two one-warpgroup programs (two per SM) measured 1.5x slower at 128 heads: both
# recompute the scores.
# 16 / 32-row tiles: one warpgroup per program, two programs per SM (registers allow two at 4 warps, one at 8),
# hide each other's load latency (H200, 2026-11-30). 16 heads: bf16 9% faster at 128x4096 and 1x16384, FP8
# with folded scales and bit-placed conversion 10-28% faster. 32 heads: bf16 2.0-2.4x at 64x4096 and 16x32768
# (despite 32-64 bytes of spills), FP8 9-12%. Items of a single key tile ("one-tile": 64-key splits, steps of
# at most attention.TINY_STEP_KEYS keys) have no key loop to overlap, and keep 8 warps (16 heads, 1x1024: bf16
# 11.7 vs 12.1 us, FP8 14.0 vs 15.4).
_GPU_CONFIGS = {
    ("big", 64, False): [(64, 64, 8, 2), (64, 32, 8, 2), (64, 16, 8, 2)],
    ("big", 32, False): [(32, 64, 4, 2), (32, 32, 8, 2), (32, 16, 8, 2), (32, 16, 4, 1)],
    ("big-one-tile", 32, False): [(32, 32, 8, 2), (32, 16, 8, 2), (32, 16, 4, 1)],
    ("big", 16, False): [(16, 64, 4, 2), (16, 64, 8, 2), (16, 32, 8, 2), (16, 16, 4, 1)],
    ("big-one-tile", 16, False): [(16, 64, 8, 2), (16, 32, 8, 2), (16, 16, 4, 1)],
    ("big", 64, True): [(64, 64, 8, 2), (64, 32, 8, 2), (64, 16, 8, 2)],
    ("big", 32, True): [(32, 32, 4, 2, 1, 1), (32, 32, 8, 2), (32, 16, 8, 2), (32, 16, 4, 1)],
    ("big-one-tile", 32, True): [(32, 32, 8, 2), (32, 16, 8, 2), (32, 16, 4, 1)],
    ("big", 16, True): [(16, 32, 4, 2, 1, 1), (16, 64, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2)],
    ("big-one-tile", 16, True): [(16, 64, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2)],
}
for _bm in (16, 32, 64):
    for _fp8 in (False, True):
        _GPU_CONFIGS[("small", _bm, _fp8)] = [(_bm, 64, 4, 2), (_bm, 32, 4, 1)]
for _fp8 in (False, True):  # float32 attention (IEEE MMAs run on the FMA units): 16-row tiles, short key tiles
    _GPU_CONFIGS[("f32-big", 16, _fp8)] = [(16, 16, 4, 1), (16, 16, 4, 2)]  # rank 512: fewest spills
    _GPU_CONFIGS[("f32-small", 16, _fp8)] = [(16, 32, 4, 2), (16, 16, 4, 1)]
_CONFIG_FIELDS = ("BM", "BN", "num_warps", "num_stages")


class TileChoices:
    """Where each shape's candidate list starts: launch_triton moves past candidates that run out of shared
    memory or registers on this GPU and remembers the one that launched. A backend owns one."""

    def __init__(self) -> None:
        self._first: dict = {}

    def first(self, shape_key) -> int:
        return self._first.get(shape_key, 0)

    def settle(self, shape_key, index: int) -> None:
        self._first[shape_key] = index


def attn_config(rows: int, spec: KVCacheSpec, interp: bool, batch_invariant: bool, f32: bool = False,
                one_tile: bool = False, gluon: bool = False) -> dict:
    """The launch configuration for tiles of `rows` query rows; one_tile: every item spans at most 64 keys;
    gluon: 64-row tiles of this call would run on the Gluon kernels (launch_gluon applies)."""
    if interp:  # few, large programs: the interpreter's cost is per program and per op, not per element
        bm = 64 if batch_invariant or 16 < rows <= 64 else min(512, pow2(rows))  # 64: the GPU's wgmma tile
        # Both FP8 conversions get exercised: bit placement where the scales fold, the cvt chain elsewhere.
        return dict(BM=bm, BN=64, num_warps=4, num_stages=1, CVT=int(bm != 64))
    override = os.environ.get("DEEPINFER_MLA_CONFIG")  # "BM,BN,warps,stages[,fold[,cvt]]": benchmark sweeps
    if override:
        v = [int(x) for x in override.split(",")]
        cfg = dict(zip(_CONFIG_FIELDS, v[:4]))
        if len(v) > 4:
            cfg["FOLD"] = bool(v[4])
        if len(v) > 5:
            cfg["CVT"] = v[5]
        return cfg
    size = "big" if spec.kv_lora_rank > 128 else "small"
    if f32:
        key = (f"f32-{size}", 16, spec.is_fp8)
        return dict(zip(_CONFIG_FIELDS, _GPU_CONFIGS[key][0]), _key=key)
    # Batch-invariant: one tile shape whatever the query count, so every row takes the same MMA path.
    # 17-32 rows (32 heads, or 16 heads verifying 2 tokens) on the Gluon kernels: a 64-row tile, half of it
    # padding, still beats the 32-row Triton tile (H200, 2026-11-30, eight shapes from 1 x 1024 to 32 x 65536
    # keys: FP8 cache 1.27-1.55x, bf16 1.00-1.10x); 16 rows stay on their tile (FP8 0.92x on the Gluon kernel).
    wide = rows > 32 or (gluon and rows > 16)
    bm = 64 if batch_invariant or wide else (32 if rows > 16 else 16)
    key = (size, bm, spec.is_fp8)
    if one_tile and (f"{size}-one-tile", bm, spec.is_fp8) in _GPU_CONFIGS:  # only where they differ
        key = (f"{size}-one-tile", bm, spec.is_fp8)
    return dict(zip(_CONFIG_FIELDS, _GPU_CONFIGS[key][0]), _key=key)


def launch_triton(kernel, grid, args, consts, cfg, aligned, fold_ok, choices: TileChoices):
    """mla_attn_kernel with cfg (attn_config's): its table's candidates in order, past any that ran out of
    shared memory or registers on this GPU (remembered per shape in `choices`)."""
    from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

    key = cfg.pop("_key", None)
    if key is None:
        cfg.setdefault("FOLD", fold_ok(cfg["BM"]))
        cfg.setdefault("CVT", 0)
        kernel[grid](*args, **consts, **cfg, ALIGNED=aligned(cfg["BN"]), **launch_kwargs())
        return
    shape_key = (key, tuple(sorted(consts.items())))
    start = choices.first(shape_key)
    from triton.runtime.errors import OutOfResources

    for i, cand in enumerate(_GPU_CONFIGS[key][start:], start):
        c = dict(zip(_CONFIG_FIELDS, cand))
        if c["BM"] != cfg["BM"]:
            continue
        fold, cvt = (bool(cand[4]), cand[5]) if len(cand) > 4 else (fold_ok(c["BM"]), 0)
        try:
            kernel[grid](*args, **consts, **c, ALIGNED=aligned(c["BN"]), FOLD=fold, CVT=cvt, **launch_kwargs())
            choices.settle(shape_key, i)
            return
        except OutOfResources:
            continue
    raise InvalidInputError(f"no MLA kernel configuration fits this GPU for {consts}")


# --- the combine's programs, and the Gluon kernel for 64-row tiles on Hopper --------------------------------


def combine_tiles(num_tokens: int, heads: int, rank: int, max_splits: int, sms: int) -> tuple[int, int, int]:
    """(heads, columns, splits) one combine program takes at a time: every split at once where they fit (up to
    256: its loop is a chain of dependent loads, a memory latency a round), whole latent rows of several heads
    while that leaves ~2 programs per SM, narrower otherwise (down to 32 columns); at most 8192 partial values in
    flight (64 registers a thread). H200 (benchmarks/RESULTS.md, issue 8): at 64 x 4096 keys x 128 heads, one head
    x 128 columns x 16 split slots a program took 0.11 ms, a third of the attention step; one 16-head token's 128
    splits over 16k keys took 0.0221 ms with its attention in two rounds of 64, 0.0200 in one."""
    st = min(256, next_pow2(max_splits))
    hb, dc = 8, next_pow2(rank)

    def too_big() -> bool:
        return st * hb * dc > 8192 or num_tokens * cdiv(heads, hb) * cdiv(rank, dc) < 2 * sms

    while hb > 1 and too_big():
        hb //= 2
    while dc > 32 and too_big():
        dc //= 2
    return hb, dc, st


# Caches whose tiles of at most 16 rows take the keys-as-M kernel by default. H200 (2026-12-01), 16 heads,
# mla_decode.py, FP8 (mla_attn_gluon_kt_e4m3_kernel, float16 widening) against the Triton tile: 128 x 4096 keys
# 0.20 vs 0.28 ms, 32 x 65536 0.73 vs 1.05; e2e V2-Lite, FP8 weights and cache, batch 32 at 1k 4779 tok/s
# (4084 on the Triton tile). bf16 cache: within 2% either way in mla_decode.py (8% faster at 1 x 16384); e2e
# V2-Lite bf16 (since the one-round combine, two rounds each) batch 1 at 1k 531.9 / 532.7 vs 531.9 / 530.3 tok/s,
# batch 32 at 1k 3502.7 / 3499.7 vs 3363.2 / 3361.1, batch 1 at 16k 480.3 / 479.2 vs 471.8 / 466.6.
# DEEPINFER_MLA_KT=0 keeps the Triton tile (A/B runs).
KT_CACHES = ("fp8_e4m3", "bf16")


def gluon_tile_usable(spec: KVCacheSpec, q_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether 64-row tiles may run on mla_gluon_kernels (Hopper wgmma; bf16 queries, bf16 or FP8 cache at
    DeepSeek's dims). DEEPINFER_MLA_GLUON=0 keeps them on mla_attn_kernel (A/B benchmarks)."""
    if os.environ.get("DEEPINFER_MLA_GLUON", "1") == "0" or device.type != "cuda":
        return False
    if spec.dtype not in ("bf16", "fp8_e4m3") or q_dtype != torch.bfloat16:
        return False
    return (spec.kv_lora_rank, spec.rope_dim) == (512, 64) and gluon_gate.runs_on(device, "mla_gluon_kernels")


def launch_gluon(spec, q_nope, q_pe, views, plan, items, row_tiles, tail, span: int) -> None:
    """Run 64-row tiles on the Gluon kernel (views: attention._cache_views of the cache; span: the most keys an
    item takes). The caller has checked gluon_tile_usable and block-aligned tiles: it chose the tile height
    (attn_config's `gluon`) on them."""
    from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

    args = _gluon_args(q_nope, q_pe, views, plan, items, tail, row_tiles)
    grid = (items.shape[0] * row_tiles,)
    if seesaw_wanted(spec, span, q_nope.device):
        S = gluon_gate.kernels("mla_seesaw_kernels")
        descs = seesaw_descriptors(spec, views) if seesaw_tma_usable() else None
        if descs is not None or not spec.is_fp8:  # an FP8 cache whose blocks TMA cannot copy: the lockstep kernel
            S.mla_seesaw_kernel[grid](*args, *(descs or (views[0], views[0])), TMA=descs is not None,
                                      FP8=spec.is_fp8, num_warps=S.NUM_WARPS, maxnreg=S.MAXNREG, **launch_kwargs())
            return
    G = gluon_gate.kernels("mla_gluon_kernels")
    G.mla_attn_gluon_kernel[grid](*args, R=G.R, P=G.P, BM=G.BM, BN=G.BN, FP8=spec.is_fp8, num_warps=G.NUM_WARPS,
                                  **launch_kwargs())


def keys_as_m_usable(spec: KVCacheSpec, rows: int, device: torch.device) -> bool:
    """Whether tiles of `rows` (<= 16) query rows run on mla_gluon_kt_kernels (keys as the wgmma's M) rather than
    mla_attn_kernel's 16-row tile, where gluon_tile_usable holds and tiles are block-aligned.
    DEEPINFER_MLA_KT: "0" never, "1" for both caches (A/B runs); by default the caches in KT_CACHES."""
    env = os.environ.get("DEEPINFER_MLA_KT")
    wanted = env == "1" if env in ("0", "1") else spec.dtype in KT_CACHES
    return rows <= 16 and wanted and gluon_gate.runs_on(device, "mla_gluon_kt_kernels")


def one_program_an_sm(spec: KVCacheSpec, rows: int, device: torch.device) -> bool:
    """Whether decode items of `rows` (1-32) query rows run one program an SM, as run_attention takes them for the
    model's bf16 queries: on the keys-as-M kernels (at most 16 rows) or a 64-row Gluon tile (17-32 rows), whose
    shared memory fits one; the Triton tiles fit two. The split rule sizes items by it
    (attention.choose_split_tokens)."""
    return (0 < rows <= 32 and gluon_tile_usable(spec, torch.bfloat16, device)
            and (rows > 16 or keys_as_m_usable(spec, rows, device)))


def keys_as_m_ws_usable(spec: KVCacheSpec, device: torch.device) -> bool:
    """Whether an FP8 cache's keys-as-M tiles run on mla_gluon_kt_ws_kernels (TMA loads, widening in a producer
    warpgroup) rather than the one-warpgroup kernel. DEEPINFER_MLA_KT_WS: "0" never, "1" always (tests, A/B
    runs); by default only while a CUDA graph is captured. Triton 3.6 encodes the kernel's three TMA descriptors
    on every launch: an eager call took 280 against 161 us of host time (H200 host, 1 x 1024 keys x 16 heads),
    which a graph pays once. H200, mla_decode.py 16 heads, graph replay, ms: 128 x 4096 keys 0.137, 32 x 65536
    0.476, 64 x 4096 0.080, 1 x 16384 0.018 (thirtieth session); the one-warpgroup kernel 0.203, 0.729, 0.112,
    0.0201 (twenty-ninth; RESULTS.md, issue 8)."""
    return spec.is_fp8 and gluon_gate.runs_on(device, "mla_gluon_kt_ws_kernels") and _tma_wanted("DEEPINFER_MLA_KT_WS")


def _tma_wanted(env_name: str) -> bool:
    """Whether a TMA-fed kernel runs: by default only while a CUDA graph is captured, since Triton 3.6 encodes its
    descriptors on every launch and a graph pays that once; the variable says "0" (never) or "1" (always)."""
    env = os.environ.get(env_name)
    return env != "0" and (env == "1" or torch.cuda.is_current_stream_capturing())


def _blocks_back_to_back(views) -> bool:
    """Whether a cache's rows are one [blocks x BS, row] array with a 16-byte aligned base (TMA descriptors)."""
    lat, lat_sb, lat_st, bs = views[0], views[3], views[4], views[-1]
    return lat_sb == bs * lat_st and lat.is_contiguous() and lat.data_ptr() % 16 == 0


def launch_gluon_kt(spec, q_nope, q_pe, views, plan, items, tail) -> None:
    """Run tiles of at most 16 rows on the keys-as-M Gluon kernel (the caller checked keys_as_m_usable). Its
    successors (the combine, W_UV's GEMV) read only the plan and weights before their wait: pdl.py's EARLY."""
    from deepinfer.backends.cuda_sm100.pdl import early_trigger, launch_kwargs

    descs = e4m3_descriptors(views) if keys_as_m_ws_usable(spec, q_nope.device) else None
    if descs is not None:
        W = gluon_gate.kernels("mla_gluon_kt_ws_kernels")
        W.mla_attn_gluon_kt_e4m3_ws_kernel[(items.shape[0],)](  # the cache as descriptors and its block size
            *_gluon_args(q_nope, q_pe, (*descs, views[-1]), plan, items, tail, 1), num_warps=W.NUM_WARPS,
            maxnreg=W.MAXNREG, EARLY=early_trigger(), **launch_kwargs())
        return
    G = gluon_gate.kernels("mla_gluon_kt_kernels")
    kernel = G.mla_attn_gluon_kt_e4m3_kernel if spec.is_fp8 else G.mla_attn_gluon_kt_kernel
    kernel[(items.shape[0],)](*_gluon_args(q_nope, q_pe, views, plan, items, tail, 1), R=G.R, P=G.P, BM=G.BM,
                              BN=G.BN, num_warps=G.NUM_WARPS, EARLY=early_trigger(), **launch_kwargs())


def e4m3_descriptors(views) -> tuple | None:
    """TMA descriptors for mla_gluon_kt_ws_kernels over an FP8 cache's rows ([blocks x BS, 656 bytes]): the E4M3
    rows, the rope keys, the scales. None where blocks are not back to back or a base is not 16-byte aligned."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    W = gluon_gate.kernels("mla_gluon_kt_ws_kernels")
    lat, scl, rope, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, bs = views
    rows = lat.shape[0] * bs
    if not _blocks_back_to_back(views):
        return None
    half, piece = W.HALF.value, W.PIECE.value
    return (TensorDescriptor(lat, [rows, W.R.value], [lat_st, 1], [half, piece], W.LAT_SMEM.value),
            TensorDescriptor(rope.reshape(-1)[rope_off:], [rows, W.P.value], [rope_st, 1], [half, W.P.value],
                             W.PE_SMEM.value),
            TensorDescriptor(scl.reshape(-1)[scale_off:], [rows, W.G.value], [scl_st, 1], [half, W.G.value],
                             W.SC_SMEM.value))


def _gluon_args(q_nope, q_pe, views, plan, items, tail, row_tiles) -> tuple:
    """The Gluon MLA kernels' arguments (mla_attn_kernel's contract) up to their constexprs."""
    return (q_nope, q_pe, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), *views,
            plan.block_table, plan.block_table.stride(0), plan.meta, plan.meta.stride(0), items, *tail, row_tiles)


def seesaw_tma_usable() -> bool:
    """Whether the seesaw kernel copies key blocks by TMA (one thread's bulk copies, no proxy fences) rather than
    by its warpgroups' cp.async: as for mla_gluon_kt_ws_kernels, only while a CUDA graph is captured unless
    DEEPINFER_MLA_SEESAW_TMA says "0" (never) or "1" (always; tests, A/B runs)."""
    return _tma_wanted("DEEPINFER_MLA_SEESAW_TMA")


def seesaw_descriptors(spec: KVCacheSpec, views) -> tuple | None:
    """The TMA descriptors mla_seesaw_kernels takes (kv_desc, pe_desc): a bf16 cache's rows ([blocks x BS, 576]) in
    64 x 64 boxes (twice: the rope keys are in the rows); an FP8 cache's E4M3 rows in 64 x 128 boxes and its rope
    keys in 64 x 64. None where blocks are not back to back or the base is not 16-byte aligned."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    S = gluon_gate.kernels("mla_seesaw_keys")  # the key blocks' boxes and shared layouts
    lat, rope, lat_st, rope_st, rope_off, bs = views[0], views[2], views[4], views[8], views[10], views[-1]
    if not _blocks_back_to_back(views):
        return None
    rows, bn, box = lat.shape[0] * bs, S.BN.value, S.BOX.value
    if spec.is_fp8:
        return (TensorDescriptor(lat, [rows, S.R.value], [lat_st, 1], [bn, S.E4M3_BOX.value], S.E4M3_SMEM.value),
                TensorDescriptor(rope.reshape(-1)[rope_off:], [rows, S.P.value], [rope_st, 1], [bn, box],
                                 S.KV_SMEM.value))
    desc = TensorDescriptor(lat, [rows, lat_st], [lat_st, 1], [bn, box], S.KV_SMEM.value)
    return desc, desc


# An FP8 cache's items take the seesaw kernel from this many keys (an item's span) on, the lockstep kernel below:
# the seesaw costs more a program and less a key. H100, 128 heads, mla_decode.py --sweep, graph replay, with the
# widening a packed pair at a time (RESULTS.md issue 8, thirty-fifth session), seesaw vs lockstep, ms: items of
# 1024 keys 0.310 vs 0.350 (64 x 4096), 0.089 vs 0.101 (1 x 65536), 0.584 vs 0.682 (16 x 32768); of 512 0.410 vs
# 0.409, 0.121 vs 0.111, 0.786 vs 0.803; of 256 the lockstep kernel on all three.
SEESAW_E4M3_KEYS = 1024


def seesaw_wanted(spec: KVCacheSpec, span: int, device: torch.device) -> bool:
    """seesaw_usable, and for an FP8 cache items of SEESAW_E4M3_KEYS keys or more (span: the longest item's), or
    any where DEEPINFER_MLA_SEESAW says "1"."""
    if not seesaw_usable(spec, device):
        return False
    return not spec.is_fp8 or span >= SEESAW_E4M3_KEYS or os.environ.get("DEEPINFER_MLA_SEESAW") == "1"


def seesaw_usable(spec: KVCacheSpec, device: torch.device) -> bool:
    """Whether a cache's 64-row tiles run on mla_seesaw_kernels (two warpgroups, FlashMLA's schedule) rather than
    mla_gluon_kernels' lockstep warpgroups (tiles aligned to cache blocks, as launch_gluon's caller makes them):
    a bf16 cache always, an FP8 one only where its blocks come by TMA (seesaw_tma_usable: its E4M3 boxes land by
    TMA alone, into the buffers they are widened in); seesaw_wanted adds the items' span. DEEPINFER_MLA_SEESAW:
    "0" keeps the lockstep kernel, "1" takes the seesaw whatever the span (A/B runs, tests)."""
    if os.environ.get("DEEPINFER_MLA_SEESAW", "1") == "0" or not gluon_gate.runs_on(device, "mla_seesaw_kernels"):
        return False
    return spec.dtype == "bf16" or (spec.dtype == "fp8_e4m3" and seesaw_tma_usable())
