"""Expert load recorder: per-layer, per-logical-expert token counts over a sliding window of engine steps.

Counts stay on the device in a ring buffer [window, layers, experts] updated with index_add_ (no host sync
in the forward); the balancer reads the window's sum when it considers a rebalance. Each rank records its
own tokens; the balancer sums the ranks' windows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.errors import InvalidInputError


class ExpertLoadRecorder:
    def __init__(self, num_layers: int, num_experts: int, window_size: int, device: torch.device | str = "cpu"):
        if window_size <= 0 or num_layers <= 0 or num_experts <= 0:
            raise InvalidInputError(f"window_size, num_layers and num_experts must be positive, got {window_size}, {num_layers}, {num_experts}")
        self.num_experts = num_experts
        # One slot more than the window: the step in progress, beside the last `window_size` finished ones.
        self._counts = torch.zeros(window_size + 1, num_layers, num_experts, dtype=torch.int64, device=device)
        self._slot = 0
        self.steps = 0  # steps recorded since start-up (or the last reset)

    @property
    def window_size(self) -> int:
        return self._counts.shape[0] - 1

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count this step's expert choices [T, k] (logical ids) for MoE layer position `layer`."""
        flat = topk_ids.reshape(-1)
        if flat.numel():
            row = self._counts[self._slot, layer]
            row.index_add_(0, flat.to(row.device, torch.int64), torch.ones_like(flat, dtype=torch.int64, device=row.device))

    def hook(self, layer: int) -> Callable[[torch.Tensor], None]:
        """A per-layer callback for the MoE layer (it need not know its position among MoE layers)."""
        return lambda topk_ids: self.record(layer, topk_ids)

    def advance(self) -> None:
        """Close the current step: the oldest step leaves the window."""
        self._slot = (self._slot + 1) % self._counts.shape[0]
        self._counts[self._slot].zero_()
        self.steps += 1

    def window_load(self) -> torch.Tensor:
        """Token counts [layers, experts] of the last `window_size` finished steps and the one in progress
        (int64, on the recorder's device)."""
        return self._counts.sum(0)

    def reset(self) -> None:
        self._counts.zero_()
        self.steps = 0
