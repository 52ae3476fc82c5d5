"""Triton kernels of the MoE gate and the token sort for the grouped GEMM.

_route_tokens does DeepSeek's whole gate for a block of tokens in registers: scores (sigmoid or softmax),
correction bias, group scores (sum of top-2, or max), group top-k, expert top-k, gather of the unbiased
weights, renormalisation and scaling. Experts are laid out [groups, experts per group], each padded to a
power of two, so V2's 160 experts in 8 groups of 20 work as well as V3's 256 in 8 groups of 32. route_kernel
runs it on logits in memory; gate_route_kernel computes the float32 logits itself first (few tokens).

The sort is a stable counting sort in three launches (block histograms, one-program scan, scatter with
in-block ranks): no host sync, deterministic, graph-capturable. For few pairs dispatch_small_kernel does the
same sort and the gather of the hidden rows in one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.gemm_kernels import _cast
from deepinfer.backends.cuda_sm100.pdl import enter


@triton.jit
def _route_tokens(logits_ptr, bias_ptr, w_ptr, ids_ptr, tok, T, stride_t,
                  E: tl.constexpr, EPG: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, EPG_P: tl.constexpr,
                  TOPK: tl.constexpr, SHARED: tl.constexpr, K_P: tl.constexpr, S_P: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  SOFTMAX: tl.constexpr, GROUPED: tl.constexpr, TOP2_SUM: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORM: tl.constexpr, SCALE: tl.constexpr, BT: tl.constexpr, CACHE: tl.constexpr):
    """Route tokens `tok` [BT] (rows >= T masked) from logits [T, E] in memory; writes weights and ids
    [T, TOPK + SHARED]. The SHARED columns after the routed ones are the folded shared experts E, E+1, ...:
    every token takes them with weight 1.0 (routed_scaling_factor scales only routed experts)."""
    NEG: tl.constexpr = float("-inf")
    grp = tl.arange(0, G_P)
    mem = tl.arange(0, EPG_P)
    expert = grp[:, None] * EPG + mem[None, :]  # [G_P, EPG_P]
    valid_e = (grp[:, None] < G) & (mem[None, :] < EPG)
    valid = (tok[:, None, None] < T) & valid_e[None, :, :]
    logits = tl.load(logits_ptr + tok[:, None, None].to(tl.int64) * stride_t + expert[None, :, :], mask=valid,
                     other=NEG, cache_modifier=CACHE).to(tl.float32)
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
    row = tok[:, None].to(tl.int64) * (TOPK + SHARED)
    out_mask = (tok[:, None] < T) & (kcols[None, :] < TOPK)
    tl.store(w_ptr + row + kcols[None, :], weights, mask=out_mask)
    tl.store(ids_ptr + row + kcols[None, :], ids.to(tl.int64), mask=out_mask)
    if SHARED > 0:  # their own tile: the routed weights' sum keeps its width (and rounding) whatever SHARED is
        scols = tl.arange(0, S_P)
        s_mask = (tok[:, None] < T) & (scols[None, :] < SHARED)
        s_off = row + TOPK + scols[None, :]
        tl.store(w_ptr + s_off, tl.full((BT, S_P), 1.0, tl.float32), mask=s_mask)
        tl.store(ids_ptr + s_off, (E + scols[None, :] + tl.zeros((BT, S_P), tl.int32)).to(tl.int64), mask=s_mask)


@triton.jit
def route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_t,
                 E: tl.constexpr, EPG: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, EPG_P: tl.constexpr,
                 TOPK: tl.constexpr, SHARED: tl.constexpr, K_P: tl.constexpr, S_P: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 SOFTMAX: tl.constexpr, GROUPED: tl.constexpr, TOP2_SUM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 RENORM: tl.constexpr, SCALE: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    _route_tokens(logits_ptr, bias_ptr, w_ptr, ids_ptr, tok, T, stride_t, E, EPG, G, G_P, EPG_P, TOPK, SHARED, K_P, S_P,
                  TOPK_GROUP, SOFTMAX, GROUPED, TOP2_SUM, HAS_BIAS, RENORM, SCALE, BT, "")


@triton.jit
def gate_route_kernel(x_ptr, gate_ptr, logits_ptr, ticket_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_x, sizes_ptr, rop_ptr,
                      H: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, N_EB: tl.constexpr,
                      E: tl.constexpr, EPG: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, EPG_P: tl.constexpr,
                      TOPK: tl.constexpr, SHARED: tl.constexpr, K_P: tl.constexpr, S_P: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      SOFTMAX: tl.constexpr, GROUPED: tl.constexpr, TOP2_SUM: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RENORM: tl.constexpr, SCALE: tl.constexpr, BT: tl.constexpr, LAYOUT: tl.constexpr,
                      P_P: tl.constexpr, EN_P: tl.constexpr, PDL: tl.constexpr = False):
    """The whole gate for few tokens in one launch: logits = x.float() @ gate^T, then _route_tokens.

    Program (i, j) computes token block i's float32 logits for experts [j*BE, (j+1)*BE) into `logits_ptr`
    [T, E]: the gate's rows are spread over N_EB programs so that at one token its read (512 KiB for
    V2-Lite) runs on many SMs at once. Each program then takes a ticket from ticket_ptr[i]; the one that
    draws the last ticket has seen every other program's logits (acq_rel atomic after a block barrier) and
    routes the block, then resets the ticket to 0 for the next launch. Every logit is one program's
    fixed-order sum, so the result does not depend on which program finishes last.
    LAYOUT (one token, T = 1): the routing program also writes the dispatch's contiguous layout, group sizes
    [E + SHARED] (sizes_ptr) and each pair's row (rop_ptr): its rank among the token's choices by (expert, pair),
    as the dispatch's stable sort places it (P_P, EN_P: TOPK + SHARED and E + SHARED as powers of two).
    """
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    tok = pid_t * BT + tl.arange(0, BT)
    ex = pid_e * BE + tl.arange(0, BE)
    hh = tl.arange(0, BH)
    x_rows = x_ptr + tok[:, None].to(tl.int64) * stride_x
    g_rows = gate_ptr + ex[:, None].to(tl.int64) * H
    # The router weight's first BH columns load before the PDL wait: no kernel of the step writes them, so their
    # read overlaps the previous kernel's tail (at one token BH is all of H on V2-Lite, 4096 of 7168 on V3).
    gv = tl.load(g_rows + hh[None, :], mask=(ex[:, None] < E) & (hh[None, :] < H), other=0.0).to(tl.float32)
    enter(PDL)
    xv = tl.load(x_rows + hh[None, :], mask=(tok[:, None] < T) & (hh[None, :] < H), other=0.0).to(tl.float32)
    acc = xv[:, None, :] * gv[None, :, :]
    for h0 in range(BH, H, BH):
        h = h0 + hh
        xv = tl.load(x_rows + h[None, :], mask=(tok[:, None] < T) & (h[None, :] < H), other=0.0).to(tl.float32)
        gv = tl.load(g_rows + h[None, :], mask=(ex[:, None] < E) & (h[None, :] < H), other=0.0).to(tl.float32)
        acc += xv[:, None, :] * gv[None, :, :]
    logits = tl.sum(acc, axis=2)
    tl.store(logits_ptr + tok[:, None].to(tl.int64) * E + ex[None, :], logits,
             mask=(tok[:, None] < T) & (ex[None, :] < E))
    tl.debug_barrier()  # every thread's logits are written before the ticket releases them
    ticket = tl.atomic_add(ticket_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
    if ticket == N_EB - 1:
        # ".cg": read the other programs' logits from L2, never from this SM's (incoherent) L1
        _route_tokens(logits_ptr, bias_ptr, w_ptr, ids_ptr, tok, T, E, E, EPG, G, G_P, EPG_P, TOPK, SHARED, K_P, S_P,
                      TOPK_GROUP, SOFTMAX, GROUPED, TOP2_SUM, HAS_BIAS, RENORM, SCALE, BT, ".cg")
        if LAYOUT:
            tl.debug_barrier()  # the ids this program's threads just wrote
            j = tl.arange(0, P_P)
            pm = j < TOPK + SHARED
            e = tl.load(ids_ptr + j, mask=pm, other=0).to(tl.int32)
            before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (j[None, :] < j[:, None]))
            tl.store(rop_ptr + j, tl.sum((before & pm[None, :]).to(tl.int32), axis=1), mask=pm)  # the stable sort's
            cols = tl.arange(0, EN_P)
            hist = tl.sum(((cols[:, None] == e[None, :]) & pm[None, :]).to(tl.int64), axis=1)
            tl.store(sizes_ptr + cols, hist, mask=cols < E + SHARED)
        tl.atomic_xchg(ticket_ptr + pid_t, 0, sem="relaxed", scope="gpu")


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
def expert_pairs(row_ptr, w_ptr, toks, live, K: tl.constexpr):
    """Tokens `toks`' (where `live`) K choices from rows / weights [T, K] (contiguous): two K-tuples of [BT]
    vectors, each pair's expert row (int64; -1 for a dropped pair) and its float32 weight."""
    toks64 = toks.to(tl.int64)
    rows = ()
    weights = ()
    for j in tl.static_range(K):
        rows = rows + (tl.load(row_ptr + toks64 * K + j, mask=live, other=-1).to(tl.int64),)
        weights = weights + (tl.load(w_ptr + toks64 * K + j, mask=live, other=0.0).to(tl.float32),)
    return rows, weights


