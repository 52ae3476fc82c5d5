"""Speculator: a drafter, a prefix scheduler and the metrics, as the engine's step uses them.

Built from EngineConfig by `build_speculator`:
  speculative_engine="mtp"    the checkpoint's MTP module chained for num_speculative_tokens (default 1)
  speculative_engine="dspark" the DSpark drafter in dspark_model (default: <model>/dspark), block of
                              num_speculative_tokens (default: the drafter's block size); verification length
                              by dspark_confidence_threshold when set (0 verifies the whole block), else by
                              Algorithm 1 over the SPS table profiled at start-up (one step-time curve per
                              sequence count, read at the step's count; cached on disk) or the curve given
                              in speculative_sps_table.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.errors import ConfigError
from deepinfer.spec.drafter import Drafter, DraftRequest, Observation, Proposal
from deepinfer.spec.metrics import SpecDecodeMetrics
from deepinfer.spec.prefix_scheduler import PrefixScheduler
from deepinfer.spec.sps_profile import (SPSCurve, SPSTable, cache_key, default_cache_dir, load_or_profile,
                                        profile_table, runner_step_timer, seq_grid, step_time)
from deepinfer.spec.verifier import VerifyResult

logger = logging.getLogger(__name__)

DSPARK_SUBFOLDER = "dspark"


@dataclass
class Draft:
    """What the target verifies for one sequence: the cut proposal, plus what the drafter first proposed."""

    proposal: Proposal
    num_proposed: int
    raw_confidence: list[float] | None


class Speculator:
    def __init__(self, drafter: Drafter, scheduler: PrefixScheduler, metrics: SpecDecodeMetrics | None = None):
        self.drafter = drafter
        self.scheduler = scheduler
        self.metrics = metrics or SpecDecodeMetrics(drafter.max_draft_tokens)
        self.step_overhead = 0.0  # seconds per step outside the target forward (moving average), for Algorithm 1
        self._steps_timed = 0
        self._last_seqs: int | None = None  # sequences of the step proposed last

    def step_done(self, seconds: float, num_tokens: int) -> None:
        """A whole engine step took `seconds` for a forward of num_tokens: learn the time the SPS profile (the
        forward alone) leaves out."""
        if self.scheduler.curve is None:
            return
        rest = max(0.0, seconds - step_time(self.scheduler.curve, num_tokens, self._last_seqs))
        self._steps_timed += 1
        weight = max(0.05, 1.0 / self._steps_timed)  # a plain mean at first, then an exponential average
        self.step_overhead += weight * (rest - self.step_overhead)

    @property
    def num_lookahead_slots(self) -> int:
        return self.drafter.max_draft_tokens

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.capture_layers)

    def propose(self, requests: list[DraftRequest], base_tokens: int, base_accepts: int) -> dict[str, Draft]:
        """Drafts for the sequences that got any, cut to their verification lengths. base_tokens / base_accepts:
        the step's tokens and sampled tokens before speculation (Algorithm 1's starting point)."""
        if not requests:
            return {}
        started = time.perf_counter()
        proposals = self.drafter.propose(requests)  # the tokens come back as host lists: the time is the drafting's
        self.metrics.record_draft_time(time.perf_counter() - started)
        calib = getattr(self.drafter, "calibration", None)
        confidences: list[list[float] | None] = []
        for p in proposals:
            if p.confidence is None or not p.tokens:
                confidences.append(None)
            elif calib is not None:
                confidences.append(calib.calibrate_list(p.confidence))
            else:
                confidences.append(list(p.confidence))
        self._last_seqs = max(1, int(base_accepts))
        lengths = self.scheduler.lengths(confidences, [len(p.tokens) for p in proposals], base_tokens, base_accepts,
                                         self.step_overhead, num_seqs=self._last_seqs)
        drafts = {}
        for req, p, n in zip(requests, proposals, lengths):
            if p.tokens:
                drafts[req.seq_id] = Draft(p.truncate(n), len(p.tokens), p.confidence)
        return drafts

    def record(self, draft: Draft, result: VerifyResult) -> None:
        self.metrics.record(draft.num_proposed, len(draft.proposal.tokens), result.num_accepted, draft.raw_confidence,
                            result.expected_survival)

    def observe(self, observations: list[Observation], hidden: torch.Tensor, captured: tuple[torch.Tensor, ...]) -> None:
        self.drafter.observe(observations, hidden, captured)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        self.drafter.fork(parent_id, child_id, num_tokens)

    def release(self, seq_id: str) -> None:
        self.drafter.release(seq_id)


def _sps_curve(engine_config, runner, draft_len: int, backend_name: str) -> SPSCurve | SPSTable:
    """The user's table (one curve over tokens), else a table over (tokens, sequences) profiled at start-up:
    one curve per sequence count R in seq_grid(max_num_seqs), B = R .. R (1 + k) tokens (cached on disk)."""
    if engine_config.speculative_sps_table:
        return SPSCurve(tuple((int(b), float(t)) for b, t in engine_config.speculative_sps_table))
    seqs = seq_grid(engine_config.max_num_seqs)
    cache_dir = None if engine_config.speculative_sps_cache == "off" else (
        Path(engine_config.speculative_sps_cache) if engine_config.speculative_sps_cache else default_cache_dir())
    key = cache_key(engine_config.model, backend_name, str(runner.model.embed_tokens.dtype), runner.spec.dtype,
                    draft_len, [[r, draft_len] for r in seqs], runner.backend.device)
    timer = runner_step_timer(runner, draft_len)
    curve, cached = load_or_profile(cache_dir, key, lambda: profile_table(timer, seqs, draft_len))
    logger.info("SPS table (%s): %s", "cached" if cached else "profiled",
                "; ".join(f"R={r}: " + ", ".join(f"B={b}: {1 / t:.1f}/s" for b, t in c.points) for r, c in curve.rows))
    return curve


def build_speculator(engine_config, model, runner, backend_name: str = "") -> Speculator | None:
    """The speculator EngineConfig asks for, or None without speculative_engine."""
    kind = engine_config.speculative_engine
    if kind is None:
        return None
    k = engine_config.num_speculative_tokens
    threshold = engine_config.dspark_confidence_threshold
    if kind == "mtp":
        from deepinfer.spec.mtp_drafter import MTPDrafter

        if threshold is not None:
            raise ConfigError("dspark_confidence_threshold needs speculative_engine='dspark' (MTP has no confidence head)")
        return Speculator(MTPDrafter(model, runner, k or 1), PrefixScheduler("fixed"))
    if kind != "dspark":
        raise ConfigError(f"speculative_engine must be 'mtp', 'dspark' or None, got {kind!r}")
    from deepinfer.spec.dspark_drafter import DSparkDrafter

    folder = Path(engine_config.dspark_model) if engine_config.dspark_model else Path(engine_config.model) / DSPARK_SUBFOLDER
    drafter = DSparkDrafter.from_folder(folder, model, k)
    if threshold is not None:
        scheduler = PrefixScheduler("threshold", threshold=threshold)
    else:
        scheduler = PrefixScheduler("hardware", curve=_sps_curve(engine_config, runner, drafter.max_draft_tokens, backend_name))
    return Speculator(drafter, scheduler)
