"""Launchers of the decode-step GEMV (gemv_kernels.py), and when each takes a call: one row of a batch-1 step
(gemm.linear), one decode token's rows sorted by expert (gemm.grouped_linear / gate_up_silu, 16-bit experts),
and each head's row with its own matrix (gemm.per_head_linear, MLA's absorbed projections). gemm.py asks the
*_usable predicates first and keeps every other call on the GEMM tile or cuBLAS. DEEPINFER_GEMV=0 turns the
GEMV off (A/B runs); batch-invariant mode never takes it (a row's sums must not depend on the batch's size).
"""

from __future__ import annotations

import os

import torch

from deepinfer import quant
from deepinfer.backends.cuda_sm100 import triton_interpreter_requested
from deepinfer.backends.cuda_sm100.pdl import early_trigger, launch_kwargs
from deepinfer.quant import cdiv, next_pow2
from deepinfer.weights import LinearWeight, WeightFormat

# (rows a program, K step, warps) of an E4M3 gate/up's grouped GEMV: the best of gemm_decode.py --sweep (H200,
# V2-Lite batch 1: 18.4 us, the GEMM tile 18.0 plus its quantiser launch; the default 8 x 2048 took 23.3).
FP8_GATED_TILES = (16, 512, 4)
# Rows sorted by expert that the grouped GEMV takes (one decode token's routed and shared experts: V2-Lite 8, V3 9),
# each row reading its expert's weight; more rows share experts, and the GEMM tile reads a weight once for them.
GEMV_GROUPED_MAX_ROWS = 16


def _operands_ok(data: torch.Tensor, x_fp8: bool, weight: LinearWeight) -> bool:
    """Formats the GEMV computes: a dense 16-bit weight with rows of its dtype, or an fp8_block weight with rows of
    any float dtype (quantised in the kernel exactly as quant.Fp8Activations made ahead would be, so both give the
    same bits) or already E4M3 (x_fp8); every operand with unit column stride, on a GPU."""
    w = weight.data
    if os.environ.get("DEEPINFER_GEMV", "1") == "0" or not data.is_cuda or data.stride(-1) != 1 or w.stride(-1) != 1:
        return False
    if weight.format is WeightFormat.DENSE:
        return not x_fp8 and data.dtype == w.dtype and data.dtype in (torch.bfloat16, torch.float16)
    # The kernel steps along a row of block scales with unit stride.
    return weight.format is WeightFormat.FP8_BLOCK and weight.scale.stride(-1) == 1


def gemv_usable(x, weight: LinearWeight, batch_invariant: bool = False) -> bool:
    """Whether gemv() takes x @ W^T: one row (batch-1 decode) of a 2-D weight in a format _operands_ok takes.
    DEEPINFER_GEMV=0 keeps those rows on cuBLAS / the GEMM tile (A/B runs); batch-invariant mode keeps the tile (a
    row's sums must not depend on the batch's size)."""
    x_fp8 = isinstance(x, quant.Fp8Activations)
    data = x.data if x_fp8 else x
    return (not batch_invariant and weight.data.dim() == 2 and data.numel() == weight.in_features
            and _operands_ok(data, x_fp8, weight))


def gemv_grouped_fits(x: torch.Tensor, weight: LinearWeight, x_scale: torch.Tensor | None = None) -> bool:
    """Whether gemv_grouped() can take rows x [M, K] sorted by group: at most GEMV_GROUPED_MAX_ROWS of them, a
    contiguous [G, N, K] weight in a format _operands_ok takes."""
    x_fp8 = x_scale is not None and x.dtype == quant.FP8_DTYPE
    return (0 < x.shape[0] <= GEMV_GROUPED_MAX_ROWS and weight.data.dim() == 3 and weight.data.is_contiguous()
            and _operands_ok(x, x_fp8, weight))


