"""MLA's decompressed prefill attention on cuDNN's fused SDPA (FlashAttention-3-class on Hopper): the
opt-in DEEPINFER_PREFILL_ATTENTION=cudnn path; the default is the Triton kernel (prefill_attention_kernels.py),
~20% slower on 16k-query chunks once cuDNN is warm, but with no plan to build per shape.

PyTorch routes a square causal chunk (a prompt's first) to cuDNN, which takes the value head size 128 next
to the key's 192 as it is; a later chunk needs the lower-right causal mask, which PyTorch sends to
FlashAttention-2 with values padded to 192: ~2.2x slower on the H200 (benchmarks/prefill_attention.py,
16k queries over 32k keys: 7.0 ms split on cuDNN vs 15.4 ms). So a chunk of Lq queries at the end of Ls keys
is split into a square causal block and the prefix it sees whole (no mask), both on cuDNN with their
log-sum-exps, and merged.

cuDNN builds an execution plan per shape on first use (~50 ms, up to ~1 s for the first plans of a
process), so shapes are bucketed: the prefix is cut at a bucket boundary (the keys between the cut and
the chunk join the causal block, behind as many dummy queries, so that block stays square), and block
sides and query counts are padded up to bucket multiples with zero rows whose outputs are dropped. Buckets
are 1/8 of the size's power of two (>= 256), so padding adds at most ~12% rows and a process sees ~8
distinct sizes per octave. Chunks below MIN_QUERIES stay off cuDNN (FlashAttention-2 / memory-efficient,
which build nothing): there a plan build would cost more than the attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MIN_QUERIES = 2048

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def cudnn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """[1, H, L, d] views -> (output [1, H, Lq, dv], natural-log lse [1, H, Lq] float32)."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(res[0].shape[:-1])


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Softmax-weighted sum of two attention outputs over disjoint key sets, in float32."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]


def bucket(n: int, floor: int = 256) -> int:
    """Bucket width for a size n: 1/8 of the largest power of two <= n, at least `floor`."""
    return max(floor, (1 << max(n.bit_length() - 1, 0)) // 8)


def _padded(x: torch.Tensor, rows: int, lead: int = 0) -> torch.Tensor:
    """x [L, H, d] placed at row `lead` of zeros [rows, H, d], as a [1, H, rows, d] view."""
    if lead == 0 and rows == x.shape[0]:
        return x.transpose(0, 1)[None]
    out = x.new_zeros(rows, *x.shape[1:])
    out[lead : lead + x.shape[0]] = x
    return out.transpose(0, 1)[None]


def split_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            attend: Attend = cudnn_attend, bucketed: bool = True) -> torch.Tensor:
    """Validated q [Lq, H, dk], k [Ls, H, dk], v [Ls, H, dv] (queries = the last Lq positions) -> [Lq, H, dv]."""
    lq, ls = q.shape[0], k.shape[0]
    prefix = ls - lq
    cut = prefix - prefix % bucket(prefix) if bucketed else prefix  # the prefix attended whole: keys [0, cut)
    lead = prefix - cut  # keys [cut, prefix) join the causal block, behind as many dummy queries
    side = lead + lq
    rows = -(-side // bucket(side)) * bucket(side) if bucketed else side
    out, lse = attend(_padded(q, rows, lead), _padded(k[cut:], rows), _padded(v[cut:], rows), True, scale)
    out, lse = out[:, :, lead:side], lse[:, :, lead:side]
    if cut:
        q_rows = -(-lq // bucket(lq)) * bucket(lq) if bucketed else lq
        out_p, lse_p = attend(_padded(q, q_rows), k[:cut].transpose(0, 1)[None], v[:cut].transpose(0, 1)[None],
                              False, scale)
        out = merge(out, lse, out_p[:, :, :lq], lse_p[:, :, :lq]).to(q.dtype)
    return out[0].transpose(0, 1)


def cudnn_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Shapes and dtypes cuDNN's SDPA takes (head sizes multiples of 8 up to 256, half precision), for chunks
    long enough to be worth a plan."""
    dk, dv = k.shape[-1], v.shape[-1]
    return (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and torch.backends.cudnn.is_available()
            and dk % 8 == 0 and dv % 8 == 0 and max(dk, dv) <= 256 and q.shape[0] >= MIN_QUERIES)
