"""The warp-specialised Gluon FP8 GEMM (Hopper, large M) against float64 math on the same quantised inputs and
against the Triton tile kernel it replaces there. GPU only: Gluon has no interpreter (test_gluon_compile.py
builds it for sm_90 on any machine)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import quant
from deepinfer.weights import LinearWeight


@pytest.fixture
def dev():
    from deepinfer.backends.cuda_sm100 import gluon_gate

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda")
    if not gluon_gate.runs_on(device, "gemm_gluon_kernels"):
        pytest.skip("the Gluon GEMM runs on Hopper with Triton 3.6")
    return device


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    return ((out - ref).abs().max() / ref.abs().max()).item()


# (M, K, N): ragged M (a partial last row tile), a partial last K block (448), N not a multiple of 128 (2112,
# DeepSeek-V3's q/kv_a), enough tiles for every CTA to take several (persistent loop, ring across tiles).
SHAPES = [(256, 512, 384), (333, 448, 2112), (1000, 7168, 1024), (4096, 1536, 2048)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", ["column_major", "row_major"])
@pytest.mark.parametrize("consumers", [2, 3])
def test_gluon_fp8_gemm_matches_float64_and_tile_kernel(dev, gen, m, k, n, out_dtype, scales, consumers):
    from deepinfer.backends.cuda_sm100 import gemm, gemm_gluon

    x = torch.randn(m, k, generator=gen)
    w = LinearWeight.quantize(torch.randn(n, k, generator=gen) / k**0.5, "fp8_block").to(dev)
    xq, xs = gemm.quantize_fp8(x.to(dev), column_major_scales=scales == "column_major")
    out = torch.empty(m, n, dtype=out_dtype, device=dev)
    assert gemm_gluon.fp8_ws_usable(xq, xs, w.data, w.scale, out, max(m, gemm_gluon.MIN_ROWS))
    gemm_gluon.launch_fp8_ws(xq, xs, w.data, w.scale, out, consumers=consumers)
    ref = quant.dequantize_fp8_per_token_group(xq.cpu(), xs.cpu()).double() @ w.to(torch.device("cpu")).dequantize().double().t()
    # bf16 output rounding (2^-9) on top of the FP8 tensor cores' accumulation (test_gemm.py's 2e-3)
    assert _rel_err(out, ref) < 2e-3 + 2.0**-8
    tile = gemm.fp8_gemm(xq, xs, w, out_dtype=out_dtype, cfg=gemm.pick_config(m, n, k, 1, 0, dev))
    assert _rel_err(out, tile) < 2.0**-7
    # what linear() serves
    assert _rel_err(gemm.fp8_gemm(xq, xs, w, out_dtype=out_dtype), out) < 2.0**-7


def test_gluon_fp8_gemm_is_not_taken_where_it_does_not_apply(dev, gen):
    from deepinfer.backends.cuda_sm100 import gemm, gemm_gluon

    k, n, m = 512, 256, gemm_gluon.MIN_ROWS
    w = LinearWeight.quantize(torch.randn(n, k, generator=gen), "fp8_block").to(dev)
    xq, xs = gemm.quantize_fp8(torch.randn(m, k, generator=gen).to(dev), column_major_scales=True)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    assert gemm_gluon.fp8_ws_usable(xq, xs, w.data, w.scale, out, m)
    assert not gemm_gluon.fp8_ws_usable(xq[:64], xs[:64], w.data, w.scale, out[:64], 64)  # small M: tile kernel
    assert not gemm_gluon.fp8_ws_usable(xq, xs, w.data, w.scale, out.float(), m)  # float32 output
    padded = torch.empty(m, k + 8, dtype=xq.dtype, device=dev)[:, :k]  # rows 520 bytes apart: not TMA-aligned
    assert not gemm_gluon.fp8_ws_usable(padded, xs, w.data, w.scale, out, m)
    w3 = LinearWeight.quantize(torch.randn(64, n, k, generator=gen), "fp8_block").to(dev)
    assert not gemm_gluon.fp8_ws_usable(xq, xs, w3.data, w3.scale, out, m, groups=64)  # 16 rows a group: tile kernel


def _sizes(gen, groups: int, rows: int) -> torch.Tensor:
    """Random group sizes summing to rows, some groups empty."""
    cut = torch.sort(torch.randint(0, rows + 1, (groups - 1,), generator=gen)).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cut, torch.tensor([rows])]))
    sizes[torch.randint(1, groups, (1,), generator=gen)] += sizes[0]  # an empty first group, its rows elsewhere
    sizes[0] = 0
    return sizes


@pytest.mark.parametrize("groups,rows,k,n", [(16, 1000, 448, 384), (8, 3000, 1024, 2112)])
@pytest.mark.parametrize("consumers", [2, 3])
def test_gluon_grouped_fp8_gemm_matches_float64_and_tile_kernel(dev, gen, groups, rows, k, n, consumers):
    """Contiguous layout: each group's rows against its own weight, rows of a tile past its group's end left to
    the next group (masked stores), empty groups skipped."""
    from deepinfer.backends.cuda_sm100 import gemm, gemm_gluon

    sizes = _sizes(gen, groups, rows)
    x = torch.randn(rows, k, generator=gen)
    w = LinearWeight.quantize(torch.randn(groups, n, k, generator=gen) / k**0.5, "fp8_block").to(dev)
    xq, xs = gemm.quantize_fp8(x.to(dev), column_major_scales=True)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=dev)
    gemm_gluon.launch_fp8_ws(xq, xs, w.data, w.scale, out, group_sizes=sizes.to(dev), consumers=consumers)
    xd = quant.dequantize_fp8_per_token_group(xq.cpu(), xs.cpu()).double()
    wd = w.to(torch.device("cpu")).dequantize().double()
    ref = torch.cat([xd[s:e] @ wd[g].t() for g, (s, e) in enumerate(zip(sizes.cumsum(0) - sizes, sizes.cumsum(0)))])
    assert not out.isnan().any()  # every row written
    assert _rel_err(out, ref) < 2e-3 + 2.0**-8
    tile = gemm.grouped_linear(xq, w, sizes.to(dev), x_scale=xs, cfg=gemm.pick_config(64, n, k, 1, 1, dev))
    assert _rel_err(out, tile) < 2.0**-7
    if rows >= max(gemm_gluon.MIN_ROWS, gemm_gluon.MIN_GROUP_ROWS * groups):  # what grouped_linear serves here
        assert gemm_gluon.fp8_ws_usable(xq, xs, w.data, w.scale, out, rows, groups)
        assert _rel_err(gemm.grouped_linear(xq, w, sizes.to(dev), x_scale=xs), out) < 2.0**-7


@pytest.mark.parametrize("grouped", [False, True])
def test_gluon_fp8_gemm_replays_in_a_cuda_graph(dev, gen, grouped):
    """Captured once (descriptors encoded at capture, the tile map in the graph's pool), replayed on new inputs
    and group sizes written in place: the eager result each time (speculative verification steps reach M >= MIN_ROWS
    inside decode graphs)."""
    from deepinfer.backends.cuda_sm100 import gemm, gemm_gluon

    groups, rows, k, n = 4, 2048, 512, 384
    shape = (groups, n, k) if grouped else (n, k)
    w = LinearWeight.quantize(torch.randn(*shape, generator=gen) / k**0.5, "fp8_block").to(dev)
    xq, xs = gemm.quantize_fp8(torch.randn(rows, k, generator=gen).to(dev), column_major_scales=True)
    sizes = _sizes(gen, groups, rows).to(dev) if grouped else None
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    run = lambda: gemm_gluon.launch_fp8_ws(xq, xs, w.data, w.scale, out, group_sizes=sizes)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(2):
        q2, s2 = gemm.quantize_fp8(torch.randn(rows, k, generator=gen).to(dev), column_major_scales=True)
        xq.copy_(q2)
        xs.copy_(s2)
        if grouped:
            sizes.copy_(_sizes(gen, groups, rows).to(dev))
        graph.replay()
        replayed = out.clone()
        run()
        assert torch.equal(replayed, out)


@pytest.mark.parametrize("m,k,n,split", [(100, 1088, 384, 2), (128, 1088, 2112, 3), (65, 2048, 256, 4)])
def test_gluon_fp8_gemm_split_k_matches_float64_and_tile_kernel(dev, gen, m, k, n, split):
    """K in slices (a partial last K block, uneven slices, ragged N), float32 partials summed by the reduction."""
    from deepinfer.backends.cuda_sm100 import gemm, gemm_gluon

    x = torch.randn(m, k, generator=gen)
    w = LinearWeight.quantize(torch.randn(n, k, generator=gen) / k**0.5, "fp8_block").to(dev)
    xq, xs = gemm.quantize_fp8(x.to(dev), column_major_scales=True)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    gemm_gluon.launch_fp8_ws(xq, xs, w.data, w.scale, out, consumers=2, split=split)
    ref = quant.dequantize_fp8_per_token_group(xq.cpu(), xs.cpu()).double() @ w.to(torch.device("cpu")).dequantize().double().t()
    assert _rel_err(out, ref) < 2e-3 + 2.0**-8
    tile = gemm.fp8_gemm(xq, xs, w, cfg=gemm.pick_config(m, n, k, 1, 0, dev))
    assert _rel_err(out, tile) < 2.0**-7


def test_small_m_calls_take_the_split_kernel_under_capture(dev, gen):
    """A 128-row matrix with long K: the tile kernel eagerly, two K slices of this kernel in a captured graph (whose
    replays follow new inputs); both within the FP8 noise of each other."""
    from deepinfer.backends.cuda_sm100 import gemm, gemm_gluon

    m, k, n = 128, gemm_gluon.LONG_K, 256
    w = LinearWeight.quantize(torch.randn(n, k, generator=gen) / k**0.5, "fp8_block").to(dev)
    xq, xs = gemm.quantize_fp8(torch.randn(m, k, generator=gen).to(dev), column_major_scales=True)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    assert gemm_gluon.small_m_split(xq, xs, w.data, w.scale, out, m, 132) == 0  # eager: not taken
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm.fp8_gemm(xq, xs, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert gemm_gluon.small_m_split(xq, xs, w.data, w.scale, out, m, 132) == 2
        graphed = gemm.fp8_gemm(xq, xs, w)
    for _ in range(2):
        q, s = gemm.quantize_fp8(torch.randn(m, k, generator=gen).to(dev), column_major_scales=True)
        xq.copy_(q)
        xs.copy_(s)
        graph.replay()
        ref = quant.dequantize_fp8_per_token_group(xq.cpu(), xs.cpu()).double() @ w.to(torch.device("cpu")).dequantize().double().t()
        assert _rel_err(graphed, ref) < 2e-3 + 2.0**-8
        assert _rel_err(graphed, gemm.fp8_gemm(xq, xs, w)) < 2.0**-7
