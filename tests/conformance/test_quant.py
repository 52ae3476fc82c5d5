"""core/quant.py's formats: FP8 128x128 block weights, per-token-group FP8 activations, NVFP4 weights."""

from __future__ import annotations

import pytest
import torch

from deepinfer import quant
from deepinfer.errors import InvalidInputError
from deepinfer.weights import LinearWeight, WeightFormat

FP8 = quant.FP8_DTYPE
SHAPES = [(1, 1), (1, 200), (136, 200), (128, 128), (256, 384), (33, 17), (129, 257)]


def _rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _fp8_error_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Worst e4m3 round-to-nearest error of w / scale, in w's units: half a relative ulp (2^-4) for normal
    numbers, half the subnormal step (2^-10) near zero; plus float32 slack."""
    return w.abs() * 2.0**-4 + scale * 2.0**-10 + w.abs() * 1e-6


@pytest.mark.parametrize("shape", SHAPES + [(3, 136, 200)])
def test_fp8_block_round_trip(shape, gen):
    w = _rand(gen, *shape, scale=0.05)
    q, scale_inv = quant.quantize_fp8_block(w)
    n, k = shape[-2:]
    assert q.dtype == FP8 and q.shape == w.shape
    assert scale_inv.dtype == torch.float32
    assert scale_inv.shape == (*shape[:-2], quant.cdiv(n, 128), quant.cdiv(k, 128))
    # scale_inv is the block's amax / 448, so each block's largest value lands on e4m3's maximum.
    b = 128
    wp = torch.nn.functional.pad(w.abs(), (0, -k % b, 0, -n % b))
    amax = wp.reshape(*shape[:-2], wp.shape[-2] // b, b, wp.shape[-1] // b, b).amax(dim=(-3, -1))
    torch.testing.assert_close(scale_inv, amax / 448.0, rtol=1e-6, atol=0)
    deq = quant.dequantize_fp8_block(q, scale_inv)
    per_elem = scale_inv.repeat_interleave(b, -2).repeat_interleave(b, -1)[..., :n, :k]
    err = (deq - w).abs()
    assert (err <= _fp8_error_bound(w, per_elem)).all()
    # Relative to the block granularity (amax/448 is one unit of e4m3's top binade /32): at most 16 units.
    assert (err <= per_elem * 16 * (1 + 1e-6)).all()


def test_fp8_block_constant_block_is_exact(gen):
    w = torch.full((130, 140), 0.375)
    q, s = quant.quantize_fp8_block(w)
    assert torch.equal(quant.dequantize_fp8_block(q, s), w)


@pytest.mark.parametrize("shape", [(1, 200), (33, 128), (5, 7, 300), (2, 1)])
def test_fp8_per_token_group_round_trip(shape, gen):
    x = _rand(gen, *shape, scale=3.0)
    x[..., 0] *= 50  # uneven magnitudes across groups
    q, scale = quant.quantize_fp8_per_token_group(x)
    k = shape[-1]
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.shape == (*shape[:-1], quant.cdiv(k, 128))
    groups = torch.nn.functional.pad(x.abs(), (0, -k % 128)).unflatten(-1, (-1, 128)).amax(-1)
    torch.testing.assert_close(scale, groups / 448.0, rtol=1e-6, atol=0)
    deq = quant.dequantize_fp8_per_token_group(q, scale)
    per_elem = scale.repeat_interleave(128, -1)[..., :k]
    assert ((deq - x).abs() <= _fp8_error_bound(x, per_elem)).all()


E2M1 = torch.tensor(quant.E2M1_VALUES, dtype=torch.float64)
E2M1_SIGNED = torch.cat([E2M1, -E2M1])


@pytest.mark.parametrize("shape", [(1, 16), (1, 1), (136, 200), (33, 17), (3, 8, 40)])
def test_nvfp4_round_trip_is_nearest_representable(shape, gen):
    w = _rand(gen, *shape)
    w[..., 0] *= 20  # blocks of very different magnitude share one global scale
    packed, bs, gs = quant.quantize_nvfp4(w)
    k = shape[-1]
    kb = quant.cdiv(k, 16)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], kb * 8)
    assert bs.dtype == FP8 and bs.shape == (*shape[:-1], kb)
    assert gs.dtype == torch.float32 and gs.shape == shape[:-2]
    # The global scale lets the largest block scale reach e4m3's max.
    torch.testing.assert_close(gs, w.abs().flatten(-2).amax(-1) / (6 * 448), rtol=1e-6, atol=0)
    deq = quant.dequantize_nvfp4(packed, bs, gs, k)
    assert deq.shape == w.shape and deq.dtype == torch.float32

    # Every value is exactly e2m1 * block_scale * global_scale (computed in float32 as the format defines).
    scale32 = (bs.float() * gs.float().reshape(*shape[:-2], 1, 1)).repeat_interleave(16, -1)[..., :k]
    nearest_code = (deq.double()[..., None] / scale32.double()[..., None].clamp(min=1e-300) - E2M1_SIGNED).abs().argmin(-1)
    assert torch.equal(deq, E2M1_SIGNED.float()[nearest_code] * scale32)

    # Given its block scale, each value is the nearest representable one (brute force over all 15 values, float64).
    scale64 = bs.double().repeat_interleave(16, -1)[..., :k] * gs.double().reshape(*shape[:-2], 1, 1)
    best = (w.double()[..., None] - E2M1_SIGNED * scale64[..., None]).abs().amin(-1)
    assert ((w.double() - deq.double()).abs() <= best + 1e-6 * scale64).all()

    # Block scales are e4m3 roundings of block amax / 6 / global scale (within half an e4m3 ulp).
    wp = torch.nn.functional.pad(w.abs(), (0, -k % 16)).unflatten(-1, (-1, 16)).amax(-1).double()
    target = wp / 6 / gs.double().reshape(*shape[:-2], 1, 1)
    assert ((bs.double() - target).abs() <= target * 2.0**-4 + 2.0**-10).all()


def test_nvfp4_packing_order_by_hand():
    # amax 6 -> global scale 6/(6*448), block scale 448 (exact in e4m3): the scaled values are the inputs.
    w = torch.zeros(1, 16)
    w[0, :4] = torch.tensor([6.0, 0.5, -1.0, 2.0])
    w[0, 15] = -3.0
    packed, bs, gs = quant.quantize_nvfp4(w)
    assert bs.float().item() == 448.0
    # Codes: 6 -> 7, 0.5 -> 1, -1 -> 0b1010, 2 -> 4, 0 -> 0, -3 -> 0b1101; element 2i in the low nibble.
    assert packed[0].tolist() == [0x17, 0x4A, 0, 0, 0, 0, 0, 0xD0]
    # And the other way: a hand-packed byte with unit scales.
    hand = torch.tensor([[0x17, 0xA4] + [0] * 6], dtype=torch.uint8)
    deq = quant.dequantize_nvfp4(hand, torch.ones(1, 1).to(FP8), torch.tensor(1.0), 16)
    assert deq[0, :4].tolist() == [6.0, 0.5, 2.0, -1.0]
    assert deq[0, 4:].abs().sum().item() == 0.0


def test_nvfp4_dequantize_cuts_odd_k(gen):
    w = _rand(gen, 4, 21)
    lw = LinearWeight.quantize(w, "nvfp4")
    assert lw.data.shape == (4, 16) and lw.dequantize().shape == (4, 21)
    assert lw.in_features == 21 and lw.out_features == 4 and lw.num_groups == 1


@pytest.mark.parametrize("fmt", list(WeightFormat))
def test_linear_weight_quantize_shapes(fmt, gen):
    w = _rand(gen, 3, 136, 200)
    lw = LinearWeight.quantize(w, fmt)
    assert lw.format is fmt and lw.num_groups == 3 and lw.out_features == 136 and lw.in_features == 200
    assert lw.dequantize().shape == w.shape
    rel = (lw.dequantize() - w).norm() / w.norm()
    assert rel < {WeightFormat.DENSE: 1e-7, WeightFormat.FP8_BLOCK: 0.05, WeightFormat.NVFP4: 0.15}[fmt]


def test_linear_weight_constructors_reject_bad_inputs(gen):
    w = _rand(gen, 136, 200)
    q, s = quant.quantize_fp8_block(w)
    packed, bs, gs = quant.quantize_nvfp4(w)
    bad = [
        lambda: LinearWeight.dense(w.to(torch.int32)),
        lambda: LinearWeight.dense(w[0]),  # 1-D
        lambda: LinearWeight.dense(w.reshape(1, 1, 136, 200)),  # 4-D
        lambda: LinearWeight.dense(q),  # fp8 is not a dense dtype
        lambda: LinearWeight.fp8_block(w, s),  # float weight
        lambda: LinearWeight.fp8_block(q, s[:1]),  # scale shape
        lambda: LinearWeight.fp8_block(q, s.reshape(-1)),
        lambda: LinearWeight.nvfp4(packed.to(torch.int8), bs, gs, 200),
        lambda: LinearWeight.nvfp4(packed, bs, gs, 300),  # packed width disagrees with in_features
        lambda: LinearWeight.nvfp4(packed, bs.float(), gs, 200),  # block scale dtype
        lambda: LinearWeight.nvfp4(packed, bs[:, :-1], gs, 200),
        lambda: LinearWeight.nvfp4(packed, bs, gs.reshape(1), 200),  # global scale shape
    ]
    for make in bad:
        with pytest.raises(InvalidInputError):
            make()
    with pytest.raises(ValueError):  # an unknown format name fails in WeightFormat(...)
        LinearWeight.quantize(w, "int4")
