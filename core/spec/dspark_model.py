"""The DSpark draft network (paper sec. 3.1): a parallel block backbone plus a low-rank Markov head.

Context: the outputs of chosen target layers at every position before the anchor are concatenated and
projected, H_ctx = RMSNorm(W_c [H^(l1); ...; H^(lm)]) (eq. 2), and injected as extra keys/values into every
draft layer through that layer's own K/V projections (eq. 3), over a sliding window of positions.
Block: the anchor's embedding then gamma - 1 mask embeddings run through a few decoder layers in one pass,
attending bidirectionally within the block and to the context; the anchor is the first prediction
position, so gamma inputs give gamma base logits U_k through the target's frozen LM head.
Markov head: B(x_{k-1}, .) = W1[x_{k-1}] W2 (rank r) is added to U_k, sampled left to right (eq. 4-5); the
Markov embedding W1[x_{k-1}] also feeds the confidence head (eq. 7).
The target's embedding and LM head are shared and frozen: they are not part of the saved weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.spec.confidence import ConfidenceHead

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class DSparkConfig:
    target_hidden_size: int
    vocab_size: int
    target_layers: tuple[int, ...]
    hidden_size: int
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 768
    markov_rank: int = 128
    block_size: int = 5  # gamma: draft tokens per pass
    window: int = 256  # context positions the block attends to
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        for f in ("target_hidden_size", "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                  "intermediate_size", "markov_rank", "block_size", "window"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"DSpark config: {f} must be a positive integer, got {v!r}")
        if not self.target_layers or len(set(self.target_layers)) != len(self.target_layers):
            raise ConfigError(f"DSpark config: target_layers must be distinct layer indices, got {self.target_layers}")
        if self.head_dim % 2:
            raise ConfigError(f"DSpark config: head_dim must be even (rotary), got {self.head_dim}")

    def to_json(self) -> dict:
        return {"model_type": "dspark", **asdict(self), "target_layers": list(self.target_layers)}

    @classmethod
    def from_json(cls, data: dict) -> DSparkConfig:
        if data.get("model_type") != "dspark":
            raise ConfigError(f"not a DSpark drafter config (model_type {data.get('model_type')!r})")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"model_type"}
        if unknown:
            raise ConfigError(f"DSpark config: unknown fields {sorted(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE: x [..., H, D], positions broadcastable to x[..., 0, 0]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[..., None, None] * inv  # [..., 1, D/2]
    cos, sin = torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        d, inner = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.cfg = cfg
        self.attn_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.k_proj = nn.Linear(d, inner, bias=False)
        self.v_proj = nn.Linear(d, inner, bias=False)
        self.o_proj = nn.Linear(inner, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.cfg.num_heads, self.cfg.head_dim)

    def context_kv(self, h_ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Context features [..., d] at positions [...] -> this layer's (roped keys, values) [..., H, D]."""
        k = rotary(self._heads(self.k_proj(h_ctx)), positions, self.cfg.rope_theta)
        return k, self._heads(self.v_proj(h_ctx))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                ctx_mask: torch.Tensor) -> torch.Tensor:
        """x [B, A, G, d] blocks (A blocks per context row b) at positions [B, A, G]; k_ctx, v_ctx [B, T, H, D];
        ctx_mask [B, A, T] (True: context position visible to that block)."""
        a = self.attn_norm(x)
        q = rotary(self._heads(self.q_proj(a)), positions, self.cfg.rope_theta)
        kb = rotary(self._heads(self.k_proj(a)), positions, self.cfg.rope_theta)
        vb = self._heads(self.v_proj(a))
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        s_ctx = torch.einsum("bagnd,btnd->bangt", q, k_ctx) * scale
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, :, None, None, :], float("-inf"))
        s_blk = torch.einsum("bagnd,bahnd->bangh", q, kb) * scale
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
        t = k_ctx.shape[1]
        o = torch.einsum("bangt,btnd->bagnd", p[..., :t], v_ctx) + torch.einsum("bangh,bahnd->bagnd", p[..., t:], vb)
        x = x + self.o_proj(o.reshape(*o.shape[:-2], -1))
        m = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class DSparkModel(nn.Module):
    def __init__(self, cfg: DSparkConfig, embed: torch.Tensor, lm_head: torch.Tensor):
        """embed, lm_head [vocab, target hidden]: the target's, frozen (kept as non-saved buffers)."""
        super().__init__()
        if embed.shape != (cfg.vocab_size, cfg.target_hidden_size) or lm_head.shape != embed.shape:
            raise ConfigError(f"DSpark drafter for vocab {cfg.vocab_size} x hidden {cfg.target_hidden_size} got "
                              f"embedding {tuple(embed.shape)} and LM head {tuple(lm_head.shape)}")
        if cfg.hidden_size != cfg.target_hidden_size:
            raise ConfigError("the DSpark backbone shares the target's embedding and LM head, so its hidden size "
                              f"must equal the target's ({cfg.target_hidden_size}), got {cfg.hidden_size}")
        self.cfg = cfg
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float(), persistent=False)
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layers) * cfg.target_hidden_size, d, bias=False)
        self.ctx_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(d) * 0.02)
        self.layers = nn.ModuleList(DSparkLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        self.confidence = ConfidenceHead(d, cfg.markov_rank)
        with torch.no_grad():
            nn.init.normal_(self.markov_w1.weight, std=1.0 / math.sqrt(cfg.markov_rank))
            nn.init.zeros_(self.markov_w2.weight)  # training starts from the parallel backbone alone

    # --- context -------------------------------------------------------------------------------------
    def context_features(self, captured: torch.Tensor) -> torch.Tensor:
        """[..., m * target hidden] concatenated target layer outputs -> H_ctx [..., d]."""
        return self.ctx_norm(self.fc(captured.to(self.fc.weight.dtype)))

    def context_kv(self, h_ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [layer.context_kv(h_ctx, positions) for layer in self.layers]

    # --- block ---------------------------------------------------------------------------------------
    def backbone(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
                 ctx_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """anchor_ids, anchor_pos [B, A] -> (hidden h [B, A, G, d], base logits U [B, A, G, V])."""
        g = self.cfg.block_size
        b, a = anchor_ids.shape
        x = torch.cat([self.embed[anchor_ids][:, :, None, :],
                       self.mask_embedding.expand(b, a, g - 1, -1)], dim=2)
        positions = anchor_pos[..., None] + torch.arange(g, device=anchor_pos.device)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, positions, k, v, ctx_mask)
        h = self.norm(x)
        return h, h @ self.lm_head.t()

    def markov(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: the Markov embedding of the previous token."""
        return self.markov_w1(prev_ids)

    def transition(self, markov_embedding: torch.Tensor) -> torch.Tensor:
        """B(x_{k-1}, .) = W1[x_{k-1}] W2 over the vocabulary."""
        return self.markov_w2(markov_embedding)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def save_dspark(folder: Path, model: DSparkModel) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(model.cfg.to_json(), indent=2) + "\n", encoding="utf-8")
    tensors = {name: t.detach().float().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})


def load_dspark(folder: Path, embed: torch.Tensor, lm_head: torch.Tensor, device: torch.device | str = "cpu") -> DSparkModel:
    """The drafter saved in `folder`, sharing the target's embedding and LM head."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG_FILE).exists() or not (folder / WEIGHTS_FILE).exists():
        raise ConfigError(f"{folder} is not a DSpark drafter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
                          "train one with `deepinfer train-dspark`")
    cfg = DSparkConfig.from_json(json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8")))
    model = DSparkModel(cfg, embed, lm_head)
    state = load_file(str(folder / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{folder}: DSpark weights do not match its config (missing {missing}, unexpected {unexpected})")
    return model.to(device).eval()
