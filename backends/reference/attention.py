"""Reference MLA attention over the paged latent cache, in plain PyTorch with float32 math.

Cache rows (one per token) follow KVCacheSpec: float caches hold [c_kv | k_pe]; the fp8_e4m3 cache holds
FlashMLA's byte layout [kv_lora_rank E4M3 bytes | num_scales fp32 scales | rope_dim bf16 values], quantised
on write (one scale per 128 latent values, amax / 448) and dequantised on read.

Attention is the absorbed form: W_UK is already folded into q_nope and W_UV is applied by the caller, so
    score = scale * (q_nope . c_kv + q_pe . k_pe),  out = softmax(score) @ c_kv.
Sequences are processed one by one with batched matmuls; lengths come from the host-side batch so nothing
synchronises with the device.
"""

from __future__ import annotations

import math

import torch

from deepinfer.attention import AttentionPlan, KVCacheSpec, read_cached_sequence
from deepinfer.checks import FLOAT_DTYPES, check_tensor, same_device
from deepinfer.errors import InvalidInputError
from deepinfer.quant import quantize_fp8_per_token_group

# Upper bound on score elements (heads x queries x keys) held at once: long prefills are split by query.
_SCORE_BUDGET = 1 << 22


# --- cache row encoding ------------------------------------------------------------------------------


def encode_rows(spec: KVCacheSpec, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, kv_lora_rank] + [T, rope_dim] -> [T, entry_size] cache rows of spec.torch_dtype."""
    if not spec.is_fp8:
        return torch.cat([c_kv, k_pe], dim=-1).to(spec.torch_dtype)
    q, scales = quantize_fp8_per_token_group(c_kv)  # e4m3 [T, R], fp32 [T, num_scales]
    rope = k_pe.to(torch.bfloat16).contiguous()
    return torch.cat([q.view(torch.uint8), scales.view(torch.uint8), rope.view(torch.uint8)], dim=-1)


# --- argument checks ---------------------------------------------------------------------------------


def _check_plan_and_cache(plan: AttentionPlan, cache: torch.Tensor) -> KVCacheSpec:
    if not isinstance(plan, AttentionPlan):
        raise InvalidInputError(f"plan must be an AttentionPlan from plan_attention, got {type(plan).__name__}")
    spec = plan.spec
    check_tensor("cache", cache, ndim=3)
    if tuple(cache.shape) != spec.shape or cache.dtype != spec.torch_dtype:
        raise InvalidInputError(
            f"cache has shape {list(cache.shape)} and dtype {str(cache.dtype).removeprefix('torch.')}; the plan's "
            f"KVCacheSpec needs shape {list(spec.shape)} and dtype {str(spec.torch_dtype).removeprefix('torch.')} "
            f"({spec.dtype} cache)"
        )
    if not same_device(plan.slot_mapping.device, cache.device):
        raise InvalidInputError(f"the plan was built for {plan.slot_mapping.device} but cache is on {cache.device}")
    return spec


def _check_tokens(name: str, t: torch.Tensor, ndim: int, plan: AttentionPlan, cache: torch.Tensor) -> None:
    check_tensor(name, t, ndim=ndim, dtypes=FLOAT_DTYPES, device=cache.device)
    if t.shape[0] != plan.batch.num_tokens:
        raise InvalidInputError(
            f"{name} has {t.shape[0]} tokens (shape {list(t.shape)}) but the plan's batch has "
            f"{plan.batch.num_tokens} new tokens"
        )


# --- ops -----------------------------------------------------------------------------------------------


def write_cache(plan: AttentionPlan, cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Store token t's (c_kv[t], k_pe[t]) at cache slot plan.slot_mapping[t]."""
    spec = _check_plan_and_cache(plan, cache)
    _check_tokens("c_kv", c_kv, 2, plan, cache)
    _check_tokens("k_pe", k_pe, 2, plan, cache)
    check_tensor("c_kv", c_kv, shape=(None, spec.kv_lora_rank))
    check_tensor("k_pe", k_pe, shape=(None, spec.rope_dim))
    slots = plan.slot_mapping
    # Index (block, offset) rather than a flat view, so a strided cache works too.
    cache[slots // spec.block_size, slots % spec.block_size] = encode_rows(spec, c_kv, k_pe)


def run_attention(
    plan: AttentionPlan,
    cache: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    softmax_scale: float,
    return_lse: bool = False,
    batch_invariant: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA: out [T, H, kv_lora_rank] in q_nope's dtype (and lse [T, H] float32 if asked).

    batch_invariant: each query is computed alone over exactly the keys it sees, so its reductions have the
    same length and order whatever chunk of the prompt or batch it arrives in.
    """
    spec = _check_plan_and_cache(plan, cache)
    _check_tokens("q_nope", q_nope, 3, plan, cache)
    _check_tokens("q_pe", q_pe, 3, plan, cache)
    num_tokens, heads = q_nope.shape[:2]
    check_tensor("q_nope", q_nope, shape=(None, None, spec.kv_lora_rank))
    check_tensor("q_pe", q_pe, shape=(num_tokens, heads, spec.rope_dim))
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise InvalidInputError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise InvalidInputError(f"softmax_scale must be finite and > 0, got {softmax_scale}")

    device = cache.device
    out = torch.empty(num_tokens, heads, spec.kv_lora_rank, dtype=q_nope.dtype, device=device)
    lse = torch.empty(num_tokens, heads, dtype=torch.float32, device=device)
    start = 0
    for i, (qlen, slen) in enumerate(zip(plan.batch.query_lens, plan.batch.seq_lens)):
        c_kv, k_pe = read_cached_sequence(plan, cache, i)
        key_pos = torch.arange(slen, device=device)
        if batch_invariant:
            for j in range(qlen):
                t, visible = start + j, slen - qlen + j + 1
                scores = torch.einsum("hr,kr->hk", q_nope[t].float(), c_kv[:visible])
                scores += torch.einsum("hp,kp->hk", q_pe[t].float(), k_pe[:visible])
                scores *= softmax_scale
                row_lse = torch.logsumexp(scores, dim=-1)
                out[t] = (torch.exp(scores - row_lse[:, None]) @ c_kv[:visible]).to(q_nope.dtype)
                lse[t] = row_lse
            start += qlen
            continue
        chunk = max(1, _SCORE_BUDGET // (heads * slen))
        for q0 in range(0, qlen, chunk):
            q1 = min(qlen, q0 + chunk)
            t0, t1 = start + q0, start + q1
            scores = torch.einsum("qhr,kr->hqk", q_nope[t0:t1].float(), c_kv)
            scores += torch.einsum("qhp,kp->hqk", q_pe[t0:t1].float(), k_pe)
            scores *= softmax_scale
            # Query j of this sequence sits at position slen - qlen + j and sees keys up to it.
            query_pos = torch.arange(slen - qlen + q0, slen - qlen + q1, device=device)
            scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
            seq_lse = torch.logsumexp(scores, dim=-1)  # [H, q]; finite: key 0 is always visible
            probs = torch.exp(scores - seq_lse[..., None])
            out[t0:t1] = torch.einsum("hqk,kr->qhr", probs, c_kv).to(q_nope.dtype)
            lse[t0:t1] = seq_lse.transpose(0, 1)
        start += qlen
    return (out, lse) if return_lse else out
