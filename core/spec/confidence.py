"""The DSpark confidence head and its Sequential Temperature Scaling (STS) calibration.

Head (paper eq. 7): c_k = sigmoid(w . [h_k ; W1[x_{k-1}]]), the probability that draft token k survives
verification given that tokens 1..k-1 did, trained on the soft label 1 - TV(p_draft, p_target) (eq. 8).

The prefix scheduler needs absolute survival probabilities a_k = prod_{i<=k} c_i, not just a ranking, so
the raw scores are calibrated on held-out drafts: for k = 1..K in order, a 1-D grid search picks the
temperature T_k of c_k -> sigmoid(logit(c_k) / T_k) that minimises the ECE of a_k against the observed
survival (tokens 1..k all accepted), the already calibrated positions < k held fixed. Temperature scaling
preserves each position's ranking.

Outcomes may be observed survival (0/1) or expected survival: given the drafts, token k survives with
probability prod_{i<k} min(1, p_i(d_i) / q_i(d_i)) * (1 - TV(p_k, q_k)), the same mean for every confidence
value with far less noise, so a fit on a few thousand drafts does not chase sampling noise (the ECE of a
perfectly calibrated predictor against 0/1 outcomes is about 2% at that size).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deepinfer.errors import ConfigError

ECE_BINS = 10
_EPS = 1e-6


class ConfidenceHead(nn.Module):
    """sigmoid(w . [h ; e] + b) over the backbone hidden h and the Markov embedding e of the previous token."""

    def __init__(self, hidden_size: int, markov_rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + markov_rank, 1)

    def logit(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, markov_embedding], dim=-1)).squeeze(-1)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(hidden, markov_embedding))


def expected_calibration_error(pred: torch.Tensor, outcome: torch.Tensor, bins: int = ECE_BINS) -> float:
    """Equal-width-bin ECE (Naeini et al. 2015): sum over bins of |bin| / N * |mean pred - mean outcome|."""
    pred, outcome = pred.double().flatten(), outcome.double().flatten()
    if pred.numel() == 0:
        return 0.0
    index = (pred * bins).long().clamp(0, bins - 1)
    count = torch.bincount(index, minlength=bins).double()
    gap = torch.bincount(index, weights=pred - outcome, minlength=bins).abs()
    return float(gap.sum() / count.sum())


def survival_labels(accepted: torch.Tensor, verified: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(survived [N, K] 0/1 float, known [N, K] bool): token k survived iff accepted >= k; the outcome is known
    when token k was verified or an earlier token was already rejected."""
    k = torch.arange(1, positions + 1)
    survived = (accepted[:, None] >= k[None, :]).double()
    known = (verified[:, None] >= k[None, :]) | (accepted < verified)[:, None]
    return survived, known


def _scale(conf: torch.Tensor, temperature: float) -> torch.Tensor:
    c = conf.double().clamp(_EPS, 1 - _EPS)
    return torch.sigmoid(torch.log(c / (1 - c)) / temperature)


@dataclass(frozen=True)
class STSCalibration:
    temperatures: tuple[float, ...]  # T_k per draft position

    def calibrate(self, conf: torch.Tensor) -> torch.Tensor:
        """Raw confidences [..., n] (n <= K) -> calibrated conditional confidences, same shape."""
        n = conf.shape[-1]
        if n > len(self.temperatures):
            raise ConfigError(f"calibration covers {len(self.temperatures)} positions, got confidences for {n}")
        out = [_scale(conf[..., k], self.temperatures[k]) for k in range(n)]
        return torch.stack(out, dim=-1).to(conf.dtype) if out else conf

    def calibrate_list(self, conf: list[float]) -> list[float]:
        """calibrate() for one draft's few confidences in plain float64 math (no tensor ops: the engine calls
        this per request per step)."""
        if len(conf) > len(self.temperatures):
            raise ConfigError(f"calibration covers {len(self.temperatures)} positions, got confidences for {len(conf)}")
        out = []
        for c, t in zip(conf, self.temperatures):
            c = min(max(float(c), _EPS), 1 - _EPS)
            z = math.log(c / (1 - c)) / t
            out.append(1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z)))
        return out

    def to_json(self) -> dict:
        return {"method": "sequential_temperature_scaling", "temperatures": list(self.temperatures)}

    @classmethod
    def from_json(cls, data: dict) -> STSCalibration:
        temps = data.get("temperatures")
        if data.get("method") != "sequential_temperature_scaling" or not isinstance(temps, list) or not temps:
            raise ConfigError(f"not an STS calibration: {data!r}")
        if any(not isinstance(t, (int, float)) or not t > 0 for t in temps):
            raise ConfigError(f"STS temperatures must be positive numbers, got {temps!r}")
        return cls(tuple(float(t) for t in temps))

    def save(self, path: Path, extra: dict | None = None) -> None:
        path.write_text(json.dumps({**self.to_json(), **(extra or {})}, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> STSCalibration:
        return cls.from_json(json.loads(path.read_text(encoding="utf-8")))


def survival_ece(conf: torch.Tensor, survived: torch.Tensor, known: torch.Tensor,
                 calibration: STSCalibration | None = None) -> list[float]:
    """Per-position ECE of the cumulative survival a_k against (observed or expected) survival [N, K], over
    drafts whose outcome at k is known. conf [N, K] raw confidences."""
    positions = conf.shape[1]
    c = calibration.calibrate(conf) if calibration is not None else conf
    a = torch.cumprod(c.double(), dim=1)
    return [expected_calibration_error(a[known[:, k], k], survived[known[:, k], k].double()) for k in range(positions)]


def fit_sts(conf: torch.Tensor, survived: torch.Tensor, known: torch.Tensor,
            grid: torch.Tensor | None = None) -> STSCalibration:
    """Fit per-position temperatures left to right (see the module docstring)."""
    if conf.dim() != 2 or conf.shape[0] == 0:
        raise ConfigError(f"STS needs confidences [N > 0, K], got shape {tuple(conf.shape)}")
    grid = grid if grid is not None else torch.logspace(math.log10(0.05), math.log10(20.0), 241)
    positions = conf.shape[1]
    prefix = torch.ones(conf.shape[0], dtype=torch.float64)
    temps: list[float] = []
    for k in range(positions):
        rows = known[:, k]
        best_t, best = 1.0, math.inf
        for t in grid.tolist():
            a = prefix[rows] * _scale(conf[rows, k], t)
            err = expected_calibration_error(a, survived[rows, k].double())
            if err < best - 1e-12:
                best_t, best = t, err
        temps.append(best_t)
        prefix = prefix * _scale(conf[:, k], best_t)
    return STSCalibration(tuple(temps))
