"""Test drafters and engine helpers for the speculative decoding tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.spec.drafter import Drafter, DraftRequest, Observation, Proposal
from deepinfer.spec.draws import draw
from deepinfer.spec.prefix_scheduler import PrefixScheduler
from deepinfer.spec.speculator import Speculator

from engine_loop import reference_engine, run_to_completion


class ScriptedDrafter(Drafter):
    """Drafts the known continuation of each sequence, each token replaced by a random one with probability
    `noise` (keyed by sequence, position and index, so it does not depend on the batch): high acceptance,
    with rejections at every position, to exercise multi-token acceptance in the engine."""

    name = "scripted"

    def __init__(self, continuations: dict[str, list[int]], k: int, vocab: int, noise: float = 0.3,
                 confidence: bool = False):
        self.continuations, self._k, self.vocab, self.noise = continuations, k, vocab, noise
        self.has_confidence = confidence

    @property
    def max_draft_tokens(self) -> int:
        return self._k

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            full = self.continuations.get(r.seq_id, [])
            tokens, probs, conf = [], [], []
            for i in range(r.max_tokens):
                rng = random.Random(f"{r.seq_id}:{r.position}:{i}")
                truth = full[r.position + 1 + i] if r.position + 1 + i < len(full) else rng.randrange(self.vocab)
                q = torch.full((self.vocab,), self.noise / self.vocab)
                q[truth] += 1.0 - self.noise
                if r.params.greedy:
                    tokens.append(truth if rng.random() >= self.noise else rng.randrange(self.vocab))
                else:
                    tokens.append(draw(q, r.seed, r.position + 1 + i, "draft"))
                    probs.append(q)
                conf.append(0.2 + 0.75 * rng.random())
            out.append(Proposal(tokens, torch.stack(probs) if probs else None, conf if self.has_confidence else None))
        return out

    def observe(self, observations: list[Observation], hidden: torch.Tensor, captured: tuple[torch.Tensor, ...]) -> None:
        pass


class RecordingDrafter(Drafter):
    """Wraps a drafter and keeps every (request, proposal) it made."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name, self.capture_layers, self.has_confidence = inner.name, inner.capture_layers, inner.has_confidence
        self.calibration = getattr(inner, "calibration", None)
        self.log: list[tuple[DraftRequest, Proposal]] = []

    @property
    def max_draft_tokens(self) -> int:
        return self.inner.max_draft_tokens

    def propose(self, requests):
        proposals = self.inner.propose(requests)
        self.log += list(zip(requests, proposals))
        return proposals

    def observe(self, observations, hidden, captured):
        self.inner.observe(observations, hidden, captured)

    def fork(self, parent_id, child_id, num_tokens):
        self.inner.fork(parent_id, child_id, num_tokens)

    def release(self, seq_id):
        self.inner.release(seq_id)


def engine(path: Path, speculator=None, **options) -> LLMEngine:
    options.setdefault("batch_invariant", True)
    options.setdefault("kv_cache_memory", 1 << 24)
    return reference_engine(path, speculator, **options)


def run(engine: LLMEngine, requests) -> dict[str, object]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return run_to_completion(engine)


def scripted_speculator(continuations, k: int, vocab: int, mode: str = "fixed", **kw) -> Speculator:
    drafter = ScriptedDrafter(continuations, k, vocab, confidence=mode != "fixed")
    return Speculator(RecordingDrafter(drafter), PrefixScheduler(mode, **kw))
