"""Expert load recorder: per-layer, per-logical-expert token counts over a sliding window of engine steps.

Counts stay on the device (no host sync in the forward): the step in progress adds into one fixed tensor with
index_add_, which advance() moves into a ring buffer [window, layers, experts]; the balancer reads the
window's sum when it considers a rebalance. Each rank records its own tokens; the balancer sums the ranks'
windows. Nothing the forward touches moves between steps, so a CUDA graph may hold the recording; rows past
set_rows(n) (a graph's padding) are not counted.
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
        # The last `window_size` finished steps (a ring; _slot is the oldest), and the step in progress.
        self._counts = torch.zeros(window_size, num_layers, num_experts, dtype=torch.int64, device=device)
        self._slot = 0
        self._current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._rows = torch.full((), 2**40, dtype=torch.int64, device=device)  # rows counted: all, until set_rows
        self.steps = 0  # steps recorded since start-up (or the last reset)

    @property
    def window_size(self) -> int:
        return self._counts.shape[0]

    def set_rows(self, rows: int) -> None:
        """Count only the first `rows` tokens of the next forward's layers (a padded graph replay's real ones)."""
        self._rows.fill_(rows)

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count this step's expert choices [T, k] (logical ids) for MoE layer position `layer`."""
        flat = topk_ids.reshape(-1)
        if not flat.numel():
            return
        # Positions made here, not cached: a graph would hold a cached tensor that a larger step replaces.
        positions = torch.arange(flat.numel(), dtype=torch.int64, device=self._current.device)
        real = positions < self._rows * topk_ids.shape[1]
        row = self._current[layer]
        row.index_add_(0, flat.to(row.device, torch.int64), real.to(torch.int64))

    def hook(self, layer: int) -> Callable[[torch.Tensor], None]:
        """A per-layer callback for the MoE layer (it need not know its position among MoE layers)."""
        return lambda topk_ids: self.record(layer, topk_ids)

    def advance(self) -> None:
        """Close the current step: it enters the window, and the oldest step leaves it."""
        self._counts[self._slot].copy_(self._current)  # over the oldest
        self._current.zero_()
        self._slot = (self._slot + 1) % self._counts.shape[0]
        self.steps += 1

    def discard_current(self) -> None:
        """Forget what the step in progress recorded (dummy forwards, such as a graph capture's warm-up)."""
        self._current.zero_()

    def window_load(self) -> torch.Tensor:
        """Token counts [layers, experts] of the last `window_size` finished steps and the one in progress
        (int64, on the recorder's device)."""
        return self._counts.sum(0) + self._current

    def reset(self) -> None:
        self._counts.zero_()
        self._current.zero_()
        self.steps = 0
