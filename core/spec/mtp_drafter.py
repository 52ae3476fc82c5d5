"""The checkpoint's own MTP module as a drafter, run autoregressively for k tokens (MTP-1 is k = 1).

DeepSeek-V3's MTP module at position j reads (target hidden state at j, token j + 1) and predicts token j + 2;
its attention has its own paged cache layer after the main ones, over the same block tables. So:
  observe: after each target forward, run the module over every kept position j with the token that follows
    it (prefill chunks, anchors, accepted drafts), writing its cache entries; keep the output at the last
    position, which predicts the token after the anchor of the next step.
  propose: d_1 from that kept output; d_{i+1} by running the module at the next position on (its own
    previous output, d_i), as vLLM and SGLang chain a single MTP module. Those entries sit in the lookahead
    slots the scheduler reserved, and the next observe rewrites them with target hidden states.
"""

from __future__ import annotations

import torch

from deepinfer.attention import AttentionBatch
from deepinfer.model.context import ForwardContext
from deepinfer.model.deepseek import DeepseekModel
from deepinfer.spec.drafter import Drafter, DraftRequest, Observation, Proposal, SpeculativeError
from deepinfer.spec.draws import choose_rows


class MTPDrafter(Drafter):
    name = "mtp"

    def __init__(self, model: DeepseekModel, runner, num_tokens: int):
        if not model.mtp:
            raise SpeculativeError("the MTP drafter needs the checkpoint's MTP layer: this model has none "
                                   "(num_nextn_predict_layers = 0, or loaded with load_mtp=False)")
        if num_tokens < 1:
            raise SpeculativeError(f"MTP drafting needs num_speculative_tokens >= 1, got {num_tokens}")
        self.model = model
        self.runner = runner
        self._k = num_tokens
        # seq_id -> (last observed position j, the module's output there: it predicts token j + 2)
        self._state: dict[str, tuple[int, torch.Tensor]] = {}

    @property
    def max_draft_tokens(self) -> int:
        return self._k

    def _forward(self, batch: AttentionBatch, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        plan = self.runner.backend.plan_attention(batch, self.runner.spec)
        ctx = ForwardContext(plan, self.runner.kv_caches)
        ids = torch.tensor(next_ids, dtype=torch.int64, device=hidden.device)
        return self.model.forward_mtp(0, ids, hidden, ctx)

    @torch.inference_mode()
    def observe(self, observations: list[Observation], hidden: torch.Tensor, captured: tuple[torch.Tensor, ...]) -> None:
        if not observations:
            return
        rows = torch.tensor([o.rows + i for o in observations for i in range(o.count)], device=hidden.device)
        batch = AttentionBatch(tuple(o.count for o in observations), tuple(o.start + o.count for o in observations),
                               tuple(o.block_table for o in observations))
        out = self._forward(batch, [t for o in observations for t in o.next_ids], hidden.index_select(0, rows))
        end = 0
        for o in observations:
            end += o.count
            self._state[o.seq_id] = (o.start + o.count - 1, out[end - 1].clone())

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        live = [i for i, r in enumerate(requests)
                if r.max_tokens > 0 and self._state.get(r.seq_id, (None,))[0] == r.position - 1]
        if not live:
            return proposals
        hidden = torch.stack([self._state[requests[i].seq_id][1] for i in live])
        probs: dict[int, list[torch.Tensor | None]] = {i: [] for i in live}
        step = 0
        while live:
            reqs = [requests[i] for i in live]
            logits = self.model.mtp[0].logits(hidden)
            tokens, qs = choose_rows(logits, [r.params for r in reqs], [r.seed for r in reqs],
                                     [r.position + 1 + step for r in reqs])
            for i, t, q in zip(live, tokens, qs):
                proposals[i].tokens.append(t)
                probs[i].append(q)
            step += 1
            keep = [j for j, r in enumerate(reqs) if r.max_tokens > step]
            if not keep:
                break
            live = [live[j] for j in keep]
            # The module at position p + step - 1 reads (its previous output, d_step) and predicts d_{step+1}.
            batch = AttentionBatch((1,) * len(keep), tuple(reqs[j].position + step for j in keep),
                                   tuple(reqs[j].block_table for j in keep))
            hidden = self._forward(batch, [tokens[j] for j in keep], hidden[keep])
        for i, qs in probs.items():
            if qs and qs[0] is not None:
                proposals[i].probs = torch.stack(qs)
        return proposals

    def release(self, seq_id: str) -> None:
        self._state.pop(seq_id, None)
