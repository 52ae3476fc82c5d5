"""The weights-as-M FP8 GEMM (cuda_sm100 gemm_wm): a decode step's few rows against E4M3 block weights, one matrix
or rows sorted by expert, against the reference backend's math. Runs on the GPU, or on CPU under the Triton
interpreter."""

from __future__ import annotations

import pytest
import torch

from deepinfer import quant
from deepinfer.backends.reference import gemm as ref_gemm
from deepinfer.ops import silu_and_mul
from deepinfer.weights import LinearWeight


@pytest.fixture
def wm():
    from deepinfer.backends.cuda_sm100 import gemm_wm

    return gemm_wm


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out.shape == ref.shape
    return ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


# The output's bf16 rounding, plus (GPU) E4M3 tensor cores summing each 128-wide block with ~14 bits.
TOL = {torch.bfloat16: 8e-3, torch.float16: 3e-3}


def _fp8_rows(x: torch.Tensor, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantised per token per 128 columns (E4M3 rows and scales) as the reference backend and quant_fp8 do."""
    q, s = quant.quantize_fp8_per_token_group(x.float())
    return q.to(dev), s.to(dev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,k,n", [(1, 256, 200), (3, 384, 64), (16, 128, 130), (20, 256, 72), (33, 128, 64)])
def test_one_matrix_matches_the_reference(cuda_backend, gen, wm, dtype, rows, k, n):
    """N not a multiple of the tile's 64 columns (nor of the 128-row scale blocks), more rows than one 16-row tile;
    scales column-major, as quant_fp8 stores them for the GEMMs."""
    dev = cuda_backend.device
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = LinearWeight.quantize((torch.randn(n, k, generator=gen) / k**0.5).to(dtype), "fp8_block")
    ref = ref_gemm.linear(x, w)  # quantises x per token group, like _fp8_rows
    q, s = _fp8_rows(x, dev)
    out = wm.launch(q, s.t().contiguous().t(), w.to(dev), torch.empty(rows, n, dtype=dtype, device=dev))
    assert _rel_err(out, ref) < TOL[dtype]
    if dev.type == "cuda":
        assert wm.usable(q, s, w.to(dev)) == (rows <= wm.WM_MAX_ROWS)


@pytest.mark.parametrize("sizes", [[1, 0, 1, 1, 0, 0, 1], [0, 2, 0, 1, 3], [1], [17, 0, 2, 1]],
                         ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("gated", [False, True])
def test_grouped_rows_match_the_per_group_reference(cuda_backend, gen, wm, sizes, gated):
    """Rows sorted by expert (empty groups, a group of more rows than a tile takes), each times its expert's weight,
    plain or as gate/up with SiLU-and-mul."""
    dev = cuda_backend.device
    groups, m, k, n = len(sizes), sum(sizes), 384, 192
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = LinearWeight.quantize((torch.randn(groups, 2 * n if gated else n, k, generator=gen) / k**0.5).bfloat16(),
                              "fp8_block").to(dev)
    ref = ref_gemm.grouped_linear(x, w.to("cpu"), torch.tensor(sizes))
    if gated:
        ref = silu_and_mul(ref)
    q, s = _fp8_rows(x, dev)
    sizes_dev = torch.tensor(sizes, dtype=torch.int64, device=dev)
    out = wm.launch(q, s, w, torch.empty(m, n, dtype=torch.bfloat16, device=dev), sizes_dev, gated=gated)
    # Gated: gate and up are each rounded to bf16 before silu(gate) * up is (here and in the reference), so a
    # tensor-core difference that flips one of those roundings moves the product by up to a few bf16 ulps.
    assert _rel_err(out, ref) < TOL[torch.bfloat16] * (2 if gated else 1)
    if dev.type == "cuda":
        assert wm.usable(q, s, w, gated=gated)


def test_takes_only_what_it_computes(cuda_backend, gen, wm, monkeypatch):
    """E4M3 rows with scales, E4M3 block weights with K a multiple of 128, at most 32 rows a matrix; not 16-bit
    rows, dense weights, K off the blocks, more rows, or DEEPINFER_WM=0; and gemm.linear sends a few 16-bit rows
    here once quant_fp8 has quantised them, the same bits as the kernel called directly."""
    from deepinfer.backends.cuda_sm100 import gemm

    dev = cuda_backend.device
    if dev.type != "cuda":
        pytest.skip("the predicates take GPU tensors only")
    x = torch.randn(3, 256, generator=gen).bfloat16()
    q, s = _fp8_rows(x, dev)
    w = LinearWeight.quantize(torch.randn(64, 256, generator=gen).bfloat16(), "fp8_block").to(dev)
    assert wm.usable(q, s, w)
    assert not wm.usable(q, None, w) and not wm.usable(x.to(dev), s, w)
    assert wm.usable(torch.cat([q] * 10), torch.cat([s] * 10), w)
    assert not wm.usable(torch.cat([q] * 11), torch.cat([s] * 11), w)
    assert not wm.usable(q, s, LinearWeight.dense(w.dequantize().bfloat16()))
    w_odd = LinearWeight.quantize(torch.randn(64, 200, generator=gen).bfloat16(), "fp8_block").to(dev)
    assert not wm.usable(*_fp8_rows(torch.randn(1, 200, generator=gen), dev), w_odd)
    direct = wm.launch(q, s, w, torch.empty(3, 64, dtype=torch.bfloat16, device=dev))
    assert torch.equal(gemm.linear(x.to(dev), w), direct)
    monkeypatch.setenv("DEEPINFER_WM", "0")
    assert not wm.usable(q, s, w)
    assert _rel_err(gemm.linear(x.to(dev), w), direct) < TOL[torch.bfloat16]
