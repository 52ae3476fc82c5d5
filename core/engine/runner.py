"""ModelRunner: owns the paged latent caches and turns one scheduled batch into a model forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.attention import AttentionBatch, KVCacheSpec
from deepinfer.backend import Backend
from deepinfer.model.context import ForwardContext
from deepinfer.model.deepseek import DeepseekModel


@dataclass(frozen=True)
class StepOutput:
    hidden: torch.Tensor  # [T, hidden] final-normed hidden states of every token of the step
    logits: torch.Tensor  # [len(logit_rows), vocab] float32
    captured: tuple[torch.Tensor, ...] = ()  # [T, hidden] residual stream after each layer asked for


class ModelRunner:
    def __init__(self, model: DeepseekModel, backend: Backend, spec: KVCacheSpec):
        self.model = model
        self.backend = backend
        self.spec = spec
        self.kv_caches = tuple(backend.allocate_kv_cache(spec) for _ in range(model.num_cache_layers))

    @staticmethod
    def cache_spec(model: DeepseekModel, num_blocks: int, block_size: int, dtype: str) -> KVCacheSpec:
        c = model.config
        return KVCacheSpec(num_blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim, dtype)

    @torch.inference_mode()
    def execute(self, batch: AttentionBatch, input_ids: list[int], logit_rows: list[int],
                capture_layers: tuple[int, ...] = ()) -> StepOutput:
        """Run the model on this step's new tokens and return logits for the token rows asked for (and the
        outputs of `capture_layers`, for speculative drafters that read target features)."""
        plan = self.backend.plan_attention(batch, self.spec)
        ctx = ForwardContext(plan, self.kv_caches)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.backend.device)
        captured: list[torch.Tensor] = []
        if capture_layers:
            hidden, captured = self.model.forward_capture(ids, ctx, capture_layers)
        else:
            hidden = self.model.forward(ids, ctx)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.backend.device)
        return StepOutput(hidden, self.model.compute_logits(hidden.index_select(0, rows)), tuple(captured))
