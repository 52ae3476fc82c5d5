"""A local MoE combine handed on unformed, for the residual add and norm after it to form in their own launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class ExpertSum:
    """out[t] = add[t] + sum_j weights[t, j] * rows[row_of_pair[t, j]], in one float32 sum (add first, then the
    choices in order; a row of -1 adds nothing) rounded once to `dtype`.

    Backend.combine(..., defer=True) may return one where its combine is a local gather; FusedOps.add_rms_norm
    takes it as its x, so the layer after an MoE forms the sum, the residual add and the norm in one launch.

    rows [R, H]: the experts' output rows; row_of_pair [T, K] int; weights [T, K] float32; add [T, H] or None.
    The other parts were written before the launches that wrote `rows` (the routing and the shared experts run
    before the routed experts' GEMMs): a backend whose kernels start before their predecessor ends (programmatic
    dependent launch) may read them before waiting for `rows`.
    """

    rows: torch.Tensor
    row_of_pair: torch.Tensor
    weights: torch.Tensor
    dtype: torch.dtype
    add: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("expert rows", self.rows, ndim=2, dtypes=FLOAT_DTYPES)
        dev = self.rows.device
        check_tensor("row_of_pair", self.row_of_pair, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
        check_tensor("pair weights", self.weights, shape=tuple(self.row_of_pair.shape), dtypes=FLOAT_DTYPES, device=dev)
        if self.dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"an expert sum's dtype must be a float dtype, got {self.dtype}")
        if self.add is not None:
            check_tensor("add", self.add, shape=tuple(self.shape), dtypes=FLOAT_DTYPES, device=dev)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.row_of_pair.shape[0], self.rows.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def evaluate(self) -> torch.Tensor:
        """The sum as a [T, H] tensor of `dtype`, by the definition (reference math)."""
        live = self.row_of_pair >= 0
        rows = self.rows.float() if self.rows.shape[0] else self.rows.new_zeros(1, self.rows.shape[1])  # none live
        picked = rows[self.row_of_pair.clamp(min=0).long()]  # [T, K, H]
        out = torch.where(live[..., None], picked * self.weights.float()[..., None], 0.0).sum(1)
        if self.add is not None:
            out = out + self.add.float()
        return out.to(self.dtype)