@triton.jit
def weighted_rows_sum(y_ptr, pair_rows, pair_weights, acc, cols, mask, stride_y, K: tl.constexpr):
    """acc [BT, BH] float32 (zeros, or the shared experts' output) + sum_j w_j * y[row_j] over the choices of
    expert_pairs, for columns `cols` [BH] (0 where not `mask`); a row < 0 adds nothing. The sum
    is the same wherever it is formed (combine_kernel, or the norm after the MoE): the choices in order, each a
    fused multiply-add whatever the kernel's fp-fusion setting. y must have a row 0 (gatherable_rows)."""
    for j in tl.static_range(K):
        r = pair_rows[j]
        # One mask for every choice's load, so the loads share one predicate (a dropped pair reads row 0, then
        # drops it).
        v = tl.load(y_ptr + tl.maximum(r, 0)[:, None] * stride_y + cols[None, :], mask=mask, other=0.0)
        acc = tl.fma(pair_weights[j][:, None], tl.where(r[:, None] >= 0, v.to(tl.float32), 0.0), acc)
    return acc


def gatherable_rows(y):
    """y [R, H] as weighted_rows_sum may read it: itself, or one zero row when it has none (every pair is then
    dropped, and a dropped pair still reads row 0)."""
    return y if y.shape[0] else y.new_zeros(1, y.shape[1])


