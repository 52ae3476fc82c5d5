"""Host lists to device tensors (deepinfer.transfer): values, dtypes and the split into rows survive packing."""

from __future__ import annotations

import pytest
import torch

from deepinfer.transfer import to_device, to_device_many


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_to_device_many_splits_rows_back(gen, dtype):
    rows = [torch.randint(-2**30, 2**30, (int(n),), generator=gen).tolist() for n in torch.randint(0, 50, (5,), generator=gen)]
    rows.insert(2, [])  # an empty row in the middle keeps its place
    out = to_device_many(rows, dtype, "cpu")
    assert [t.dtype for t in out] == [dtype] * len(rows)
    assert [t.tolist() for t in out] == rows


def test_to_device_many_all_empty():
    out = to_device_many([[], []], torch.int64, "cpu")
    assert [t.numel() for t in out] == [0, 0]


def test_to_device_keeps_floats(gen):
    values = torch.randn(7, generator=gen, dtype=torch.float64).tolist()
    assert to_device(values, torch.float64, "cpu").tolist() == values
