"""Dense causal attention of a chunk of new queries over their whole sequence (MLA's decompressed prefill).

q [Lq, H, dk] are the last Lq positions of a sequence whose keys k [Ls, H, dk] and values v [Ls, H, dv]
are all given (Lq <= Ls): query i sees keys 0 .. Ls - Lq + i (causal, aligned to the lower right). MLA's
key and value head sizes differ (nope + rope = 192, v = 128).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError


def check_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None) -> None:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, shape=[None, q.shape[1], q.shape[2]], dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=3, shape=[k.shape[0], q.shape[1], None], dtypes=(q.dtype,), device=q.device)
    if (q_rope is None) != (k_rope is None):
        raise InvalidInputError("q_rope and k_rope come together: the key's second part needs both sides")
    if q_rope is not None:
        check_tensor("q_rope", q_rope, ndim=3, shape=[q.shape[0], q.shape[1], None], dtypes=(q.dtype,), device=q.device)
        check_tensor("k_rope", k_rope, ndim=3, shape=[k.shape[0], q.shape[1], q_rope.shape[2]], dtypes=(q.dtype,),
                     device=q.device)
    if q.shape[0] > k.shape[0]:
        raise InvalidInputError(f"{q.shape[0]} queries cannot be the last positions of a {k.shape[0]}-key sequence")
    if not (isinstance(scale, float) and scale > 0):
        raise InvalidInputError(f"scale must be a positive float, got {scale!r}")


def joined_keys(q: torch.Tensor, k: torch.Tensor, q_rope: torch.Tensor | None, k_rope: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q | q_rope, k | k_rope) along the head size: the keys as one tensor each (as given without rope parts)."""
    if q_rope is None:
        return q, k
    return torch.cat([q, q_rope], dim=-1), torch.cat([k, k_rope], dim=-1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None) -> torch.Tensor:
    """-> [Lq, H, dv] in q's dtype, through PyTorch's fused SDPA (values padded to the key width where they
    are narrower: the flash kernels want one head size). Rope parts are joined to the keys first."""
    from torch.nn.attention.bias import causal_lower_right

    check_prefill_attention(q, k, v, scale, q_rope, k_rope)
    q, k = joined_keys(q, k, q_rope, k_rope)
    lq, ls, dk, dv = q.shape[0], k.shape[0], k.shape[-1], v.shape[-1]
    if lq == 0:
        return q.new_empty(0, q.shape[1], dv)
    vp = F.pad(v, (0, dk - dv)) if dv < dk else v
    mask = dict(attn_mask=causal_lower_right(lq, ls)) if lq < ls else dict(is_causal=True)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], vp.transpose(0, 1)[None],
                                       scale=scale, **mask)
    return o[0, :, :, :dv].transpose(0, 1)
