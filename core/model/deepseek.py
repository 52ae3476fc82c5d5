"""DeepSeek V2/V3 (and R1) written against backend ops: embedding, decoder layers, final norm, lm_head, MTP.

Layers are built from per-layer dicts of already-converted weights (see deepinfer.model.loader) whose keys
are HF names relative to the layer, e.g. "self_attn.kv_b_proj.weight".
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.backend import Backend
from deepinfer.config import ModelConfig
from deepinfer.errors import InvalidInputError
from deepinfer.model.context import ForwardContext
from deepinfer.model.mla import MLAttention
from deepinfer.model.mlp import GatedMLP, split_into_experts, stack_experts
from deepinfer.model.moe import MoE
from deepinfer.ops import ExpertSum
from deepinfer.moe.placement import ExpertPlacement
from deepinfer.weights import LinearWeight

Weights = dict[str, object]


def _sub(weights: Weights, prefix: str) -> Weights:
    """Entries under `prefix.` with the prefix and a trailing '.weight' removed."""
    out = {}
    for name, value in weights.items():
        if name.startswith(prefix + "."):
            key = name[len(prefix) + 1 :]
            out[key.removesuffix(".weight")] = value
    return out


class DecoderLayer:
    def __init__(self, backend: Backend, config: ModelConfig, index: int, weights: Weights, cos_sin_cache: torch.Tensor,
                 placement: ExpertPlacement | None = None, ep_group: Any = None):
        """placement / ep_group: expert parallelism (the weights then hold only this rank's experts)."""
        self.backend = backend
        self.index = index
        self.eps = config.rms_norm_eps
        self.input_layernorm = weights["input_layernorm.weight"]
        self.post_attention_layernorm = weights["post_attention_layernorm.weight"]
        self.self_attn = MLAttention(backend, config, _sub(weights, "self_attn"), cos_sin_cache)
        self.mlp: GatedMLP | MoE = (
            self._build_moe(backend, config, _sub(weights, "mlp"), placement, ep_group)
            if config.is_moe_layer(index)
            else self._build_mlp(backend, _sub(weights, "mlp"))
        )

    @staticmethod
    def _build_mlp(backend: Backend, w: Weights) -> GatedMLP:
        return GatedMLP(backend, w["gate_proj"], w["up_proj"], w["down_proj"])

    @classmethod
    def _build_moe(cls, backend: Backend, config: ModelConfig, w: Weights, placement: ExpertPlacement | None = None,
                   ep_group: Any = None) -> MoE:
        # Logical experts in order, or this rank's physical slots (a replica stacks its own copy).
        held = range(config.n_routed_experts) if placement is None else placement.local_experts
        projections = ("gate_proj", "up_proj", "down_proj")
        per_expert = {p: [w[f"experts.{e}.{p}"] for e in held] for p in projections}
        shared, folded = None, 0
        if config.n_shared_experts:
            sw = _sub(w, "shared_experts")
            # In one process the shared MLP joins the routed grouped GEMMs as extra experts every token takes
            # (two GEMM launches per layer instead of four, and no separate add). Expert parallelism keeps it
            # apart: it runs on every rank, overlapping the all-to-all.
            pieces = None if placement is not None else split_into_experts(
                sw["gate_proj"], sw["up_proj"], sw["down_proj"], like=per_expert["gate_proj"][0])
            if pieces is None:
                shared = cls._build_mlp(backend, sw)
            else:
                folded = len(pieces)
                for piece in pieces:
                    for p, weight in zip(projections, piece):
                        per_expert[p].append(weight)
        stacked = {p: stack_experts(per_expert[p]) for p in projections}
        experts = GatedMLP(backend, stacked["gate_proj"], stacked["up_proj"], stacked["down_proj"])
        return MoE(backend, config.routing_spec(), w["gate"], w.get("gate.e_score_correction_bias"), experts, shared,
                   placement, ep_group, folded_shared=folded)

    def forward(self, x: torch.Tensor | ExpertSum, ctx: ForwardContext, residual: torch.Tensor | None = None, *,
                defer_combine: bool = False) -> tuple[torch.Tensor | ExpertSum, torch.Tensor]:
        """The layer on hidden state x + residual (x alone when residual is None) -> (out, residual) whose sum is
        its output hidden state. Each residual add is fused into the norm that follows it (one launch less per
        add); the sums are the same roundings as adding first. defer_combine (out goes to ops.add_rms_norm only:
        the next layer's or the final norm): an MoE layer's out may be its combine unformed, an ExpertSum, which
        that norm forms in its own launch; x may be one from the layer before."""
        ops = self.backend.ops
        if residual is None:
            normed, residual = ops.rms_norm(x, self.input_layernorm, self.eps), x
        else:  # FP8 attention projections take the norm quantised (in the norm's launch where the backend can)
            normed, residual = ops.add_rms_norm(x, residual, self.input_layernorm, self.eps,
                                                quantize=self.self_attn.takes_fp8_input)
        attn = self.self_attn.forward(normed, ctx, self.index)
        normed, residual = ops.add_rms_norm(attn, residual, self.post_attention_layernorm, self.eps)
        if isinstance(self.mlp, MoE):
            return self.mlp.forward(normed, ctx.moe_capacity, defer_combine), residual
        return self.mlp.forward(normed), residual


class MTPLayer:
    """DeepSeek-V3 multi-token prediction module k: from the hidden state at position i and token i+1,
    predict token i+2 (then i+3 with the next module or by running this one autoregressively)."""

    def __init__(self, backend: Backend, config: ModelConfig, index: int, weights: Weights, cos_sin_cache: torch.Tensor,
                 placement: ExpertPlacement | None = None, ep_group: Any = None):
        self.backend = backend
        self.eps = config.rms_norm_eps
        self.enorm = weights["enorm.weight"]
        self.hnorm = weights["hnorm.weight"]
        self.eh_proj = weights["eh_proj.weight"]
        self.block = DecoderLayer(backend, config, index, weights, cos_sin_cache, placement, ep_group)
        self.head_norm = weights["shared_head.norm.weight"]
        self.head = LinearWeight.dense(weights["shared_head.head.weight"])

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ops = self.backend.ops
        x = torch.cat([ops.rms_norm(embeds, self.enorm, self.eps), ops.rms_norm(hidden, self.hnorm, self.eps)], dim=-1)
        out, residual = self.block.forward(self.backend.linear(x, self.eh_proj), ctx)
        return out + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.backend.ops.rms_norm(hidden, self.head_norm, self.eps)
        return self.backend.linear(normed, self.head).float()


class DeepseekModel:
    def __init__(self, backend: Backend, config: ModelConfig, top: Weights, layers: list[DecoderLayer], mtp: list[MTPLayer]):
        """top: the non-layer tensors by full HF name (embed_tokens, norm, lm_head unless tied)."""
        self.backend = backend
        self.config = config
        self.embed_tokens: torch.Tensor = top["model.embed_tokens.weight"]
        self.norm = top["model.norm.weight"]
        lm_head = top.get("lm_head.weight")
        self.lm_head = LinearWeight.dense(lm_head if lm_head is not None else self.embed_tokens)  # tied embeddings
        self.layers = layers
        self.mtp = mtp

    @property
    def num_cache_layers(self) -> int:
        return len(self.layers) + len(self.mtp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.index_select(0, input_ids)

    def _check_positions(self, ctx: ForwardContext) -> None:
        """On the host, once per forward: rope reads its table at every position (no device-side check)."""
        rows = self.layers[0].self_attn.cos_sin_cache.shape[0] if self.layers else None
        if rows is not None and max(ctx.plan.batch.seq_lens) > rows:
            raise InvalidInputError(f"a sequence reaches position {max(ctx.plan.batch.seq_lens) - 1}; the model was "
                                    f"loaded for {rows} positions (max_positions)")

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, hidden]."""
        return self.forward_capture(input_ids, ctx, ())[0]

    def forward_capture(self, input_ids: torch.Tensor, ctx: ForwardContext, capture: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward(), also returning the residual stream after each layer in `capture` (speculative drafters
        such as DSpark read these target features)."""
        self._check_positions(ctx)
        x, residual = self.embed(input_ids), None
        taken: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer.forward(x, ctx, residual, defer_combine=i not in capture)
            if i in capture:
                taken[i] = x + residual  # the sum the next layer's fused add forms too: the same rounding
        eps = self.config.rms_norm_eps
        # The final norm of x + residual, the last layer's add fused into it.
        final = (self.backend.ops.rms_norm(x, self.norm, eps) if residual is None
                 else self.backend.ops.add_rms_norm(x, residual, self.norm, eps)[0])
        return final, [taken[i] for i in capture]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> float32 logits [T, vocab]."""
        return self.backend.linear(hidden, self.lm_head).float()

    def forward_mtp(self, k: int, next_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """MTP module k on (hidden at position i, token i+1) -> its hidden state for predicting token i+2.

        `hidden` is the target model's final-normed hidden state (vLLM and SGLang feed the same), or the
        previous MTP step's output when drafting autoregressively.
        """
        self._check_positions(ctx)
        return self.mtp[k].forward(self.embed(next_ids), hidden, ctx)
