"""ModelRunner: owns the paged latent caches and turns one scheduled batch into a model forward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.attention import AttentionBatch, KVCacheSpec
from deepinfer.backend import Backend
from deepinfer.engine.cuda_graphs import DecodeGraphs, reserve_sink
from deepinfer.engine.overlap import resolve_inputs
from deepinfer.model.context import ForwardContext
from deepinfer.model.deepseek import DeepseekModel
from deepinfer.transfer import take_rows


@dataclass(frozen=True)
class StepOutput:
    hidden: torch.Tensor  # [T, hidden] final-normed hidden states of every token of the step
    logits: torch.Tensor  # [len(logit_rows), vocab] float32
    captured: tuple[torch.Tensor, ...] = ()  # [T, hidden] residual stream after each layer asked for
    graphed: bool = False  # replayed from a captured graph (hidden and logits are views of its buffers)


class ModelRunner:
    def __init__(self, model: DeepseekModel, backend: Backend, spec: KVCacheSpec,
                 graph_batch_sizes: Sequence[int] = (), max_seq_len: int | None = None, expert_parallel: bool = False):
        """spec: the cache the scheduler hands out. With graph_batch_sizes (a backend that captures graphs),
        one more block is allocated as the padding sink and decode graphs are captured for those sizes,
        serving sequences up to max_seq_len. expert_parallel: one rank of several; its graphs size the MoE
        dispatch for their batch, and `agree` (set by deepinfer.engine.expert_parallel) settles each step's
        dispatch capacity and whether graphs run, the same on every rank."""
        self.model = model
        self.backend = backend
        self.num_usable_blocks = spec.num_blocks
        self.graphs: DecodeGraphs | None = None
        # (this rank's tokens, whether a graph serves its step) -> (the step's capacity, whether every rank's
        # step is graph-served): a collective, so every rank calls it once per forward.
        self.agree: Callable[[int, bool], tuple[int, bool]] | None = None
        if graph_batch_sizes:
            spec, sink = reserve_sink(spec)
        self.spec = spec
        self.kv_caches = tuple(backend.allocate_kv_cache(spec) for _ in range(model.num_cache_layers))
        if graph_batch_sizes:
            limit = max_seq_len or model.config.max_position_embeddings
            self.graphs = DecodeGraphs(model, backend, spec, self.kv_caches, sink, graph_batch_sizes, limit,
                                       moe_capacity=expert_parallel)
            self.graphs.capture()

    @staticmethod
    def cache_spec(model: DeepseekModel, num_blocks: int, block_size: int, dtype: str) -> KVCacheSpec:
        c = model.config
        return KVCacheSpec(num_blocks, block_size, c.kv_lora_rank, c.qk_rope_head_dim, dtype, c.num_attention_heads)

    @torch.inference_mode()
    def execute(self, batch: AttentionBatch, input_ids: list[int], logit_rows: list[int],
                capture_layers: tuple[int, ...] = (), pending_tokens: torch.Tensor | None = None) -> StepOutput:
        """Run the model on this step's new tokens and return logits for the token rows asked for (and the
        outputs of `capture_layers`, for speculative drafters that read target features). Decode steps that
        a captured graph serves replay it; nothing here waits for the device.

        pending_tokens: the tokens sampled by the step still in flight (on the device); input ids written
        as overlap.pending_input(row) are taken from it."""
        device = self.backend.device
        ids = resolve_inputs(input_ids, pending_tokens, device)
        graphed = self.graphs is not None and not capture_layers and self.graphs.serves(batch, logit_rows)
        size = capacity = None
        if self.agree is not None:
            capacity, everyone = self.agree(batch.num_tokens, graphed)
            size = self.graphs.size_for(capacity) if graphed and everyone else None
            graphed = size is not None
        if graphed:
            hidden, logits = self.graphs.run(batch, ids, size)
            return StepOutput(hidden, logits, graphed=True)
        plan = self.backend.plan_attention(batch, self.spec)
        ctx = ForwardContext(plan, self.kv_caches, moe_capacity=capacity)
        captured: list[torch.Tensor] = []
        if capture_layers:
            hidden, captured = self.model.forward_capture(ids, ctx, capture_layers)
        else:
            hidden = self.model.forward(ids, ctx)
        return StepOutput(hidden, self.model.compute_logits(take_rows(hidden, logit_rows)), tuple(captured))
