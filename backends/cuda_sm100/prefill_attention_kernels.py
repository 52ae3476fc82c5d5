"""Triton flash-attention forward for MLA's decompressed prefill: compiled once per (head sizes, dtype).

q [Lq, H, dk] are the last Lq positions of a sequence with keys k [Ls, H, dk] and values v [Ls, H, dv]
(dk = nope 128 + rope 64 = 192, dv = 128 for DeepSeek); query i sees keys 0 .. Ls - Lq + i (causal, lower
right). cuDNN's SDPA is ~20% faster once warm but builds an execution plan per new shape (40 ms to over a
second on first use, which stalls serving); this kernel takes every shape with one compile (per load path
and with or without the log-sum-exp): Lq and Ls are not specialised (do_not_specialize), and the strides are
multiples of 16 for every head count at these head sizes.

Structure (Hopper, sm_90: tl.dot lowers to wgmma; the key loop's tile loads become TMA copies from host
descriptors where usable, else cp.async from pointers, either pipelined num_stages deep):
- one program per (head, block of BLOCK_M queries); the grid's fast axis is the head, and query blocks
  run last-first, so the programs with the most keys start first and the short ones fill the tail;
- the key tile is two dots accumulating into one score tile: the first D1 columns (power of two, the
  nope part) and the next D2 (the rope part), so dk = 192 costs no padding to 256. The parts may be separate
  tensors (flash_prefill's q_rope / k_rope): MLA's roped key is one per position, shared by every head, so it
  is read through a stride-0 head view instead of being copied next to each head's nope key;
- the key loop is split in two: blocks every query of the tile sees whole run without any mask, then
  the few blocks across the causal diagonal (and the sequence end) run masked;
- online softmax in float32 in the exp2 domain (qk_scale = scale * log2 e folded into one FMA with the
  running max), output normalised once at the end; optionally the natural-log log-sum-exp per query.
Strided views are taken as they are (v = kv[..., 128:] of a [Ls, H, 256] tensor): only the last stride
must be 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.prefill_attention import joined_keys

LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)

# Tiles for the DeepSeek head sizes (192 / 128, 16-bit): compiled for sm_90 with benchmarks/
# triton_sm90_report.py (8 warps, BLOCK_M 128; no spills) and timed on the H200 (benchmarks/
# prefill_attention.py --triton-alt). TMA loads, BLOCK_N 64, 3 stages: 158 registers, 169 KiB shared memory,
# 494 TFLOPS at 16k queries over 32k keys (BLOCK_N 128 / 2 stages: 208 registers, 477). The pointer path
# (cp.async, a register per address): BLOCK_N 64, 3 stages (178 registers; 128 would hit 255), 421 TFLOPS.
BLOCK_M = 128
NUM_WARPS = 8
TMA_TILE = (64, 3)  # (BLOCK_N, num_stages): 494 TFLOPS vs 477 for (128, 2) at 16k x 32k on the H200
POINTER_TILE = (64, 3)
FP32_TILE = (64, 32, 2)  # (BLOCK_M, BLOCK_N, num_stages) for 4-byte inputs (exactness, not speed): fits shared memory


@triton.jit
def _mma(x, INTERP: tl.constexpr):
    """A tl.dot operand: as is on the GPU; in float32 under the interpreter, whose 16-bit dots are wrong
    (Triton 3.6: bf16 products come out as garbage). Values are exact bf16 either way."""
    if INTERP:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _attend_block(acc, l_i, m_i, q1, q2, k_base, kr_base, v_base, stride_kn, stride_krn, stride_vn, descs, rows,
                  start, causal_off, Ls, qk_scale, D1: tl.constexpr, D2: tl.constexpr, DK2: tl.constexpr,
                  DVP: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  PREC: tl.constexpr, INTERP: tl.constexpr, TMA: tl.constexpr):
    """Key block [start, start + BLOCK_N) folded into the running (acc, l_i, m_i); MASKED: causal and
    sequence-end masks (off the hot path: only the diagonal blocks take them)."""
    offs_n = tl.arange(0, BLOCK_N)
    c1 = tl.arange(0, D1)
    cv = tl.arange(0, DVP)
    # stride_kn / stride_vn arrive as int64: start * stride overflows int32 on long sequences with many heads.
    kb = k_base + start * stride_kn
    krb = kr_base + start * stride_krn
    vb = v_base + start * stride_vn
    # Column masks exist only where a head size is not a sum of the tile widths (tests' small sizes);
    # at 192 / 128 they are compiled out.
    in_seq = (start + offs_n < Ls)[:, None]
    if TMA:
        # Tensor-memory-accelerator tiles: (descriptor k1, k2, v; the head's key, value and rope-key columns).
        # Rows past Ls come back zero, so no load masks at all.
        k1 = descs[0].load([start, descs[3]])
    elif MASKED:
        k1 = tl.load(kb + offs_n[:, None] * stride_kn + c1[None, :], mask=in_seq, other=0.0)
    else:
        k1 = tl.load(kb + offs_n[:, None] * stride_kn + c1[None, :])
    qk = tl.dot(q1, tl.trans(_mma(k1, INTERP)), input_precision=PREC)
    if D2 > 0:
        c2 = tl.arange(0, D2)
        k2_ptrs = krb + offs_n[:, None] * stride_krn + c2[None, :]
        if TMA:
            k2 = descs[1].load([start, descs[5]])
        elif MASKED:
            k2 = tl.load(k2_ptrs, mask=in_seq & (c2 < DK2)[None, :], other=0.0)
        elif D2 != DK2:
            k2 = tl.load(k2_ptrs, mask=(c2 < DK2)[None, :], other=0.0)
        else:
            k2 = tl.load(k2_ptrs)
        qk = tl.dot(q2, tl.trans(_mma(k2, INTERP)), qk, input_precision=PREC)
    if MASKED:
        visible = (start + offs_n)[None, :] <= (causal_off + rows)[:, None]
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]  # one FMA per score
    # m_new is finite for every row: each row sees key 0, and the first block a row meets (unmasked
    # phase, or the first diagonal block when that phase is empty) holds it, so no -inf - -inf.
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v_ptrs = vb + offs_n[:, None] * stride_vn + cv[None, :]
    if TMA:
        v = descs[2].load([start, descs[4]])
    elif MASKED:
        v = tl.load(v_ptrs, mask=in_seq & (cv < DV)[None, :], other=0.0)
    elif DVP != DV:
        v = tl.load(v_ptrs, mask=(cv < DV)[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(_mma(p.to(v.dtype), INTERP), _mma(v, INTERP), acc, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _attend_range(acc, l_i, m_i, q1, q2, k_base, kr_base, v_base, stride_kn, stride_krn, stride_vn, descs, rows,
                  lo, hi, causal_off, Ls, qk_scale, D1: tl.constexpr, D2: tl.constexpr, DK2: tl.constexpr,
                  DVP: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  PREC: tl.constexpr, INTERP: tl.constexpr, TMA: tl.constexpr, MAX_KEYS: tl.constexpr):
    """Key blocks [lo, hi) (lo a multiple of BLOCK_N), one after another."""
    # The interpreter cannot loop to a runtime bound (numpy 2): there a host constexpr bound (MAX_KEYS),
    # blocks outside [lo, hi) skipped. On the GPU the loop runs exactly [lo, hi) and the pipeliner sees it.
    for start in range(0 if INTERP else lo, MAX_KEYS if INTERP else hi, BLOCK_N):
        if INTERP:
            if (start >= lo) & (start < hi):
                acc, l_i, m_i = _attend_block(acc, l_i, m_i, q1, q2, k_base, kr_base, v_base, stride_kn, stride_krn,
                                              stride_vn, descs, rows, start, causal_off, Ls, qk_scale, D1, D2,
                                              DK2, DVP, DV, BLOCK_N, MASKED, PREC, INTERP, TMA)
        else:
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q1, q2, k_base, kr_base, v_base, stride_kn, stride_krn,
                                          stride_vn, descs, rows, start, causal_off, Ls, qk_scale, D1, D2, DK2,
                                          DVP, DV, BLOCK_N, MASKED, PREC, INTERP, TMA)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Lq", "Ls"])
def flash_prefill_kernel(q_ptr, qr_ptr, k_ptr, kr_ptr, v_ptr, o_ptr, lse_ptr, k1_desc, k2_desc, v_desc, Lq, Ls,
                         qk_scale, stride_qm, stride_qh, stride_qrm, stride_qrh, stride_kn, stride_kh, stride_krn,
                         stride_krh, stride_vn, stride_vh, stride_om, stride_oh, stride_lm,
                         D1: tl.constexpr, D2: tl.constexpr, DK2: tl.constexpr, DVP: tl.constexpr,
                         DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         WRITE_LSE: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
                         TMA: tl.constexpr, MAX_KEYS: tl.constexpr):
    """Program (head, query block): out[rows, head] = softmax(q k^T * scale, lower-right causal) v, the key
    in two parts: q . k over D1 columns of (q_ptr, k_ptr), plus qr . kr over DK2 (tile D2) of (qr_ptr, kr_ptr)."""
    head = tl.program_id(0)
    # Last query block first: it sees the most keys (longest program), see the module docstring.
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    m0 = m_block * BLOCK_M
    causal_off = Ls - Lq  # query i sees keys 0 .. causal_off + i
    offs_m = tl.arange(0, BLOCK_M)
    rows = m0 + offs_m
    row_ok = (rows < Lq)[:, None]
    c1 = tl.arange(0, D1)
    cv = tl.arange(0, DVP)

    q_base = q_ptr + head.to(tl.int64) * stride_qh + m0.to(tl.int64) * stride_qm
    q1 = _mma(tl.load(q_base + offs_m[:, None] * stride_qm + c1[None, :], mask=row_ok, other=0.0), INTERP)
    q2 = q1  # placeholder when the key is a single power-of-two tile (D2 == 0): never used then
    if D2 > 0:
        c2 = tl.arange(0, D2)
        qr_base = qr_ptr + head.to(tl.int64) * stride_qrh + m0.to(tl.int64) * stride_qrm
        q2 = _mma(tl.load(qr_base + offs_m[:, None] * stride_qrm + c2[None, :], mask=row_ok & (c2 < DK2)[None, :],
                          other=0.0), INTERP)
    k_base = k_ptr + head.to(tl.int64) * stride_kh
    kr_base = kr_ptr + head.to(tl.int64) * stride_krh
    v_base = v_ptr + head.to(tl.int64) * stride_vh
    stride_kn = stride_kn.to(tl.int64)
    stride_krn = stride_krn.to(tl.int64)
    stride_vn = stride_vn.to(tl.int64)
    descs = (k1_desc, k2_desc, v_desc, head * stride_kh, head * stride_vh, head * stride_krh)

    acc = tl.zeros([BLOCK_M, DVP], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Keys [0, lo) are visible to every row of the tile (row m0 sees up to causal_off + m0); keys [lo, hi)
    # cross the diagonal or the sequence end (hi: the last row's limit, at most Ls).
    lo = (causal_off + m0 + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(causal_off + m0 + BLOCK_M, Ls)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q1, q2, k_base, kr_base, v_base, stride_kn, stride_krn, stride_vn,
                                  descs, rows, 0, lo, causal_off, Ls, qk_scale, D1, D2, DK2, DVP, DV, BLOCK_N, False,
                                  PREC, INTERP, TMA, MAX_KEYS)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q1, q2, k_base, kr_base, v_base, stride_kn, stride_krn, stride_vn,
                                  descs, rows, lo, hi, causal_off, Ls, qk_scale, D1, D2, DK2, DVP, DV, BLOCK_N, True,
                                  PREC, INTERP, TMA, MAX_KEYS)

    out = acc / l_i[:, None]
    o_base = o_ptr + head.to(tl.int64) * stride_oh + m0.to(tl.int64) * stride_om
    tl.store(o_base + offs_m[:, None] * stride_om + cv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok & (cv < DV)[None, :])
    if WRITE_LSE:
        lse = (m_i + tl.math.log2(l_i)) * _LN2  # m_i is in the scaled log2 domain
        tl.store(lse_ptr + rows.to(tl.int64) * stride_lm + head, lse, mask=rows < Lq)


def split_key_dims(dk: int) -> tuple[int, int]:
    """dk -> (D1, D2): the largest power of two <= dk, and the rest rounded up to a power of two >= 16
    (tl.dot's minimum inner size); 0 when dk is a power of two. 192 -> (128, 64)."""
    d1 = 1 << (dk.bit_length() - 1)
    rest = dk - d1
    return d1, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


def _key_parts(q: torch.Tensor, k: torch.Tensor, q_rope: torch.Tensor | None, k_rope: torch.Tensor | None):
    """-> (q, k, q2, k2, D1, D2, DK2): the key's first part is the first D1 columns of q / k; the second, DK2
    columns of q2 / k2 read in a D2-wide tile. Without rope parts both come from the one tensor (split at
    split_key_dims); with them, q / k are the nope parts (D1 their width: a power of two, else they are joined)."""
    if q_rope is not None and q.shape[-1] != triton.next_power_of_2(q.shape[-1]):
        (q, k), q_rope, k_rope = joined_keys(q, k, q_rope, k_rope), None, None
    if q_rope is None:
        d1, d2 = split_key_dims(q.shape[-1])
        if d2 == 0:  # one power-of-two part: the second is never read (q, k stand in for it)
            return q, k, q, k, d1, 0, 0
        return q, k, q[..., d1:], k[..., d1:], d1, d2, q.shape[-1] - d1
    dk2 = q_rope.shape[-1]
    return q, k, q_rope, k_rope, q.shape[-1], max(16, triton.next_power_of_2(dk2)), dk2


def _descriptors(k: torch.Tensor, k2: torch.Tensor, v: torch.Tensor, d1: int, d2: int, block_n: int):
    """TMA descriptors over k, k2 and v as 2-D [L, columns of all heads] (a head = a column offset, 0 for a
    rope key every head shares; rows past the sequence read as zero)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def flat(t: torch.Tensor, block_cols: int):
        cols = (t.shape[1] - 1) * t.stride(1) + t.shape[2]
        return TensorDescriptor(t, [t.shape[0], cols], [t.stride(0), 1], [block_n, block_cols])

    return flat(k, d1), flat(k2, max(d2, 16)), flat(v, v.shape[-1])


def tma_usable(k: torch.Tensor, k2: torch.Tensor, v: torch.Tensor, d2: int) -> bool:
    """TMA needs Hopper or later (or the interpreter), 16-byte aligned bases and row strides, and head sizes
    the tiles cover exactly: a wider tile would read the next head's columns into the dots."""
    dv = v.shape[-1]
    if (d2 and k2.shape[-1] != d2) or dv != triton.next_power_of_2(dv) or dv < 16:
        return False
    if k.is_cuda and torch.cuda.get_device_capability(k.device)[0] < 9:
        return False
    read = (k, k2, v) if d2 else (k, v)
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in read)


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, return_lse: bool = False,
                  tma: bool | None = None, block_m: int = BLOCK_M, block_n: int | None = None,
                  num_warps: int = NUM_WARPS, num_stages: int | None = None, q_rope: torch.Tensor | None = None,
                  k_rope: torch.Tensor | None = None):
    """q [Lq, H, dk], k [Ls, H, dk], v [Ls, H, dv] (Lq <= Ls, last stride 1; other strides free) ->
    out [Lq, H, dv] in q's dtype, and with return_lse the natural-log log-sum-exp [Lq, H] float32.
    With q_rope [Lq, H, dr] and k_rope [Ls, H, dr] the keys are the concatenations (q | q_rope), (k | k_rope),
    read where they lie (MLA: k_rope one roped key every head shares, a stride-0 head view; nothing copied).

    Inputs are assumed validated (core/ops/prefill_attention.check_prefill_attention). tma: None = where
    usable; the tile keywords exist for benchmarking alternatives (None = the path's default tile)."""
    lq, h = q.shape[:2]
    ls, dv = k.shape[0], v.shape[-1]
    # The kernel indexes the head dimension with unit stride; anything else (never MLA's views) is copied.
    q, k, v, q_rope, k_rope = (t if t is None or t.stride(-1) == 1 else t.contiguous()
                               for t in (q, k, v, q_rope, k_rope))
    out = q.new_empty(lq, h, dv)
    lse = torch.empty(lq, h, device=q.device, dtype=torch.float32) if return_lse else out
    if lq == 0:
        return (out, lse) if return_lse else out
    q, k, q2, k2, d1, d2, dk2 = _key_parts(q, k, q_rope, k_rope)
    use_tma = tma_usable(k, k2, v, d2) if tma is None else (tma and tma_usable(k, k2, v, d2))
    tile_n, stages = TMA_TILE if use_tma else POINTER_TILE
    if q.element_size() == 4 and q.device.type == "cuda":  # twice the bytes per tile: a smaller one
        fp32_m, tile_n, stages = FP32_TILE
        block_m = min(block_m, fp32_m)
    block_n, num_stages = block_n or tile_n, num_stages or stages
    interp = q.device.type == "cpu"  # CPU tensors only run under TRITON_INTERPRET=1
    # fp32 inputs (and the interpreter's fp32 operands) get exact dots; 16-bit inputs are exact anyway.
    prec = "ieee" if q.dtype == torch.float32 or interp else "tf32"
    descs = _descriptors(k, k2, v, d1, d2, block_n) if use_tma else (None, None, None)
    flash_prefill_kernel[(h, triton.cdiv(lq, block_m))](
        q, q2, k, k2, v, out, lse, *descs, lq, ls, float(scale) * LOG2E,
        q.stride(0), q.stride(1), q2.stride(0), q2.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        D1=d1, D2=d2, DK2=dk2, DVP=triton.next_power_of_2(dv), DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        WRITE_LSE=return_lse, PREC=prec, INTERP=interp, TMA=use_tma,
        MAX_KEYS=triton.cdiv(ls, block_n) * block_n if interp else 0, num_warps=num_warps, num_stages=num_stages)
    return (out, lse) if return_lse else out
