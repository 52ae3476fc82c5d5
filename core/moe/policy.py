"""When to rebalance: every N steps, or when the recorded load makes the current placement too imbalanced.

Every rank runs the same trigger on the same step count and (after the balancer sums the ranks' windows)
the same load, so all ranks reach the same decision without extra messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.errors import ConfigError
from deepinfer.moe.placement import imbalance


@dataclass(frozen=True)
class EPLBConfig:
    """window_size: steps of load the recorder keeps; step_interval: rebalance every this many steps (0: never
    on a schedule); imbalance_threshold: also rebalance when the busiest GPU's modelled load over the mean
    exceeds it (None: off) and a new placement would cut it by min_gain, checked every check_interval steps;
    num_redundant_experts: extra physical slots."""

    window_size: int = 1000
    step_interval: int = 3000
    imbalance_threshold: float | None = None
    check_interval: int = 50
    num_redundant_experts: int = 0
    min_gain: float = 0.05  # a threshold-triggered rebalance must cut the imbalance by this fraction

    def __post_init__(self) -> None:
        if self.window_size < 1:
            raise ConfigError(f"eplb window_size must be >= 1, got {self.window_size}")
        if self.step_interval < 0:
            raise ConfigError(f"eplb step_interval must be >= 0, got {self.step_interval}")
        if self.imbalance_threshold is not None and self.imbalance_threshold < 1.0:
            raise ConfigError(f"eplb imbalance_threshold is max/mean GPU load, so >= 1.0; got {self.imbalance_threshold}")
        if self.check_interval < 1:
            raise ConfigError(f"eplb check_interval must be >= 1, got {self.check_interval}")
        if self.min_gain < 0:
            raise ConfigError(f"eplb min_gain must be >= 0, got {self.min_gain}")
        if self.num_redundant_experts < 0:
            raise ConfigError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.step_interval == 0 and self.imbalance_threshold is None:
            raise ConfigError("EPLB needs a trigger: a step_interval > 0 or an imbalance_threshold")


class RebalanceTrigger:
    def __init__(self, config: EPLBConfig):
        self.config = config
        self.since_rebalance = 0

    def tick(self) -> str | None:
        """Count one step; says whether the load must be read now: "interval", "check" or None."""
        self.since_rebalance += 1
        c = self.config
        if c.step_interval and self.since_rebalance >= c.step_interval:
            return "interval"
        if c.imbalance_threshold is not None and self.since_rebalance % c.check_interval == 0:
            return "check"
        return None

    def worth_checking(self, reason: str, phy2log: torch.Tensor, load: torch.Tensor, num_gpus: int) -> bool:
        """With the window's load [layers, E] in hand: is a new placement worth computing?"""
        if float(load.sum()) == 0:
            return False  # nothing routed in the window: no evidence to move weights for
        if reason == "interval":
            return True
        threshold = self.config.imbalance_threshold
        return threshold is not None and imbalance(phy2log, load, num_gpus) > threshold

    def decide(self, reason: str, phy2log: torch.Tensor, candidate: torch.Tensor, load: torch.Tensor, num_gpus: int) -> str | None:
        """The reason to switch to `candidate`, or None to keep the placement. Weights never move to a placement
        that is no better on the window. Past the threshold the switch must also pay min_gain: a skew no
        placement can fix (one expert hotter than a GPU's share, no spare slot) would otherwise move weights
        at every check."""
        current, after = imbalance(phy2log, load, num_gpus), imbalance(candidate, load, num_gpus)
        if reason == "interval":
            return f"every {self.config.step_interval} steps ({current:.3f} -> {after:.3f})" if after < current else None
        if after * (1.0 + self.config.min_gain) <= current:
            return f"imbalance {current:.3f} > {self.config.imbalance_threshold} (new placement: {after:.3f})"
        return None

    def rebalanced(self) -> None:
        self.since_rebalance = 0
