"""Greedy decoding's argmax over the vocabulary in two small launches.

torch.argmax reduces a row in one thread block: a [1, 102400] float32 row took 23 us on the H200 (the
`e2e.py --profile-steps` timeline of a V2-Lite decode step, twentieth session), 1% of a batch-1 step. Here each
program takes one BLOCK-wide chunk of a row (max and first index), and a second launch merges a row's chunks in
chunk order. Semantics are torch.argmax's: the first index of the maximum, and a NaN counts as larger than
anything (the first NaN wins).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.pdl import enter, launch_kwargs
from deepinfer.quant import cdiv, next_pow2

BLOCK = 2048  # values a chunk: 50 programs a row for a 102400-token vocabulary
_NO_NAN = 2**31 - 1


@triton.jit
def _first_max(x, idx, NO_NAN: tl.constexpr):
    """(value, index) of x's first NaN if it has one, else of its first maximum; idx holds x's indices."""
    nan = x != x
    first_nan = tl.min(tl.where(nan, idx, NO_NAN), axis=0)
    best, at = tl.max(tl.where(nan, float("-inf"), x), axis=0, return_indices=True, return_indices_tie_break_left=True)
    best_idx = tl.sum(tl.where(tl.arange(0, x.shape[0]) == at, idx, 0), axis=0)
    has_nan = first_nan != NO_NAN
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, best_idx)


@triton.jit
def argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, CHUNKS, BLOCK: tl.constexpr, NO_NAN: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program (r, c): value and index of the first maximum of row r's columns [c * BLOCK, (c + 1) * BLOCK)."""
    enter(PDL)
    r = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    # Padding lanes read -inf and lie after the chunk's first (real) column, so they never win a tie.
    x = tl.load(x_ptr + r.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    val, idx = _first_max(x, offs, NO_NAN)
    tl.store(val_ptr + r * CHUNKS + c, val)
    tl.store(idx_ptr + r * CHUNKS + c, idx)


@triton.jit
def argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS, C_P: tl.constexpr, NO_NAN: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program r: row r's chunks merged in chunk order (the first chunk holding the maximum has its first index)."""
    enter(PDL)
    r = tl.program_id(0)
    c = tl.arange(0, C_P)
    m = c < CHUNKS
    vals = tl.load(val_ptr + r * CHUNKS + c, mask=m, other=float("-inf"))
    idxs = tl.load(idx_ptr + r * CHUNKS + c, mask=m, other=NO_NAN)
    # Chunk indices stand in for column indices: chunks are in column order, so the first wins either way.
    _, chunk = _first_max(vals, c, NO_NAN)
    tl.store(out_ptr + r, tl.sum(tl.where(c == chunk, idxs, 0), axis=0).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] float (unit column stride, V >= 1) -> int64 [R]: torch.argmax(x, -1)."""
    r, v = x.shape
    out = torch.empty(r, dtype=torch.int64, device=x.device)
    if r:
        chunks = cdiv(v, BLOCK)
        vals = torch.empty(r, chunks, dtype=torch.float32, device=x.device)
        idxs = torch.empty(r, chunks, dtype=torch.int32, device=x.device)
        argmax_chunk_kernel[(r, chunks)](x, vals, idxs, v, x.stride(0), chunks, BLOCK=BLOCK, NO_NAN=_NO_NAN,
                                         num_warps=4, **launch_kwargs())
        argmax_merge_kernel[(r,)](vals, idxs, out, chunks, C_P=max(2, next_pow2(chunks)), NO_NAN=_NO_NAN,
                                  num_warps=1, **launch_kwargs())
    return out
