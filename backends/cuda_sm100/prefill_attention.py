"""MLA's decompressed prefill attention on cuDNN's fused SDPA (FlashAttention-3-class on Hopper).

PyTorch routes a square causal chunk (a prompt's first) to cuDNN, which takes the value head size 128 next
to the key's 192 as it is; a later chunk needs the lower-right causal mask, which PyTorch sends to
FlashAttention-2 with values padded to 192: ~2.5x slower per FLOP on the H200 (benchmarks/
prefill_attention.py: 627 vs 252 TFLOPS at 16k x 16k). So a chunk of Lq queries at the end of Ls keys is
split into its own square causal block (keys Ls - Lq .. Ls) and the prefix it sees whole (keys 0 .. Ls - Lq,
no mask), both on cuDNN with their log-sum-exps, and merged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

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


def split_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            attend: Attend = cudnn_attend) -> torch.Tensor:
    """Validated q [Lq, H, dk], k [Ls, H, dk], v [Ls, H, dv] (queries = the last Lq positions) -> [Lq, H, dv]."""
    lq, ls = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    prefix = ls - lq
    out, lse = attend(qh, kh[:, :, prefix:], vh[:, :, prefix:], True, scale)
    if prefix:
        out_p, lse_p = attend(qh, kh[:, :, :prefix], vh[:, :, :prefix], False, scale)
        out = merge(out, lse, out_p, lse_p).to(q.dtype)
    return out[0].transpose(0, 1)


def cudnn_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Shapes and dtypes cuDNN's SDPA takes (head sizes multiples of 8 up to 256, half precision)."""
    dk, dv = k.shape[-1], v.shape[-1]
    return (q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and torch.backends.cudnn.is_available()
            and dk % 8 == 0 and dv % 8 == 0 and max(dk, dv) <= 256 and q.shape[0] > 0)
