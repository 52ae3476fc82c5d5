"""The training loop: next-token loss plus DeepSeek-V3's MTP loss, AdamW, aux-loss-free expert balancing.

Each batch runs as a fresh prefill of B sequences into a scratch float32 latent cache. The reference
backend's write_cache assigns into the cache tensor (index_put) and run_attention gathers from it; both are
differentiable, so gradients reach c_kv / k_pe through the cache with no special path
(tests/train/test_train_tiny.py checks every gradient against transformers').
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.attention import AttentionBatch, AttentionPlan, KVCacheSpec
from deepinfer.backend import Backend
from deepinfer.config import ModelConfig
from deepinfer.model.context import ForwardContext
from deepinfer.model.deepseek import DeepseekModel
from deepinfer.ops import FusedOps, RoutingSpec
from deepinfer.quant import cdiv
from deepinfer.registry import backend_class
from deepinfer.train.model_init import build_model, init_params, is_correction_bias, moe_layer_ids, trainable

BLOCK = 64


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000
    batch_size: int = 32
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3  # DeepSeek-V3's weight of the MTP loss for most of its training
    bias_gamma: float = 1e-3  # DeepSeek-V3's bias update speed
    seed: int = 0

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class _LoadRecordingOps(FusedOps):
    """Reference ops that also count, per router call, how many tokens each expert received."""

    def __init__(self) -> None:
        self.loads: list[torch.Tensor] = []

    def select_experts(self, router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None):
        weights, ids = super().select_experts(router_logits, spec, correction_bias)
        self.loads.append(torch.bincount(ids.flatten(), minlength=spec.num_experts))
        return weights, ids


def training_backend(device: str | torch.device) -> Backend:
    """The reference backend (found through its entry point, as the core reaches every backend) whose routers
    report expert loads through Backend.ops, the documented hook."""
    reference = backend_class("reference")

    class TrainingBackend(reference):
        def __init__(self) -> None:
            super().__init__(device=device, batch_invariant=False)
            self._ops = _LoadRecordingOps()

        @property
        def ops(self) -> _LoadRecordingOps:
            return self._ops

    return TrainingBackend()


def prefill_plan(backend: Backend, config: ModelConfig, batch_size: int, seq_len: int) -> AttentionPlan:
    """B whole sequences of seq_len tokens, each in its own blocks of a scratch cache."""
    per_seq = cdiv(seq_len, BLOCK)
    spec = KVCacheSpec(batch_size * per_seq, BLOCK, config.kv_lora_rank, config.qk_rope_head_dim, "fp32",
                       config.num_attention_heads)
    tables = tuple(tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch_size))
    return backend.plan_attention(AttentionBatch((seq_len,) * batch_size, (seq_len,) * batch_size, tables), spec)


def forward_logits(model: DeepseekModel, backend: Backend, plan: AttentionPlan, tokens: torch.Tensor):
    """tokens [B, T+2] -> (main logits [B*T, V] predicting tokens[:, 1:T+1], MTP logits [B*T, V] predicting
    tokens[:, 2:T+2]). The MTP module sees the main model's final-normed hidden state at t and the embedding
    of token t+1, at position t: what DeepInfer's MTP drafting feeds it."""
    t = tokens.shape[1] - 2
    caches = tuple(backend.allocate_kv_cache(plan.spec) for _ in range(model.num_cache_layers))
    ctx = ForwardContext(plan, caches)
    hidden = model.forward(tokens[:, :t].reshape(-1), ctx)
    logits = model.compute_logits(hidden)
    if not model.mtp:
        return logits, None
    mtp_hidden = model.forward_mtp(0, tokens[:, 1 : t + 1].reshape(-1), hidden, ctx)
    return logits, model.mtp[0].logits(mtp_hidden)


def sample_windows(stream: torch.Tensor, batch_size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """B random windows of `length` tokens from the packed training stream (deterministic given gen)."""
    starts = torch.randint(0, stream.numel() - length, (batch_size,), generator=gen)
    index = starts[:, None] + torch.arange(length)[None, :]
    return stream[index.to(stream.device)]


class Trainer:
    def __init__(self, config: ModelConfig, settings: TrainSettings, device: str | torch.device):
        self.config, self.settings = config, settings
        self.device = torch.device(device)
        self.backend = training_backend(self.device)
        self.params = init_params(config, settings.seed, self.device)
        self.cos_sin_cache = config.rope_spec().cos_sin_cache(settings.seq_len, self.device)
        self.plan = prefill_plan(self.backend, config, settings.batch_size, settings.seq_len)
        self.moe_layers = moe_layer_ids(config)
        decay = [p for n, p in trainable(self.params).items() if p.dim() >= 2]
        no_decay = [p for n, p in trainable(self.params).items() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=settings.lr, betas=(0.9, 0.95), eps=1e-8,
        )
        self.data_gen = torch.Generator().manual_seed(settings.seed + 1)
        self.step_num = 0

    def model(self) -> DeepseekModel:
        return build_model(self.backend, self.config, self.params, self.cos_sin_cache)

    def losses(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.settings.seq_len
        main_logits, mtp_logits = forward_logits(self.model(), self.backend, self.plan, tokens)
        main = F.cross_entropy(main_logits, tokens[:, 1 : t + 1].reshape(-1))
        mtp = F.cross_entropy(mtp_logits, tokens[:, 2 : t + 2].reshape(-1))
        return main, mtp

    def step(self, stream: torch.Tensor) -> dict[str, torch.Tensor]:
        s = self.settings
        tokens = sample_windows(stream, s.batch_size, s.seq_len + 2, self.data_gen)
        for group in self.optimizer.param_groups:
            group["lr"] = s.lr_at(self.step_num)
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.ops.loads.clear()
        main, mtp = self.losses(tokens)
        loss = main + s.mtp_lambda * mtp
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(trainable(self.params).values()), s.grad_clip)
        self.optimizer.step()
        self.update_biases()
        self.step_num += 1
        return {"loss": loss.detach(), "main": main.detach(), "mtp": mtp.detach(), "grad_norm": grad_norm}

    @torch.no_grad()
    def update_biases(self) -> None:
        """Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): bias_i += gamma * sign(mean load - load_i)."""
        loads = self.backend.ops.loads
        if len(loads) != len(self.moe_layers):
            raise RuntimeError(f"expected {len(self.moe_layers)} router calls per step, saw {len(loads)}")
        for layer, load in zip(self.moe_layers, loads):
            load = load.float()
            bias = self.params[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
            bias += self.settings.bias_gamma * torch.sign(load.mean() - load)

    def correction_biases(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.params.items() if is_correction_bias(n)}


def seconds_per_step(config: ModelConfig, settings: TrainSettings, device: str, stream: torch.Tensor, steps: int = 10) -> float:
    """Time a throwaway trainer's steady-state step (first steps warm kernels and allocator up)."""
    trainer = Trainer(config, settings, device)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    warm = 3
    for i in range(steps):
        if i == warm:
            sync()
            start = time.perf_counter()
        trainer.step(stream)
    sync()
    return (time.perf_counter() - start) / (steps - warm)