@triton.jit
def combine_kernel(y_ptr, row_ptr, w_ptr, out_ptr, add_ptr, T, H, stride_y, stride_o, stride_a, K: tl.constexpr,
                   BT: tl.constexpr, BH: tl.constexpr, ADD: tl.constexpr, EXACT: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    """out[t] = add[t] (ADD: the shared experts' output) + sum_j w[t, j] * y[row[t, j]] (weighted_rows_sum), one
    program per (BT tokens, column block): the gather, weighting and reduction of a local MoE combine in one launch."""
    enter(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = (cols < H)[None, :] & (t < T)[:, None]
    if ADD:
        acc = tl.load(add_ptr + t.to(tl.int64)[:, None] * stride_a + cols[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BT, BH], dtype=tl.float32)
    pair_rows, pair_weights = expert_pairs(row_ptr, w_ptr, t, t < T, K)
    acc = weighted_rows_sum(y_ptr, pair_rows, pair_weights, acc, cols, m, stride_y, K)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_o + cols[None, :], _cast(acc, out_ptr.dtype.element_ty, EXACT),
             mask=m)


@triton.jit
def dispatch_small_kernel(ids_ptr, x_ptr, rows_ptr, sizes_ptr, row_of_pair_ptr, P, stride_x, stride_r,
                          E: tl.constexpr, E_P: tl.constexpr, TOPK: tl.constexpr, H: tl.constexpr,
                          BP: tl.constexpr, HB: tl.constexpr, BH: tl.constexpr, CH: tl.constexpr, P_C: tl.constexpr,
                          PDL: tl.constexpr = False):
    """A local dispatch for few pairs in one launch: the stable counting sort of sort_*_kernel (contiguous
    layout) and the gather of the hidden rows.

    Program (b, c) re-counts all P pairs (P is small: a few KiB of ids from L2), which gives it the group
    starts and the pairs of earlier blocks per expert with no inter-program communication; it then places
    pairs [b*BP, (b+1)*BP) (rank among equal experts in the block, as sort_scatter_kernel) and copies their
    hidden columns [c*HB, (c+1)*HB). Column block 0 writes row_of_pair; program (0, 0) the group sizes.
    P_C: P as a constexpr under the interpreter (whose loops need a Python int bound), else -1.
    """
    enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    first_pair = b * BP
    cols = tl.arange(0, E_P)
    total = tl.zeros((E_P,), dtype=tl.int32)
    before = tl.zeros((E_P,), dtype=tl.int32)
    for c0 in range(0, P_C if P_C >= 0 else P, CH):
        offs = c0 + tl.arange(0, CH)
        m = offs < P
        e = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
        ok = m & (e >= 0) & (e < E)
        e = tl.where(ok, e, 0)
        total += tl.histogram(e, E_P, mask=ok)
        before += tl.histogram(e, E_P, mask=ok & (offs < first_pair))
    start = tl.cumsum(total, 0) - total + before  # first row of this block's pairs, per expert

    i = tl.arange(0, BP)
    offs = first_pair + i
    m = offs < P
    e = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
    ok = m & (e >= 0) & (e < E)
    e = tl.where(ok, e, -1)
    rank = tl.sum(((e[:, None] == e[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    row = tl.gather(start, tl.where(ok, e, 0), 0) + rank
    if c == 0:
        tl.store(row_of_pair_ptr + offs, tl.where(ok, row, -1), mask=m)
        if b == 0:
            tl.store(sizes_ptr + cols, total.to(tl.int64), mask=cols < E)
    src = (offs // TOPK).to(tl.int64) * stride_x
    dst = row.to(tl.int64) * stride_r
    for h0 in range(0, HB, BH):
        h = c * HB + h0 + tl.arange(0, BH)
        mask = ok[:, None] & (h[None, :] < H)
        v = tl.load(x_ptr + src[:, None] + h[None, :], mask=mask)
        tl.store(rows_ptr + dst[:, None] + h[None, :], v, mask=mask)
