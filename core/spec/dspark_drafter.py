"""The DSpark drafter in the engine: per-sequence context keys/values, one parallel pass, a Markov loop.

State per sequence: each draft layer's keys and values of the context features H_ctx at positions
[lo, hi), the last `window` of them. observe() extends it with the target layer outputs of the positions a
step kept; a step that starts before hi (rejected drafts, recomputation after preemption) first cuts the
state back, and one that starts after hi (prefix-cache hits skipped the computation) starts it afresh, so
the block attends to what is known. A sequence drafts when its state ends right before its anchor.

propose(): the anchor + mask block of every drafting sequence runs through the backbone in one batched pass
(padded contexts, masked), then k = 1..n: logits U_k + W1[x_{k-1}] W2, confidence c_k from
[h_k ; W1[x_{k-1}]], and the draft token (argmax for greedy requests, a keyed draw from the request's
processed distribution otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from deepinfer.model.deepseek import DeepseekModel
from deepinfer.spec.confidence import STSCalibration
from deepinfer.spec.drafter import Drafter, DraftRequest, Observation, Proposal, SpeculativeError
from deepinfer.spec.draws import choose_rows
from deepinfer.spec.dspark_model import CALIBRATION_FILE, DSparkModel, load_dspark


@dataclass
class _Context:
    lo: int  # first position held
    hi: int  # one past the last position held
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer: keys, values [hi - lo, H, D]

    def cut(self, end: int) -> None:
        keep = max(0, end - self.lo)
        self.kv = [(k[:keep], v[:keep]) for k, v in self.kv]
        self.hi = self.lo + keep

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], count: int, window: int) -> None:
        self.kv = [(torch.cat([k0, k1]), torch.cat([v0, v1])) for (k0, v0), (k1, v1) in zip(self.kv, kv)]
        self.hi += count
        extra = (self.hi - self.lo) - window
        if extra > window // 4:  # trim in batches: fewer copies than trimming every step
            self.kv = [(k[extra:].clone(), v[extra:].clone()) for k, v in self.kv]
            self.lo += extra


class DSparkDrafter(Drafter):
    name = "dspark"
    has_confidence = True

    def __init__(self, model: DSparkModel, num_tokens: int | None = None, calibration: STSCalibration | None = None):
        self.model = model
        self.cfg = model.cfg
        k = self.cfg.block_size if num_tokens is None else num_tokens
        if not 1 <= k <= self.cfg.block_size:
            raise SpeculativeError(f"this DSpark drafter drafts blocks of {self.cfg.block_size}; "
                                   f"num_speculative_tokens must be in [1, {self.cfg.block_size}], got {k}")
        self._k = k
        self.capture_layers = self.cfg.target_layers
        self.calibration = calibration
        self._ctx: dict[str, _Context] = {}

    @classmethod
    def from_folder(cls, folder: Path, target: DeepseekModel, num_tokens: int | None = None) -> DSparkDrafter:
        embed, head = target.embed_tokens, target.lm_head.dequantize()
        model = load_dspark(folder, embed, head, device=embed.device)
        bad = [i for i in model.cfg.target_layers if not 0 <= i < len(target.layers)]
        if bad or model.cfg.vocab_size != target.config.vocab_size:
            raise SpeculativeError(f"{folder}: drafter built for target layers {model.cfg.target_layers} and vocab "
                                   f"{model.cfg.vocab_size}; the target has {len(target.layers)} layers and vocab "
                                   f"{target.config.vocab_size}")
        calib = folder / CALIBRATION_FILE
        return cls(model, num_tokens, STSCalibration.load(calib) if calib.exists() else None)

    @property
    def max_draft_tokens(self) -> int:
        return self._k

    @torch.inference_mode()
    def observe(self, observations: list[Observation], hidden: torch.Tensor, captured: tuple[torch.Tensor, ...]) -> None:
        if not observations:
            return
        if len(captured) != len(self.cfg.target_layers):
            raise SpeculativeError(f"DSpark needs target layers {self.cfg.target_layers}; the step captured {len(captured)}")
        dev = self.model.embed.device
        rows = torch.tensor([o.rows + i for o in observations for i in range(o.count)], device=captured[0].device)
        feats = torch.cat([c.index_select(0, rows) for c in captured], dim=-1).to(dev)
        positions = torch.tensor([o.start + i for o in observations for i in range(o.count)], device=dev)
        kv = self.model.context_kv(self.model.context_features(feats), positions)
        end = 0
        for o in observations:
            part = [(k[end : end + o.count], v[end : end + o.count]) for k, v in kv]
            end += o.count
            state = self._ctx.get(o.seq_id)
            if state is None or o.start > state.hi or o.start < state.lo:
                self._ctx[o.seq_id] = _Context(o.start, o.start + o.count, [(k.clone(), v.clone()) for k, v in part])
                continue
            if o.start < state.hi:
                state.cut(o.start)
            state.append(part, o.count, self.cfg.window)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        live = [i for i, r in enumerate(requests)
                if r.max_tokens > 0 and (s := self._ctx.get(r.seq_id)) is not None and s.hi == r.position and s.hi > s.lo]
        if not live:
            return proposals
        m, dev = self.model, self.model.embed.device
        states = [self._ctx[requests[i].seq_id] for i in live]
        window = [min(s.hi - s.lo, self.cfg.window) for s in states]
        t = max(window)
        ctx_kv = []  # per layer: each sequence's last `window` context keys / values, zero-padded to t
        for layer in range(self.cfg.num_layers):
            ks = pad_sequence([s.kv[layer][0][-w:] for s, w in zip(states, window)], batch_first=True)
            vs = pad_sequence([s.kv[layer][1][-w:] for s, w in zip(states, window)], batch_first=True)
            ctx_kv.append((ks, vs))
        mask = (torch.arange(t, device=dev)[None, :] < torch.tensor(window, device=dev)[:, None])[:, None, :]
        anchors = torch.tensor([[requests[i].anchor] for i in live], device=dev)
        anchor_pos = torch.tensor([[requests[i].position] for i in live], device=dev)
        h, base = m.backbone(anchors, anchor_pos, ctx_kv, mask)
        h, base = h[:, 0], base[:, 0]  # [R, G, .]
        reqs = [requests[i] for i in live]
        n = max(r.max_tokens for r in reqs)
        prev = anchors[:, 0]
        probs: list[list[torch.Tensor | None]] = [[] for _ in live]
        for i in live:
            proposals[i].confidence = []
        for k in range(min(n, self._k)):
            e = m.markov(prev)
            conf = m.confidence(h[:, k], e).tolist()
            logits = base[:, k] + m.transition(e)
            tokens, qs = choose_rows(logits, [r.params for r in reqs], [r.seed for r in reqs],
                                     [r.position + 1 + k for r in reqs])
            for j, i in enumerate(live):
                if k < reqs[j].max_tokens:
                    proposals[i].tokens.append(tokens[j])
                    proposals[i].confidence.append(conf[j])
                    probs[j].append(qs[j])
            prev = torch.tensor(tokens, device=dev)
        for j, i in enumerate(live):
            if probs[j] and probs[j][0] is not None:
                proposals[i].probs = torch.stack(probs[j])
        return proposals

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        state = self._ctx.get(parent_id)
        if state is None or num_tokens <= state.lo:
            return
        child = _Context(state.lo, state.hi, list(state.kv))
        child.cut(min(num_tokens, state.hi))
        self._ctx[child_id] = child

    def release(self, seq_id: str) -> None:
        self._ctx.pop(seq_id, None)
