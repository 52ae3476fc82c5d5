"""Triton kernel of the expert-parallel dispatch's send side with fixed-size buffers (ep_comm).

ep_pack_kernel does in one launch what takes ~20 small torch ops: for each token and rank, whether the token
chose any of that rank's experts; its slot among the rank's `cap` rows (a running count over tokens); the copy
of its hidden row there; its routing after the row (the k choices as that rank's local expert ids, -1 for
another rank's, and their weights, 0 there); and, for the slots no token fills, routing of ids -1 alone, so the
receiver knows them empty without a count.

Program (b, c) counts, per rank, the tokens before its block that go there (all T tokens' ids are re-read: T is
at most a few thousand on this path, and the ids come from L2), places tokens [b*BT, (b+1)*BT), and copies their
hidden columns [c*HB, (c+1)*HB). Column block 0 writes the routing and the bookkeeping for combine; the last
token block's column block 0 marks the unused slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.pdl import enter


@triton.jit
def _owners_sent(ids_ptr, toks, T, L: tl.constexpr, W: tl.constexpr, W_P: tl.constexpr, K: tl.constexpr,
                 K_P: tl.constexpr):
    """(ids [BT, K_P] int32, sent [BT, W_P] bool) for tokens `toks`: sent[t, r] when a choice of t is rank r's."""
    kk = tl.arange(0, K_P)
    ranks = tl.arange(0, W_P)
    m = (toks[:, None] < T) & (kk[None, :] < K)
    ids = tl.load(ids_ptr + toks[:, None] * K + kk[None, :], mask=m, other=W * L).to(tl.int32)
    owner = ids // L  # W (matching no rank) where masked
    sent = tl.max((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1) > 0
    return ids, sent


@triton.jit
def ep_pack_kernel(ids_ptr, w_ptr, x_ptr, buf_ptr, meta_ptr, send_row_ptr, sent_ptr,
                   T, cap, stride_x, stride_buf, stride_meta,
                   META_OFF: tl.constexpr, L: tl.constexpr, W: tl.constexpr, W_P: tl.constexpr, K: tl.constexpr,
                   K_P: tl.constexpr, H: tl.constexpr, BT: tl.constexpr, CT: tl.constexpr, HB: tl.constexpr,
                   BH: tl.constexpr, CS: tl.constexpr, T_C: tl.constexpr, CAP_C: tl.constexpr,
                   PDL: tl.constexpr = False):
    """ids, w: [T, K] (contiguous); x [T, H]; buf: [W * cap, *] in x's dtype, hidden in columns [0, H);
    meta: the same memory as float32, routing at columns META_OFF + [0, K) (ids) and + [K, 2K) (weights);
    send_row [T, W] int32 (slot, or -1); sent [T, W] float32 (1 where sent).
    T_C / CAP_C: T and cap as constexprs under the interpreter (whose loops need Python int bounds), else -1."""
    enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    first = b * BT
    ranks = tl.arange(0, W_P)
    total = tl.zeros((W_P,), dtype=tl.int32)
    before = tl.zeros((W_P,), dtype=tl.int32)
    for t0 in range(0, T_C if T_C >= 0 else T, CT):
        toks = t0 + tl.arange(0, CT)
        _, sent = _owners_sent(ids_ptr, toks, T, L, W, W_P, K, K_P)
        s = sent.to(tl.int32)
        total += tl.sum(s, axis=0)
        before += tl.sum(s * (toks < first).to(tl.int32)[:, None], axis=0)

    toks = first + tl.arange(0, BT)
    ids, sent = _owners_sent(ids_ptr, toks, T, L, W, W_P, K, K_P)
    s = sent.to(tl.int32)
    # tokens of this block before each token, per rank: a triangular sum (tl.cumsum over [BT, W_P] trips an
    # assertion in Triton 3.6's scan lowering at some widths, e.g. W_P 2 with K 8)
    earlier = (tl.arange(0, BT)[None, :] < tl.arange(0, BT)[:, None]).to(tl.int32)  # [BT, BT]: u < t
    slot = ranks[None, :] * cap + before[None, :] + tl.sum(earlier[:, :, None] * s[None, :, :], axis=1)  # [BT, W_P]
    live = sent & (ranks[None, :] < W)
    if c == 0:
        tw = toks[:, None] * W + ranks[None, :]
        tw_m = (toks[:, None] < T) & (ranks[None, :] < W)
        tl.store(send_row_ptr + tw, tl.where(live, slot, -1), mask=tw_m)
        tl.store(sent_ptr + tw, live.to(tl.float32), mask=tw_m)
        kk = tl.arange(0, K_P)
        wts = tl.load(w_ptr + toks[:, None] * K + kk[None, :], mask=(toks[:, None] < T) & (kk[None, :] < K), other=0.0)
        mine = (ids // L)[:, None, :] == ranks[None, :, None]  # [BT, W_P, K_P]
        lid = tl.where(mine, ids[:, None, :] - ranks[None, :, None] * L, -1).to(tl.float32)
        wt = tl.where(mine, wts.to(tl.float32)[:, None, :], 0.0)
        at = meta_ptr + slot.to(tl.int64)[:, :, None] * stride_meta + META_OFF + kk[None, None, :]
        m3 = live[:, :, None] & (kk[None, None, :] < K)
        tl.store(at, lid, mask=m3)
        tl.store(at + K, wt, mask=m3)
        if first + BT >= T:  # the last token block: routing "empty" in every slot no token took
            for s0 in range(0, CAP_C if CAP_C >= 0 else cap, CS):
                sl = s0 + tl.arange(0, CS)
                unused = (sl[None, :] >= total[:, None]) & (sl[None, :] < cap) & (ranks[:, None] < W)  # [W_P, CS]
                row = (ranks[:, None] * cap + sl[None, :]).to(tl.int64) * stride_meta + META_OFF
                for j in tl.static_range(K):
                    tl.store(meta_ptr + row + j, tl.full((W_P, CS), -1.0, tl.float32), mask=unused)
                    tl.store(meta_ptr + row + K + j, tl.zeros((W_P, CS), tl.float32), mask=unused)

    src = toks.to(tl.int64) * stride_x
    for h0 in range(0, HB, BH):
        h = c * HB + h0 + tl.arange(0, BH)
        hm = h < H
        v = tl.load(x_ptr + src[:, None] + h[None, :], mask=(toks[:, None] < T) & hm[None, :])
        for r in tl.static_range(W):
            dst = tl.sum(tl.where(ranks[None, :] == r, slot, 0), axis=1).to(tl.int64) * stride_buf
            on = tl.sum(tl.where(ranks[None, :] == r, s, 0), axis=1) > 0
            tl.store(buf_ptr + dst[:, None] + h[None, :], v, mask=on[:, None] & hm[None, :])
