"""Multi-head Latent Attention in absorbed form over the paged latent cache.

Per token the cache holds c_kv = RMSNorm(W_DKV x) (kv_lora_rank values) and the roped shared key k_pe.
kv_b_proj = [W_UK; W_UV] per head is folded: scores use q_nope @ W_UK (a query in latent space) and the
latent attention output is mapped back with W_UV, so keys and values are never decompressed.

Long prompt chunks are the exception where the backend offers it (capabilities.decompressed_prefill): per
query the absorbed form costs (kv_lora_rank + rope) + kv_lora_rank multiply-adds per key and head, the
decompressed one (nope + rope) + v after rebuilding each key and value once (kv_lora_rank x (nope + v)
per key and head). Past ~DECOMPRESS_MIN_QUERIES queries per sequence rebuilding wins, and the dense attention
runs as the backend's ops.prefill_attention (fused SDPA kernels on GPUs).
"""

from __future__ import annotations

import torch

from deepinfer.attention import read_cached_sequence
from deepinfer.backend import Backend
from deepinfer.config import ModelConfig
from deepinfer.model.context import ForwardContext
from deepinfer.model.mlp import concat_out_features
from deepinfer.quant import Fp8Activations
from deepinfer.weights import LinearWeight, WeightFormat


DECOMPRESS_MIN_QUERIES = 128


class MLAttention:
    def __init__(self, backend: Backend, config: ModelConfig, weights: dict, cos_sin_cache: torch.Tensor):
        """weights: this layer's self_attn tensors keyed by HF name without prefix and '.weight'."""
        self.backend = backend
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.eps = config.rms_norm_eps
        self.softmax_scale = config.softmax_scale
        self.rope_interleaved = config.rope_spec().interleaved
        self.cos_sin_cache = cos_sin_cache
        # The query's first projection (q_proj, or q_a_proj under q_lora) and kv_a_proj_with_mqa read the same
        # hidden state: one GEMM over their concatenated rows where the format allows (a launch per layer less,
        # and a fuller GEMM at decode batch sizes); the separate weights are kept only when they do not fuse.
        q_first = weights["q_proj" if self.q_lora_rank is None else "q_a_proj"]
        kv_a = weights["kv_a_proj_with_mqa"]
        self.kv_a_width = kv_a.out_features
        self.q_kv_a = concat_out_features(q_first, kv_a)
        self.q_first, self.kv_a = (None, None) if self.q_kv_a is not None else (q_first, kv_a)
        # forward's input feeds only this GEMM: with FP8 weights it may come quantised (quant.Fp8Activations)
        self.takes_fp8_input = self.q_kv_a is not None and self.q_kv_a.format is WeightFormat.FP8_BLOCK
        if self.q_lora_rank is not None:
            self.q_a_layernorm = weights["q_a_layernorm"]
            self.q_b_proj = weights["q_b_proj"]
        self.kv_a_layernorm = weights["kv_a_layernorm"]
        self.o_proj = weights["o_proj"]
        # kv_b_proj [H * (nope + v), kv_lora_rank] split per head into the absorbed GEMMs' stacked weights:
        # W_UK^T [H, kv_lora_rank, nope] maps q_nope into latent space; W_UV [H, v, kv_lora_rank] maps back.
        kv_b = weights["kv_b_proj"]
        kv_b = (kv_b.dequantize() if isinstance(kv_b, LinearWeight) else kv_b.float()).view(
            self.num_heads, self.nope + self.v_dim, self.kv_lora_rank
        )
        dtype = self.kv_a_layernorm.dtype  # the model's activation dtype
        self.w_uk_t = LinearWeight.dense(kv_b[:, : self.nope, :].transpose(1, 2).contiguous().to(dtype))
        self.w_uv = LinearWeight.dense(kv_b[:, self.nope :, :].contiguous().to(dtype))
        self.decompress_prefill = backend.capabilities.decompressed_prefill
        # The same map as one [H * (nope + v), kv_lora_rank] projection, for decompressing cached latents.
        self.kv_b = LinearWeight.dense(kv_b.reshape(-1, self.kv_lora_rank).to(dtype))
        # o_proj's input comes out of the last absorbed projection; FP8 o_proj takes it quantised from there
        self.fp8_o_input = self.o_proj.format is WeightFormat.FP8_BLOCK

    def forward(self, x: torch.Tensor | Fp8Activations, ctx: ForwardContext, layer: int) -> torch.Tensor:
        be, ops = self.backend, self.backend.ops
        t = x.shape[0]
        if self.q_kv_a is not None:
            q_first, kv = be.linear(x, self.q_kv_a).split([self.q_kv_a.out_features - self.kv_a_width, self.kv_a_width], -1)
        else:
            q_first, kv = be.linear(x, self.q_first), be.linear(x, self.kv_a)
        if self.q_lora_rank is None:
            q = q_first
        else:
            q = be.linear(ops.rms_norm(q_first, self.q_a_layernorm, self.eps), self.q_b_proj)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope = q[..., : self.nope]
        # c_kv = RMSNorm(kv[:, :kv_lora_rank]) and the roped k_pe = kv[:, kv_lora_rank:] into the cache, and q_pe
        # roped, in one op (one launch where the backend fuses them). Positions come from the step's plan,
        # checked on the host by DeepseekModel.forward.
        cache = ctx.kv_caches[layer]
        q_pe = be.rope_norm_and_write_cache(ctx.plan, cache, q[..., self.nope :], kv, self.kv_a_layernorm, self.eps,
                                            self.cos_sin_cache, self.rope_interleaved, validate=False)
        if self.decompress_prefill and min(ctx.plan.batch.query_lens) >= DECOMPRESS_MIN_QUERIES:
            out = self._decompressed(ctx, cache, q_nope, q_pe)
            return be.linear(out.reshape(t, self.num_heads * self.v_dim), self.o_proj)
        q_latent = be.per_head_linear(q_nope, self.w_uk_t)
        out_latent = be.run_attention(ctx.plan, cache, q_latent, q_pe, self.softmax_scale)
        out = be.per_head_linear(out_latent, self.w_uv, quantize=self.fp8_o_input)
        return be.linear(out if isinstance(out, Fp8Activations) else out.reshape(t, self.num_heads * self.v_dim),
                         self.o_proj)

    def _decompressed(self, ctx: ForwardContext, cache: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """Each sequence's keys and values rebuilt from its cached latents, then causal dense attention of its
        new queries (the last query_len positions) over all of them -> [T, H, v]."""
        plan, h, dtype = ctx.plan, self.num_heads, q_nope.dtype
        out = q_nope.new_empty(q_nope.shape[0], h, self.v_dim)
        start = 0
        for i, (q_len, s_len) in enumerate(zip(plan.batch.query_lens, plan.batch.seq_lens)):
            c_kv, k_pe = read_cached_sequence(plan, cache, i)
            kv = self.backend.linear(c_kv.to(dtype), self.kv_b).view(s_len, h, self.nope + self.v_dim)
            # keys as (nope | rope) parts, the one roped key shared by every head: no concatenated copies
            out[start : start + q_len] = self.backend.ops.prefill_attention(
                q_nope[start : start + q_len], kv[..., : self.nope], kv[..., self.nope :], self.softmax_scale,
                q_rope=q_pe[start : start + q_len], k_rope=k_pe.to(dtype)[:, None, :].expand(s_len, h, self.rope))
            start += q_len
        return out
