"""Triton kernels of the MoE gate and the token sort for the grouped GEMM.

route_kernel does DeepSeek's whole gate for a block of tokens in registers: scores (sigmoid or softmax),
correction bias, group scores (sum of top-2, or max), group top-k, expert top-k, gather of the unbiased
weights, renormalisation and scaling. Experts are laid out [groups, experts per group], each padded to a
power of two, so V2's 160 experts in 8 groups of 20 work as well as V3's 256 in 8 groups of 32.

The sort is a stable counting sort in three launches (block histograms, one-program scan, scatter with
in-block ranks): no host sync, deterministic, graph-capturable.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_t,
                 E: tl.constexpr, EPG: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, EPG_P: tl.constexpr,
                 TOPK: tl.constexpr, K_P: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 SOFTMAX: tl.constexpr, GROUPED: tl.constexpr, TOP2_SUM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 RENORM: tl.constexpr, SCALE: tl.constexpr, BT: tl.constexpr):
    NEG: tl.constexpr = float("-inf")
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    grp = tl.arange(0, G_P)
    mem = tl.arange(0, EPG_P)
    expert = grp[:, None] * EPG + mem[None, :]  # [G_P, EPG_P]
    valid_e = (grp[:, None] < G) & (mem[None, :] < EPG)
    valid = (tok[:, None, None] < T) & valid_e[None, :, :]
    logits = tl.load(logits_ptr + tok[:, None, None].to(tl.int64) * stride_t + expert[None, :, :], mask=valid,
                     other=NEG).to(tl.float32)
    if SOFTMAX:
        mx = tl.max(tl.max(logits, axis=2), axis=1)
        mx = tl.where(tok < T, mx, 0.0)  # rows past T are all -inf
        ex = tl.where(valid, tl.exp(tl.where(valid, logits - mx[:, None, None], 0.0)), 0.0)
        den = tl.where(tok < T, tl.sum(tl.sum(ex, axis=2), axis=1), 1.0)
        scores = ex / den[:, None, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert, mask=valid_e, other=0.0).to(tl.float32)
        choice = scores + bias[None, :, :]
    choice = tl.where(valid, choice, NEG)

    if GROUPED:
        best = tl.max(choice, axis=2)  # [BT, G_P]
        if TOP2_SUM:
            first = tl.argmax(choice, axis=2)
            rest = tl.where(mem[None, None, :] == first[:, :, None], NEG, choice)
            gscore = best + tl.max(rest, axis=2)
        else:
            gscore = best
        gscore = tl.where(grp[None, :] < G, gscore, NEG)
        keep = grp[None, :] < 0  # all False, [1, G_P] broadcast below
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(gscore, axis=1)
            hit = grp[None, :] == pick[:, None]
            keep = keep | hit
            gscore = tl.where(hit, NEG, gscore)
        choice = tl.where(keep[:, :, None], choice, NEG)

    EP: tl.constexpr = G_P * EPG_P
    flat = tl.reshape(choice, (BT, EP))
    flat_scores = tl.reshape(scores, (BT, EP))
    cols = tl.arange(0, EP)
    kcols = tl.arange(0, K_P)
    weights = tl.zeros((BT, K_P), dtype=tl.float32)
    ids = tl.zeros((BT, K_P), dtype=tl.int32)
    for i in tl.static_range(TOPK):
        pos = tl.argmax(flat, axis=1)
        hit = cols[None, :] == pos[:, None]
        w = tl.sum(tl.where(hit, flat_scores, 0.0), axis=1)
        flat = tl.where(hit, NEG, flat)
        eid = (pos // EPG_P) * EPG + pos % EPG_P
        weights = tl.where(kcols[None, :] == i, w[:, None], weights)
        ids = tl.where(kcols[None, :] == i, eid[:, None], ids)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * SCALE
    out_mask = (tok[:, None] < T) & (kcols[None, :] < TOPK)
    out_off = tok[:, None].to(tl.int64) * TOPK + kcols[None, :]
    tl.store(w_ptr + out_off, weights, mask=out_mask)
    tl.store(ids_ptr + out_off, ids.to(tl.int64), mask=out_mask)


@triton.jit
def sort_hist_kernel(ids_ptr, hist_ptr, P, E, E_P: tl.constexpr, BP: tl.constexpr):
    """hist[b, e] = pairs of block b routed to expert e."""
    b = tl.program_id(0)
    offs = b * BP + tl.arange(0, BP)
    mask = offs < P
    e = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    ok = mask & (e >= 0) & (e < E)
    counts = tl.histogram(tl.where(ok, e, 0), E_P, mask=ok)
    tl.store(hist_ptr + b * E_P + tl.arange(0, E_P), counts)


@triton.jit
def sort_scan_kernel(hist_ptr, base_ptr, sizes_ptr, NB, E, cap, E_P: tl.constexpr, RB: tl.constexpr,
                     MASKED: tl.constexpr, NB_C: tl.constexpr):
    """One program: group sizes, and base[b, e] = first slot of block b's expert-e pairs.

    NB_C: NB as a constexpr under the interpreter (whose loops need a Python int bound), else 0.
    """
    cols = tl.arange(0, E_P)
    rows = tl.arange(0, RB)
    total = tl.zeros((E_P,), dtype=tl.int32)
    for r0 in range(0, NB_C if NB_C > 0 else NB, RB):
        h = tl.load(hist_ptr + (r0 + rows)[:, None] * E_P + cols[None, :], mask=(r0 + rows)[:, None] < NB, other=0)
        total += tl.sum(h, axis=0)
    tl.store(sizes_ptr + cols, total.to(tl.int64), mask=cols < E)
    if MASKED:
        run = cols * cap
    else:
        run = tl.cumsum(total, 0) - total
    for r0 in range(0, NB_C if NB_C > 0 else NB, RB):
        rmask = (r0 + rows)[:, None] < NB
        h = tl.load(hist_ptr + (r0 + rows)[:, None] * E_P + cols[None, :], mask=rmask, other=0)
        excl = tl.cumsum(h, 0) - h
        tl.store(base_ptr + (r0 + rows)[:, None] * E_P + cols[None, :], run[None, :] + excl, mask=rmask)
        run += tl.sum(h, axis=0)


@triton.jit
def sort_scatter_kernel(ids_ptr, base_ptr, slot_ptr, pair_ptr, P, E, cap, E_P: tl.constexpr, BP: tl.constexpr,
                        MASKED: tl.constexpr):
    """slot_of_pair[p] = destination row of pair p (-1 if dropped); pair_of_slot[slot] = p."""
    b = tl.program_id(0)
    i = tl.arange(0, BP)
    offs = b * BP + i
    mask = offs < P
    e = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    ok = mask & (e >= 0) & (e < E)
    e = tl.where(ok, e, -1)
    earlier = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(base_ptr + b * E_P + e, mask=ok, other=0)
    slot = base + rank
    if MASKED:
        ok = ok & (slot - e * cap < cap)
    tl.store(slot_ptr + offs, tl.where(ok, slot, -1), mask=mask)
    tl.store(pair_ptr + slot, offs, mask=ok)


@triton.jit
def combine_kernel(y_ptr, row_ptr, w_ptr, out_ptr, H, stride_y, stride_o, K: tl.constexpr, BH: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[row[t, j]] in float32, one program per (token, column block): the gather,
    weighting and reduction of a local MoE combine in one launch. row < 0 (dropped pair) adds nothing."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = cols < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(row_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        v = tl.load(y_ptr + r * stride_y + cols, mask=m & (r >= 0), other=0.0).to(tl.float32)
        acc += w * v
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=m)
