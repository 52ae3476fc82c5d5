"""overlap.resolve_inputs: a step's input ids with the in-flight step's sampled tokens in place of its
pending_input() entries, against plain Python on fresh random steps, and which fast path each kind takes."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.overlap import pending_input, resolve_inputs


def _expected(input_ids: list[int], pending: list[int]) -> list[int]:
    return [pending[-1 - i] if i < 0 else i for i in input_ids]


@pytest.mark.parametrize("kind", ["in_order", "permuted", "mixed", "none_pending", "no_step_in_flight"])
def test_resolve_inputs_matches_plain_python(kind):
    rng = random.Random()  # fresh draws each run
    for _ in range(50):
        rows = rng.randint(1, 40)
        pending = torch.randint(0, 1000, (rows,)).tolist()
        n = rng.randint(1, rows)
        if kind == "in_order":
            input_ids = [pending_input(r) for r in range(n)]
        elif kind == "permuted":
            input_ids = [pending_input(r) for r in rng.sample(range(rows), n)]
        elif kind == "mixed":
            input_ids = [pending_input(rng.randrange(rows)) if rng.random() < 0.5 else rng.randrange(1000)
                         for _ in range(n)] + [pending_input(0), 7]
        else:
            input_ids = [rng.randrange(1000) for _ in range(n)]
        tokens = None if kind == "no_step_in_flight" else torch.tensor(pending, dtype=torch.int64)
        out = resolve_inputs(input_ids, tokens, "cpu")
        assert out.dtype == torch.int64 and out.tolist() == (input_ids if tokens is None else _expected(input_ids, pending))
        if kind == "in_order":  # a view of the sampled tokens: no copy, no kernel
            assert out.data_ptr() == tokens.data_ptr()


def test_resolve_inputs_of_an_empty_step():
    assert resolve_inputs([], torch.tensor([3, 4]), "cpu").tolist() == []
