"""What the largest step needs beside the weights and the KV cache, measured once at start-up on a GPU.

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

import torch

from deepinfer.attention import AttentionBatch, KVCacheSpec
from deepinfer.backend import Backend
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
    spec = KVCacheSpec(blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim, kv_dtype)
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
