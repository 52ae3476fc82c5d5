"""Draft traces from real speculative decoding, and the STS calibration fitted on them.

Calibration data comes from the engine itself, decoding prompts with the DSpark drafter verifying whole
blocks (threshold 0) at temperature 1, so every draft's survival at every position is observed under the
distribution the scheduler will meet: drafts conditioned on the model's own output, rejection sampling.
STS is fitted on the expected survival of each draft (see confidence.py); ECE is reported against both
the expected and the observed (0/1) survival.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.spec.confidence import STSCalibration, fit_sts, survival_ece, survival_labels
from deepinfer.spec.dspark_model import CALIBRATION_FILE
from deepinfer.spec.metrics import DraftTrace, SpecDecodeStats


@dataclass(frozen=True)
class TraceSet:
    confidence: torch.Tensor  # [N, K] raw confidences
    accepted: torch.Tensor  # [N]
    verified: torch.Tensor  # [N]
    expected: torch.Tensor  # [N, K] expected survival of every token (whole blocks verified)

    @classmethod
    def from_traces(cls, traces: list[DraftTrace], positions: int) -> TraceSet:
        # Whole blocks only: drafts cut short (max_len) have no outcome for their last positions.
        full = [t for t in traces if len(t.confidence) == positions and len(t.expected_survival) == positions]
        n = len(full)
        conf = torch.tensor([t.confidence for t in full], dtype=torch.float64).view(n, positions)
        expected = torch.tensor([t.expected_survival for t in full], dtype=torch.float64).view(n, positions)
        return cls(conf, torch.tensor([t.accepted for t in full]), torch.tensor([t.verified for t in full]), expected)

    def outcomes(self, expected: bool) -> tuple[torch.Tensor, torch.Tensor]:
        survived, known = survival_labels(self.accepted, self.verified, self.confidence.shape[1])
        return (self.expected, torch.ones_like(known)) if expected else (survived, known)

    def ece(self, calibration: STSCalibration | None = None, expected: bool = False) -> list[float]:
        """Per-position survival ECE against observed (0/1) or expected survival."""
        return survival_ece(self.confidence, *self.outcomes(expected), calibration)


def prompts_from_stream(stream: torch.Tensor, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens at random places of a token stream (deterministic given seed)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, max(1, stream.numel() - length), (count,), generator=gen)
    return [stream[s : s + length].tolist() for s in starts.tolist()]


def collect_traces(target_dir: Path, drafter_dir: Path, prompts: list[list[int]], max_tokens: int, *,
                   temperature: float = 1.0, seed: int = 0, max_num_seqs: int = 16,
                   **engine_options) -> tuple[TraceSet, SpecDecodeStats]:
    """Decode `prompts` with whole-block DSpark verification and record every draft."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(target_dir, speculative_engine="dspark", dspark_model=str(drafter_dir), dspark_confidence_threshold=0.0,
              max_num_seqs=max_num_seqs, progress=False, **engine_options)
    spec = llm.engine.speculator
    spec.metrics.record_traces = True
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate(prompts, params)
    return TraceSet.from_traces(spec.metrics.traces, spec.drafter.max_draft_tokens), spec.metrics.snapshot()


def calibrate(traces: TraceSet) -> tuple[STSCalibration, dict]:
    """Fit STS on expected survival; report per-position ECE before and after, on the same traces."""
    calibration = fit_sts(traces.confidence, *traces.outcomes(expected=True))
    report: dict = {"drafts": int(traces.confidence.shape[0]), "fitted_to": "expected survival"}
    for label, expected in (("", True), ("_observed", False)):
        before, after = traces.ece(expected=expected), traces.ece(calibration, expected=expected)
        report.update({f"ece_before{label}": before, f"ece_after{label}": after,
                       f"mean_ece_before{label}": sum(before) / len(before),
                       f"mean_ece_after{label}": sum(after) / len(after)})
    return calibration, report


def write_calibration(folder: Path, calibration: STSCalibration, report: dict) -> Path:
    path = Path(folder) / CALIBRATION_FILE
    calibration.save(path, {"fitted_on": report})
    return path


def read_report(folder: Path) -> dict | None:
    path = Path(folder) / CALIBRATION_FILE
    return json.loads(path.read_text(encoding="utf-8")).get("fitted_on") if path.exists() else None
