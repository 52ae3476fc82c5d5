"""GatedMLP with FP8 block weights whose intermediate size is off the 128 grid (V2-Lite's dense MLP: 10944):
padded with zero channels so gate and up run as one projection, it must give what the separate projections,
silu_and_mul and the unpadded down projection give, on every backend."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.mlp import GatedMLP
from deepinfer.weights import LinearWeight


@pytest.mark.parametrize("inter", [200, 136, 256])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_mlp_off_the_block_grid_runs_fused_and_exact(backend, gen, inter, tokens, dtype):
    dev, h = backend.device, 256
    gate, up = (LinearWeight.quantize(torch.randn(inter, h, generator=gen) / h**0.5, "fp8_block").to(dev)
                for _ in range(2))
    down = LinearWeight.quantize(torch.randn(h, inter, generator=gen) / inter**0.5, "fp8_block").to(dev)
    mlp = GatedMLP(backend, gate, up, down)
    padded = -(-inter // 128) * 128
    assert mlp.gate_up is not None and mlp.gate_up.out_features == 2 * padded and mlp.down.in_features == padded
    # The stored values: gate, up and down as given, zero channels after each (in their scales' partial block).
    gu, d = mlp.gate_up.to(torch.device("cpu")).dequantize(), mlp.down.to(torch.device("cpu")).dequantize()
    for half, w in ((gu[:padded], gate), (gu[padded:], up)):
        assert torch.equal(half[:inter], w.to(torch.device("cpu")).dequantize()) and not half[inter:].any()
    assert torch.equal(d[:, :inter], down.to(torch.device("cpu")).dequantize()) and not d[:, inter:].any()
    x = torch.randn(tokens, h, generator=gen).to(dtype).to(dev)
    # The unpadded computation, projection by projection.
    act = backend.ops.silu_and_mul(torch.cat([backend.linear(x, gate), backend.linear(x, up)], dim=-1))
    want = backend.linear(act, down).float().cpu()
    got = mlp.forward(x).float().cpu()
    assert got.shape == (tokens, h)
    # Zero channels add exact zeros; only the summation order of a padded GEMM may differ (and a bf16 output's
    # rounding of gate/up with it).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got - want).abs().max() / want.abs().max()).item() < tol
