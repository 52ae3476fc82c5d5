"""Argument checks for backend ops: raise InvalidInputError with a message naming the argument.

Ops are called per layer, so these checks look at metadata (dtype, shape, device); value checks that need a
device-to-host copy (expert ids, group sizes) are left to the reference backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from deepinfer.errors import InvalidInputError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check `t` is a tensor with the given rank, dtype, shape (None = any size) and device."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise InvalidInputError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise InvalidInputError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; expected one of: {allowed}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise InvalidInputError(f"{name} has shape {list(t.shape)}; expected {want}")
    if device is not None and not same_device(t.device, device):
        raise InvalidInputError(f"{name} is on {t.device}; expected {device}")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    """Devices match by type, and by index where both name one (cuda == cuda:0 on a one-GPU process)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def check_same_length(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, dim: int = 0) -> None:
    if a.shape[dim] != b.shape[dim]:
        raise InvalidInputError(
            f"{name_a} and {name_b} disagree on dimension {dim}: {a.shape[dim]} vs {b.shape[dim]}"
        )
