"""An MoE's combine handed on unformed (ExpertSum) to the residual add and norm after it, on every backend.

- ops.add_rms_norm on an ExpertSum against the sum by its definition (float64) then the reference add + norm.
- combine(defer=True) then add_rms_norm gives, bit for bit, what combine() then add_rms_norm gives: a backend
  that forms the sum in the norm's launch forms the same sum.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import InvalidInputError
from deepinfer.ops import ExpertSum
from deepinfer.ops.norm import add_rms_norm as reference_add_rms_norm
from deepinfer.quant import FP8_BLOCK, Fp8Activations

EPS = 1e-6


def _defined_sum(es: ExpertSum) -> torch.Tensor:
    """add[t] + sum_j w[t, j] * rows[row[t, j]] (rows of -1 left out), float64 on the CPU, rounded to es.dtype."""
    rows, row_of_pair, w = es.rows.cpu().double(), es.row_of_pair.cpu(), es.weights.cpu().double()
    out = torch.zeros(es.shape, dtype=torch.float64) if es.add is None else es.add.cpu().double()
    for t in range(row_of_pair.shape[0]):
        for j in range(row_of_pair.shape[1]):
            if row_of_pair[t, j] >= 0:
                out[t] += w[t, j] * rows[row_of_pair[t, j]]
    return out.to(es.dtype)


def _dequantized(a: Fp8Activations) -> torch.Tensor:
    data, scale = a.data.cpu().float(), a.scale.cpu()
    return data * scale.repeat_interleave(FP8_BLOCK, dim=1)[:, : data.shape[1]]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    got, want = got.cpu().double(), want.cpu().double()
    assert got.shape == want.shape
    assert ((got - want).abs() <= rtol * (want.abs() + want.abs().max())).all()


@pytest.mark.parametrize("t,k", [(1, 8), (5, 3), (40, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("quantize", [False, True])
def test_norm_forms_an_expert_sum(backend, gen, t, k, dtype, with_add, quantize):
    dev, h = backend.device, 320  # not a power of two, and a partial FP8 group
    rows = t * k + 3
    row_of_pair = torch.randint(-1, rows, (t, k), generator=gen, dtype=torch.int32)  # -1: a dropped pair
    es = ExpertSum(torch.randn(rows, h, generator=gen).to(dtype).to(dev), row_of_pair.to(dev),
                   (torch.rand(t, k, generator=gen) + 0.1).to(dev), dtype,
                   torch.randn(t, h, generator=gen).to(dtype).to(dev) if with_add else None)
    residual = torch.randn(t, h, generator=gen).to(dtype).to(dev)
    weight = (torch.rand(h, generator=gen) + 0.5).to(dev)
    want_x = _defined_sum(es)
    want_normed, want_summed = reference_add_rms_norm(want_x, residual.cpu(), weight.cpu(), EPS)
    rtol = 1e-5 if dtype == torch.float32 else 2**-7  # the float32 sum may round the other way from float64's
    _close(es.evaluate(), want_x, rtol)
    normed, summed = backend.ops.add_rms_norm(es, residual, weight, EPS, quantize=quantize)
    assert summed.dtype == dtype and summed.shape == (t, h)
    _close(summed, want_summed, rtol)
    if quantize:
        assert isinstance(normed, Fp8Activations) and normed.dtype == dtype
        _close(_dequantized(normed), want_normed, 2**-4 + rtol)  # e4m3: 3 mantissa bits
    else:
        assert normed.dtype == dtype
        _close(normed, want_normed, 2 * rtol)


@pytest.mark.parametrize("t,k,e", [(1, 8, 66), (6, 6, 20), (70, 2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("quantize", [False, True])
def test_deferred_combine_equals_the_formed_one(backend, gen, t, k, e, dtype, with_add, quantize):
    dev, h = backend.device, 256
    x = torch.randn(t, h, generator=gen).to(dtype).to(dev)
    ids = torch.rand(t, e, generator=gen).topk(k, dim=-1).indices.to(dev)
    weights = (torch.rand(t, k, generator=gen) + 0.1).to(dev)
    add = torch.randn(t, h, generator=gen).to(dtype).to(dev) if with_add else None
    residual = torch.randn(t, h, generator=gen).to(dtype).to(dev)
    norm_w = (torch.rand(h, generator=gen) + 0.5).to(dev)
    d = backend.dispatch(x, ids, weights, e).wait()
    y = torch.randn(d.hidden.shape, generator=gen).to(dtype).to(dev)  # the experts' output rows
    formed = backend.combine(d, y, add=add).wait()
    deferred = backend.combine(d, y, add=add, defer=True).wait()
    assert deferred.shape == formed.shape and deferred.dtype == formed.dtype
    if backend.name == "cuda_sm100":  # its local combine defers: the norm's kernel forms the sum
        assert isinstance(deferred, ExpertSum)
    want_normed, want_summed = backend.ops.add_rms_norm(formed, residual, norm_w, EPS, quantize=quantize)
    normed, summed = backend.ops.add_rms_norm(deferred, residual, norm_w, EPS, quantize=quantize)
    assert torch.equal(summed.cpu(), want_summed.cpu())
    if quantize:
        assert torch.equal(normed.data.cpu().view(torch.uint8), want_normed.data.cpu().view(torch.uint8))
        assert torch.equal(normed.scale.cpu(), want_normed.scale.cpu())
    else:
        assert torch.equal(normed.cpu(), want_normed.cpu())


def test_norm_forms_an_expert_sum_with_every_pair_dropped(backend, gen):
    """No expert rows at all (every pair dropped): the sum is the shared output alone."""
    dev, t, h = backend.device, 3, 128
    add = torch.randn(t, h, generator=gen).to(dev)
    es = ExpertSum(torch.empty(0, h, device=dev), torch.full((t, 2), -1, dtype=torch.int32, device=dev),
                   torch.rand(t, 2, generator=gen).to(dev), torch.float32, add)
    residual = torch.randn(t, h, generator=gen).to(dev)
    weight = (torch.rand(h, generator=gen) + 0.5).to(dev)
    want_normed, want_summed = reference_add_rms_norm(add.cpu(), residual.cpu(), weight.cpu(), EPS)
    normed, summed = backend.ops.add_rms_norm(es, residual, weight, EPS)
    _close(summed, want_summed, 1e-6)
    _close(normed, want_normed, 1e-5)


def test_a_malformed_expert_sum_is_refused(gen):
    rows, pairs, weights = torch.randn(6, 16, generator=gen), torch.zeros(2, 3, dtype=torch.int32), torch.rand(2, 3)
    for bad in (dict(row_of_pair=pairs.float()), dict(weights=weights[:, :2]), dict(rows=rows[0]),
                dict(add=torch.randn(2, 15, generator=gen)), dict(dtype=torch.int32)):
        parts = dict(rows=rows, row_of_pair=pairs, weights=weights, dtype=torch.float32, add=None) | bad
        with pytest.raises(InvalidInputError):
            ExpertSum(**parts)


def test_combine_kernel_with_every_pair_dropped(backend, gen):
    """cuda_sm100's formed combine (also expert parallelism's) over no expert rows at all: the shared output."""
    if backend.name != "cuda_sm100":
        pytest.skip("cuda_sm100's combine kernel")
    from deepinfer.backends.cuda_sm100.moe_comm import weighted_gather

    dev, t, h = backend.device, 3, 96
    add = torch.randn(t, h, generator=gen).to(dev)
    out = weighted_gather(torch.empty(0, h, device=dev), torch.full((t, 2), -1, dtype=torch.int32, device=dev),
                          torch.rand(t, 2, generator=gen).to(dev), torch.float32, add)
    assert torch.equal(out.cpu(), add.cpu())
