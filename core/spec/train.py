"""Training the DSpark drafter against a frozen target (paper sec. 3.3, DeepSpec-style loss).

Each step takes B windows of T tokens, runs the target once over them (its chosen layer outputs become the
context features; its final hidden states give p_target), samples A anchor positions per window and
trains all A blocks of gamma positions at once: block position k (1-based) at anchor a predicts token
a + k from the context before a, the anchor, and (Markov head, teacher-forced) the true token a + k - 1.

Loss per position, weighted by w_k = exp(-(k - 1) / position_decay):
  0.1 * CE(p_draft, x*) + 0.9 * ||p_draft - p_target||_1 + 1.0 * BCE(c_k, 1 - TV(p_draft, p_target))
with the confidence label detached. The target's embedding and LM head are shared and frozen.
Everything runs on the target's device (`train-dspark --device cuda` trains the target features, the pool and
the drafter on a GPU; the saved drafter is moved back to the CPU).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.model.context import ForwardContext
from deepinfer.model.deepseek import DeepseekModel
from deepinfer.spec.dspark_model import DSparkModel


@dataclass(frozen=True)
class DSparkTrainSettings:
    steps: int = 600
    batch_size: int = 8  # windows per step
    seq_len: int = 256  # tokens per window
    anchors: int = 32  # blocks per window
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    position_decay: float = 4.0
    seed: int = 0
    # With a time budget, training stops when it is spent and the cosine follows elapsed time rather than
    # steps: a shared CPU's speed varies too much for a step count fixed in advance.
    time_budget: float | None = None

    def lr_at(self, step: int, elapsed: float = 0.0) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.time_budget:
            progress = min(1.0, elapsed / self.time_budget)
        else:
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def position_weights(self, block: int) -> torch.Tensor:
        return torch.exp(-torch.arange(block, dtype=torch.float32) / self.position_decay)


class TargetRunner:
    """The frozen target over B windows of T tokens in a scratch cache: captured layer outputs and logits."""

    def __init__(self, model: DeepseekModel, batch_size: int, seq_len: int, layers: tuple[int, ...]):
        from deepinfer.train.trainer import prefill_plan

        self.model, self.layers = model, layers
        self.batch_size, self.seq_len = batch_size, seq_len
        self.plan = prefill_plan(model.backend, model.config, batch_size, seq_len)
        self.caches = tuple(model.backend.allocate_kv_cache(self.plan.spec) for _ in range(model.num_cache_layers))
        self.device = model.embed_tokens.device

    @torch.no_grad()  # not inference_mode: the drafter's autograd saves these inputs
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (captured [B, T, m * hidden] float32, final hidden [B, T, hidden])."""
        b, t = tokens.shape
        tokens = tokens.to(self.device)
        hidden, captured = self.model.forward_capture(tokens.reshape(-1), ForwardContext(self.plan, self.caches), self.layers)
        feats = torch.cat([c.float() for c in captured], dim=-1).view(b, t, -1)
        return feats, hidden.view(b, t, -1)

    @torch.no_grad()
    def probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., hidden] -> p_target [..., vocab] float32."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self.model.compute_logits(flat).softmax(-1).view(*hidden.shape[:-1], -1)