def gemv_grouped_usable(x: torch.Tensor, weight: LinearWeight, x_scale: torch.Tensor | None = None,
                        gated: bool = False) -> bool:
    """Whether grouped_linear / gate_up_silu route rows x to gemv_grouped(): gemv_grouped_fits, with 16-bit
    weights; E4M3 ones only for a gated gate/up of 16-bit rows (quantised in the kernel: no quantiser launch,
    and x is then the norm's output, which lets a token's shared-expert rows run before the wait), on
    FP8_GATED_TILES. Other E4M3 experts go to gemm._launch (the weights-as-M kernel for a decode step's rows), which
    the GEMV lost to (H200, V2-Lite batch 1, gemm_decode.py --sweep: down 13.4 us at the GEMV's best tile against
    the GEMM tile's 11.7)."""
    e4m3_gate_up = gated and x.dtype in (torch.bfloat16, torch.float16)
    takes = weight.format is WeightFormat.DENSE or (weight.format is WeightFormat.FP8_BLOCK and e4m3_gate_up)
    return takes and gemv_grouped_fits(x, weight, x_scale)


def default_tiles(weight: LinearWeight, k: int, bn: int | None, bk: int | None, warps: int | None,
                  expert_gate_up: bool = False) -> tuple[int, int, int]:
    """(rows a program, K step, warps). Default: 8 weight rows, 16 KiB of weight a row group a step (1024 16-bit or
    2048 E4M3 columns), 64 weight values a thread; where that step pads K by more than an eighth (the last step
    mostly masked), half the step and twice the rows, keeping the values a thread. H200, gemm_decode.py --sweep,
    V2-Lite at batch 1, us: bf16 q/kv_a 5.8 (cuBLAS 8.1), o_proj 4.5 (7.3), lm_head 98 (109); FP8 q/kv_a 4.9 and
    o_proj 3.5, against 8.5 and 7.7 for the GEMM tile with its quantiser; bf16 experts' down (K = 1408) 14.8 at
    16 x 512 against 17.1 at 8 x 1024. expert_gate_up (a grouped, gated call): E4M3 weights take FP8_GATED_TILES
    where no tile is given."""
    if expert_gate_up and weight.format is WeightFormat.FP8_BLOCK and bn is None and bk is None and warps is None:
        bn, bk, warps = FP8_GATED_TILES
    fit = max(128, next_pow2(k))  # no step wider than K's power of two
    if bk is None:
        widest = min(2048 // weight.data.element_size(), fit)
        steps = [widest >> i for i in range(4) if widest >> i >= 256] or [widest]
        padded = [cdiv(k, step) * step for step in steps]
        bk = next((step for step, p in zip(steps, padded) if p * 7 <= k * 8), steps[padded.index(min(padded))])
        bn = bn or 8 * widest // bk
    bn, bk = bn or 8, min(bk, fit)
    return bn, bk, warps or max(1, min(8, bn * bk // 2048))


def _launch(data, xs, weight: LinearWeight, out, n: int, rows: int, sizes, x_fp8: bool, gated: bool,
            tiles: tuple[int, int, int], sizes_early: bool = False, tail: int = 0, early: bool = False) -> None:
    from deepinfer.backends.cuda_sm100 import gemv_kernels as V

    bn, bk, warps = tiles
    w = weight.data
    w_fp8 = weight.format is WeightFormat.FP8_BLOCK
    ws = weight.scale if w_fp8 else w  # (any pointer when unread)
    grouped = sizes is not None  # else a 3-D weight is one matrix a row (per head), a 2-D one every row's
    stacked = w.dim() == 3
    groups = w.shape[0] if stacked else 1
    pdl = bool(launch_kwargs())
    tail = tail if grouped else 0
    grid = (cdiv(n, bn), rows) if tail else (rows, cdiv(n, bn))
    V.gemv_kernel[grid](
        data, xs, w, ws, out, sizes if grouped else out, rows, n, groups, data.stride(0), xs.stride(0), xs.stride(-1),
        w.stride(0) if stacked else 0, w.stride(-2), ws.stride(0) if stacked else 0, ws.stride(-2), out.stride(0),
        K=weight.in_features, BN=bn, BK=bk, W_FP8=w_fp8, X_FP8=x_fp8, GROUPED=grouped, G_P=next_pow2(groups),
        GATED=gated, EXACT=triton_interpreter_requested(), SIZES_EARLY=grouped and sizes_early and pdl, TAIL=tail,
        EARLY=early and pdl, num_warps=warps, **launch_kwargs())


def gemv(x, weight: LinearWeight, gated: bool = False, bn: int | None = None, bk: int | None = None,
         warps: int | None = None) -> torch.Tensor:
    """x [..., K] (one row) @ W^T -> [..., N] on gemv_kernels (fp32 sums), for gemv_usable() calls; a 16-bit x
    meeting an fp8_block weight is quantised in the kernel, as the GEMM path would. gated: W is [gate; up] and the
    output silu(gate) * up [..., N / 2], as gate_up_silu computes it. Tiles: default_tiles."""
    x_fp8 = isinstance(x, quant.Fp8Activations)
    data = x.data if x_fp8 else x
    k = weight.in_features
    n = weight.out_features // 2 if gated else weight.out_features
    out = torch.empty(*data.shape[:-1], n, dtype=x.dtype if x_fp8 else data.dtype, device=data.device)
    _launch(data.reshape(1, k), x.scale if x_fp8 else data.reshape(1, k), weight, out.reshape(1, n), n, 1, None,
            x_fp8, gated, default_tiles(weight, k, bn, bk, warps))
    return out


def gemv_grouped(x: torch.Tensor, weight: LinearWeight, group_sizes: torch.Tensor, x_scale: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, gated: bool = False, bn: int | None = None,
                 bk: int | None = None, warps: int | None = None, sizes_early: bool = False,
                 settled_tail: int = 0) -> torch.Tensor:
    """Rows x [M, K] sorted by group (group_sizes [G] on the device) times their groups' weights [G, N_w, K], each
    row its own pass over its group's weight: for gemv_grouped_usable() calls. gated: the weight is [gate; up]
    and the output silu(gate) * up [M, N_w / 2], as gate_up_silu computes it (tiles: default_tiles'). x may be
    E4M3 with x_scale.
    sizes_early (Backend.grouped_linear's sizes_settled): under PDL each program reads the sizes (from L2) and
    loads its first weight slab before waiting for the previous kernel. H200, V2-Lite bf16 batch 1 (down
    projection): e2e 466.5 / 466.6 -> 471.9 / 470.3 tok/s. settled_tail (Backend.gated_linear's): under PDL the
    programs of the last settled_tail rows, one row each of the last groups, are scheduled first and compute
    before the wait."""
    x_fp8 = x_scale is not None and x.dtype == quant.FP8_DTYPE
    m, k = x.shape
    n = weight.out_features // 2 if gated else weight.out_features
    out = torch.empty(m, n, dtype=out_dtype or (torch.bfloat16 if x_fp8 else x.dtype), device=x.device)
    _launch(x, x_scale if x_fp8 else x, weight, out, n, m, group_sizes, x_fp8, gated,
            default_tiles(weight, k, bn, bk, warps, expert_gate_up=gated), sizes_early,
            min(settled_tail, m, weight.data.shape[0]))
    return out


def gemv_per_head_usable(x: torch.Tensor, weight: LinearWeight, batch_invariant: bool = False) -> bool:
    """Whether per_head_linear takes x [T, H, K] on gemv_per_head(): one token (batch-1 decode), a contiguous
    stacked [H, N, K] 16-bit weight of x's dtype."""
    return (not batch_invariant and x.shape[0] == 1 and weight.data.dim() == 3 and weight.data.is_contiguous()
            and _operands_ok(x, False, weight))


def gemv_per_head(x: torch.Tensor, weight: LinearWeight, bn: int | None = None, bk: int | None = None,
                  warps: int | None = None) -> torch.Tensor:
    """x [1, H, K] (any head stride, unit column stride) @ weight[h]^T per head -> [1, H, N]: each head's row its
    own pass over its matrix, for gemv_per_head_usable() calls. Tiles: default_tiles."""
    _, h, k = x.shape
    n = weight.out_features
    out = torch.empty(1, h, n, dtype=x.dtype, device=x.device)
    # its successors (attention, o_proj) read only weights and the plan before their wait: pdl.py's EARLY
    _launch(x[0], x[0], weight, out[0], n, h, None, False, False, default_tiles(weight, k, bn, bk, warps),
            early=early_trigger())
    return out
