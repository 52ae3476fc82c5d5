"""The KV cache's size: what the largest step needs beside the weights and the cache, measured once at start-up
on a GPU, and the blocks that the rest of the memory budget holds.

The cache takes a fraction of the memory left after loading; whatever a forward allocates must still fit
beside it, or the first long prompt runs the device out of memory mid-serving. The largest step the
scheduler forms is a prefill chunk of max_num_batched_tokens new tokens at the end of a max_model_len
sequence: MLA rebuilds that whole prefix's keys and values for the chunk's attention, and the MoE layers
hold top_k rows per token. This module runs that step once on dummy tokens over a temporary zeroed cache
and reports the peak allocation above what was allocated before (the temporary cache excluded). The run
also compiles the prefill kernels, which a first long prompt would otherwise wait for.
"""

from __future__ import annotations

import logging
import os

import torch

from deepinfer.attention import AttentionBatch, KVCacheSpec
from deepinfer.backend import Backend
from deepinfer.config import EngineConfig
from deepinfer.errors import InvalidInputError
from deepinfer.model.context import ForwardContext
from deepinfer.model.deepseek import DeepseekModel
from deepinfer.quant import cdiv

logger = logging.getLogger(__name__)

# Share of the free memory the temporary cache may take; a longer max_model_len is profiled at the length
# that fits (the prefix rebuild is then measured for that length only, and the log says so).
PROFILE_CACHE_SHARE = 0.25


def peak_step_bytes(model: DeepseekModel, backend: Backend, *, tokens: int, context: int, logit_rows: int,
                    block_size: int, kv_dtype: str, free_bytes: int) -> int:
    """Peak bytes one forward of `tokens` new tokens ending a `context`-token sequence allocates on the
    GPU, plus float32 logits for `logit_rows` rows; 0 off CUDA (nothing to measure: host memory is shared)."""
    device = backend.device
    if device.type != "cuda":
        return 0
    c = model.config
    per_token = KVCacheSpec(1, block_size, c.kv_lora_rank, c.qk_rope_head_dim, kv_dtype).bytes_per_token
    fit = int(free_bytes * PROFILE_CACHE_SHARE) // (per_token * model.num_cache_layers)
    tokens = min(tokens, context)
    profiled = max(tokens, min(context, fit // block_size * block_size))
    if profiled < context:
        logger.warning("memory profile: a %d-token prefix instead of max_model_len %d (its temporary cache "
                       "would not fit); longer prefixes may need more memory than reserved", profiled, context)
    blocks = cdiv(profiled, block_size)
    spec = KVCacheSpec(blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim, kv_dtype, c.num_attention_heads)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        # Zeroed, so the attention over the dummy prefix reads finite values (garbage could route NaNs).
        caches = tuple(backend.allocate_kv_cache(spec).zero_() for _ in range(model.num_cache_layers))
        cache_bytes = torch.cuda.memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        batch = AttentionBatch((tokens,), (profiled,), (tuple(range(blocks)),))
        ids = torch.randint(0, c.vocab_size, (tokens,), device=device)
        hidden = model.forward(ids, ForwardContext(backend.plan_attention(batch, spec), caches))
        model.compute_logits(hidden[: max(1, min(logit_rows, tokens))])
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    del caches, hidden
    torch.cuda.empty_cache()
    logger.info("memory profile: a %d-token chunk ending a %d-token sequence peaks at %.2f GiB beside the cache",
                tokens, profiled, peak / 2**30)
    return max(0, peak)


def kv_cache_spec(model: DeepseekModel, backend: Backend, ec: EngineConfig, max_model_len: int, kv_dtype: str, *,
                  logit_rows: int) -> KVCacheSpec:
    """Blocks that fit the budget (kv_cache_memory, else kv_cache_fraction of the free memory less the largest
    step's measured allocation), capped at what max_num_seqs full-length sequences could use. logit_rows: the
    float32 logits rows a step may hold at once. Expert-parallel ranks build their engines at the same time with
    one configuration, so they all run the measured step and its MoE all-to-alls pair up; its random routing
    measures a typical step, not the most skewed one."""
    c = model.config
    probe = KVCacheSpec(1, ec.block_size, c.kv_lora_rank, c.qk_rope_head_dim, kv_dtype)
    bytes_per_block = probe.bytes_per_token * ec.block_size * model.num_cache_layers
    budget = ec.kv_cache_memory
    if budget is None:
        free = _free_memory(backend.device)
        reserve = peak_step_bytes(
            model, backend, tokens=ec.max_num_batched_tokens, context=max_model_len, logit_rows=logit_rows,
            block_size=ec.block_size, kv_dtype=kv_dtype, free_bytes=free)
        budget = int(max(0, free - reserve) * ec.kv_cache_fraction)
    useful = ec.max_num_seqs * cdiv(max_model_len, ec.block_size)
    num_blocks = min(budget // bytes_per_block, useful)
    if num_blocks < 1:
        raise InvalidInputError(
            f"the KV cache budget of {budget} bytes holds no block of {ec.block_size} tokens "
            f"({bytes_per_block} bytes over {model.num_cache_layers} layers); raise kv_cache_memory"
        )
    logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s)", num_blocks, ec.block_size,
                num_blocks * ec.block_size, num_blocks * bytes_per_block / 2**20, kv_dtype)
    return KVCacheSpec(num_blocks, ec.block_size, c.kv_lora_rank, c.qk_rope_head_dim, kv_dtype, c.num_attention_heads)


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 30