def sample_anchors(batch: int, seq_len: int, anchors: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """[B, A] distinct anchor positions in [1, T - 1 - block] (a context before, a whole block after)."""
    span = seq_len - 1 - block
    if span < 1:
        raise ValueError(f"windows of {seq_len} tokens cannot hold a block of {block} after an anchor")
    a = min(anchors, span)
    return torch.rand(batch, span, generator=gen).argsort(dim=1)[:, :a] + 1


@dataclass
class BlockBatch:
    tokens: torch.Tensor  # [B, T]
    anchors: torch.Tensor  # [B, A]
    captured: torch.Tensor  # [B, T, m * hidden]
    p_target: torch.Tensor  # [B, A, G, V]


def make_batch(target: TargetRunner, tokens: torch.Tensor, anchors: torch.Tensor, block: int,
               features: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockBatch:
    """features: (captured, final hidden) of `tokens` computed before (a FeaturePool); else the target runs now."""
    captured, hidden = features if features is not None else target(tokens)
    dev = hidden.device
    tokens, anchors = tokens.to(dev), anchors.to(dev)
    pos = anchors[..., None] + torch.arange(block, device=dev)  # rows a .. a + G - 1 predict tokens a + 1 .. a + G
    rows = hidden[torch.arange(tokens.shape[0], device=dev)[:, None, None], pos]
    return BlockBatch(tokens, anchors, captured.float(), target.probs(rows))


class FeaturePool:
    """Target features of a fixed set of windows, computed once: the target forward costs more than the
    drafter's step on a CPU, and fresh anchors each epoch still give new blocks."""

    def __init__(self, target: TargetRunner, stream: torch.Tensor, windows: int, gen: torch.Generator,
                 log: Callable[[str], None] = print):
        b, t = target.batch_size, target.seq_len
        n = max(b, windows // b * b)
        starts = torch.randint(0, stream.numel() - t, (n,), generator=gen)
        self.tokens = stream[starts[:, None] + torch.arange(t)]
        caps, hids = [], []
        t0 = time.perf_counter()
        for i in range(0, n, b):
            c, h = target(self.tokens[i : i + b])
            caps.append(c.to(torch.bfloat16))
            hids.append(h)
            if i == 0 or (i // b) % 16 == 15:
                log(f"feature pool: {i + b}/{n} windows ({time.perf_counter() - t0:.0f}s)")
        self.captured, self.hidden = torch.cat(caps), torch.cat(hids)

    def __len__(self) -> int:
        return self.tokens.shape[0]


def block_outputs(model: DSparkModel, batch: BlockBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft log-probs [B, A, G, V], confidence logits [B, A, G], true next tokens [B, A, G]), teacher-forced."""
    cfg = model.cfg
    b, t = batch.tokens.shape
    dev = batch.tokens.device
    positions = torch.arange(t, device=dev)
    kv = model.context_kv(model.context_features(batch.captured), positions.expand(b, t))
    a = batch.anchors
    mask = (positions[None, None, :] < a[..., None]) & (positions[None, None, :] >= a[..., None] - cfg.window)
    anchor_ids = batch.tokens.gather(1, a)
    h, base = model.backbone(anchor_ids, a, kv, mask)
    pos = a[..., None] + torch.arange(cfg.block_size, device=dev)
    index = torch.arange(b, device=dev)[:, None, None]
    prev, nxt = batch.tokens[index, pos], batch.tokens[index, pos + 1]
    e = model.markov(prev)
    logp = (base + model.transition(e)).log_softmax(-1)
    return logp, model.confidence.logit(h, e), nxt


def dspark_loss(model: DSparkModel, batch: BlockBatch, s: DSparkTrainSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logp, conf_logit, nxt = block_outputs(model, batch)
    p = logp.exp()
    ce = -logp.gather(-1, nxt[..., None]).squeeze(-1)  # [B, A, G]
    l1 = (p - batch.p_target).abs().sum(-1)
    label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(conf_logit, label, reduction="none")
    w = s.position_weights(model.cfg.block_size).to(logp.device)
    per_pos = s.ce_weight * ce + s.tv_weight * l1 + s.conf_weight * bce
    loss = (per_pos * w).sum(-1).mean()
    with torch.no_grad():
        stats = {
            "loss": loss.detach(), "ce": ce.mean(), "tv": 0.5 * l1.mean(), "bce": bce.mean(),
            "accept": label.mean(dim=(0, 1)),  # expected acceptance per position at temperature 1
            "top1": (logp.argmax(-1) == batch.p_target.argmax(-1)).float().mean(dim=(0, 1)),  # greedy agreement
            "conf": torch.sigmoid(conf_logit).mean(dim=(0, 1)),
        }
        stats = {k: v.cpu() for k, v in stats.items()}
    return loss, stats


class DSparkTrainer:
    def __init__(self, model: DSparkModel, target: TargetRunner, settings: DSparkTrainSettings,
                 pool: FeaturePool | None = None):
        self.model, self.target, self.s, self.pool = model, target, settings, pool
        params = model.trainable_parameters()
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(settings.seed + 7)
        self.step_num = 0
        self.started: float | None = None

    @property
    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started

    @property
    def done(self) -> bool:
        s = self.s
        return self.step_num >= s.steps or (s.time_budget is not None and self.elapsed >= s.time_budget)

    def windows(self, stream: torch.Tensor) -> torch.Tensor:
        s = self.s
        starts = torch.randint(0, stream.numel() - s.seq_len, (s.batch_size,), generator=self.gen)
        return stream[starts[:, None] + torch.arange(s.seq_len)]

    def step(self, stream: torch.Tensor) -> dict[str, torch.Tensor]:
        s = self.s
        anchors = sample_anchors(s.batch_size, s.seq_len, s.anchors, self.model.cfg.block_size, self.gen)
        if self.pool is not None:
            pick = torch.randint(0, len(self.pool), (s.batch_size,), generator=self.gen)
            batch = make_batch(self.target, self.pool.tokens[pick], anchors, self.model.cfg.block_size,
                               (self.pool.captured[pick], self.pool.hidden[pick]))
        else:
            batch = make_batch(self.target, self.windows(stream), anchors, self.model.cfg.block_size)
        for group in self.opt.param_groups:
            group["lr"] = s.lr_at(self.step_num, self.elapsed)
        if self.started is None:
            self.started = time.perf_counter()
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss, stats = dspark_loss(self.model, batch, s)
        loss.backward()
        stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.trainable_parameters(), s.grad_clip)
        self.opt.step()
        self.step_num += 1
        return stats


@torch.no_grad()
def evaluate(model: DSparkModel, target: TargetRunner, stream: torch.Tensor, settings: DSparkTrainSettings,
             max_windows: int = 32) -> dict[str, list[float]]:
    """Teacher-forced held-out figures per block position: expected acceptance at temperature 1 (1 - TV),
    greedy agreement, mean confidence."""
    model.eval()
    s, g = settings, model.cfg.block_size
    gen = torch.Generator().manual_seed(12345)
    n = min(max_windows, stream.numel() // s.seq_len)
    b = min(target.batch_size, n)
    if b < target.batch_size:  # the runner's plan is for exactly target.batch_size windows
        target = TargetRunner(target.model, b, target.seq_len, target.layers)
    sums = {"accept": torch.zeros(g), "top1": torch.zeros(g), "conf": torch.zeros(g)}
    count = 0
    for start in range(0, n - b + 1, b):
        tokens = stream[start * s.seq_len : (start + b) * s.seq_len].view(b, s.seq_len)
        anchors = sample_anchors(b, s.seq_len, s.anchors, g, gen)
        _, stats = dspark_loss(model, make_batch(target, tokens, anchors, g), s)
        for k in sums:
            sums[k] += stats[k]
        count += 1
    return {k: (v / max(1, count)).tolist() for k, v in sums.items()}


def train(trainer: DSparkTrainer, stream: torch.Tensor, log: Callable[[str], None] = print, every: int = 25) -> list[dict]:
    """Step until trainer.done (its step count, or its time budget)."""
    history = []
    t0 = time.perf_counter()
    while not trainer.done:
        step = trainer.step_num
        stats = trainer.step(stream)
        if step % every == 0 or trainer.done:
            row = {"step": step, "loss": float(stats["loss"]), "ce": float(stats["ce"]), "tv": float(stats["tv"]),
                   "bce": float(stats["bce"]), "accept": [round(x, 4) for x in stats["accept"].tolist()],
                   "seconds": round(time.perf_counter() - t0, 1)}
            history.append(row)
            log(f"step {step:5d}  loss {row['loss']:.4f}  ce {row['ce']:.3f}  tv {row['tv']:.3f}  bce {row['bce']:.4f}  "
                f"accept/pos {row['accept']}  {row['seconds']}s")
    return history
