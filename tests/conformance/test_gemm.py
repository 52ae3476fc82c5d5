"""linear / grouped_linear of every usable backend against float64 math on the CPU."""

from __future__ import annotations

import pytest
import torch

from deepinfer import quant
from deepinfer.errors import InvalidInputError
from deepinfer.weights import LinearWeight

SHAPES = [(1, 200, 136), (33, 200, 136), (7, 128, 128), (16, 384, 256), (5, 17, 3), (2, 1, 1), (40, 300, 130)]  # (M, K, N)
FORMATS = ["dense", "fp8_block", "nvfp4"]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the output's largest magnitude (both brought to float64 on the CPU)."""
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out.shape == ref.shape
    return ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item() if ref.numel() else 0.0


def _tol(backend, fmt: str) -> float:
    """Allowed max error relative to the output's largest magnitude (see _rel_err).

    A GPU's FP8 tensor cores add products with about 14 significant bits before DeepSeek's per-128-block
    promotion to float32 (DeepSeek-V3 report, section 3.3.2), so there an FP8 GEMM matches float64 math on
    the same quantised inputs only to ~2^-10 of its partial sums; everywhere else float32 accumulation
    holds it to 1e-5.
    """
    return 2e-3 if fmt == "fp8_block" and backend.device.type == "cuda" else 1e-5


def _norm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def _quant_x_ref(x: torch.Tensor) -> torch.Tensor:
    """x as the FP8 path sees it: quantised per token per 128 channels, dequantised, float64."""
    return quant.dequantize_fp8_per_token_group(*quant.quantize_fp8_per_token_group(x.cpu())).double()


def _reference(x: torch.Tensor, lw: LinearWeight) -> torch.Tensor:
    """Exact float64 product of what the format defines: quantised activations for FP8, raw ones otherwise."""
    xr = _quant_x_ref(x) if lw.format.value == "fp8_block" else x.cpu().double()
    return xr @ lw.to(torch.device("cpu")).dequantize().double().transpose(-1, -2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_matches_float64(backend, gen, fmt, m, k, n):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    lw = LinearWeight.quantize(w, fmt).to(backend.device)
    out = backend.linear(x.to(backend.device), lw)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.device.type == backend.device.type
    assert _rel_err(out, _reference(x, lw)) < _tol(backend, fmt)
    if fmt == "fp8_block":  # against the unquantised product, within FP8's precision
        exact = x.double() @ w.double().t()
        # e4m3 rounds x and w each to within 2^-4 relatively (plus a subnormal floor per 128-block scale).
        floor = 2.0**-10 * (x.abs().max() * w.abs().sum(1).max() + w.abs().max() * x.abs().sum(1).max()) / 448
        assert ((out.cpu().double() - exact).abs() <= (x.abs().double() @ w.abs().double().t()) * 0.13 + floor).all()
        if k >= 128:  # enough terms for the rounding errors to average out
            # The error's norm is ~0.037 of the output's (e4m3's rounding of x and of w, each ~0.026 RMS). One
            # row draws its activations' rounding once for every output, so there it spreads wider: 6,000 draws
            # of 1 x 200 x 136 gave 0.0369 +- 0.0033, with three above 0.05. A wrong scale gives ~1.
            assert _norm_err(out, exact) < 6.5e-2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lead", [(2, 3), (3, 100)])  # 300 rows: the large-M tiles (ragged past 256 rows on a GPU)
def test_linear_bf16_input_and_leading_dims(backend, gen, fmt, lead):
    x = torch.randn(*lead, 200, generator=gen).bfloat16()
    lw = LinearWeight.quantize(torch.randn(136, 200, generator=gen).bfloat16(), fmt).to(backend.device)
    out = backend.linear(x.to(backend.device), lw)
    assert out.shape == (*lead, 136) and out.dtype == torch.bfloat16
    # Only the final rounding to bf16 separates the output from the exact product.
    ref = _reference(x.reshape(-1, 200).float(), lw).reshape(*lead, 136)
    assert ((out.cpu().double() - ref).abs() <= ref.abs() * 2.0**-8 + _tol(backend, fmt) * ref.abs().max()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_empty_batch(backend, gen, fmt):
    lw = LinearWeight.quantize(torch.randn(136, 200, generator=gen), fmt).to(backend.device)
    out = backend.linear(torch.randn(0, 200, generator=gen).to(backend.device), lw)
    assert out.shape == (0, 136) and out.dtype == torch.float32
    if fmt == "fp8_block":  # pre-quantised activations of no tokens too
        dev = backend.device
        empty = quant.Fp8Activations(torch.empty(0, 200, dtype=quant.FP8_DTYPE, device=dev),
                                     torch.empty(0, 2, device=dev), torch.bfloat16)
        out = backend.linear(empty, lw)
        assert out.shape == (0, 136) and out.dtype == torch.bfloat16


def test_linear_fp16_dense_weight(backend, gen):
    x = torch.randn(9, 130, generator=gen).half()
    w = torch.randn(70, 130, generator=gen).half()
    out = backend.linear(x.to(backend.device), LinearWeight.dense(w.to(backend.device)))
    assert out.dtype == torch.float16
    assert _rel_err(out, x.double() @ w.double().t()) < 2e-3


def _grouped_reference(x: torch.Tensor, lw: LinearWeight, sizes: list[int]) -> torch.Tensor:
    outs, start = [], 0
    w = lw.to(torch.device("cpu"))
    for g, size in enumerate(sizes):
        xg = x[start : start + size]
        start += size
        if size:  # (the core quantiser cannot take an empty batch)
            xr = _quant_x_ref(xg) if w.format.value == "fp8_block" else xg.double()
            outs.append(xr @ w.dequantize()[g].double().t())
    return torch.cat(outs) if outs else torch.zeros(0, w.out_features, dtype=torch.float64)


GROUPINGS = [[3, 0, 5, 1], [0, 0, 9, 0], [1], [0, 4, 0, 0, 2, 7], [0, 0, 0]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", GROUPINGS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("k,n", [(200, 136), (128, 64), (33, 17)])
def test_grouped_linear_matches_per_group_loop(backend, gen, fmt, sizes, k, n):
    e, m = len(sizes), sum(sizes)
    x = torch.randn(m, k, generator=gen)
    lw = LinearWeight.quantize(torch.randn(e, n, k, generator=gen) / k**0.5, fmt).to(backend.device)
    group_sizes = torch.tensor(sizes, dtype=torch.int64, device=backend.device)
    out = backend.grouped_linear(x.to(backend.device), lw, group_sizes)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert _rel_err(out, _grouped_reference(x, lw, sizes)) < _tol(backend, fmt)
    # The same rows through linear, one expert at a time: identical semantics. (FP8 weights on a GPU: the two may
    # take different kernels, e.g. the GEMV for a group's one row against E4M3 tensor cores, which sum a 128-wide
    # block's products in ~14 bits before the float32 promotion.)
    close = 1e-3 if fmt == "fp8_block" and backend.device.type == "cuda" else 1e-5
    start = 0
    for g, size in enumerate(sizes):
        if size:
            single = backend.linear(x[start : start + size].to(backend.device), _expert(lw, g))
            assert _rel_err(out[start : start + size], single) < close
        start += size


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_linear_sizes_settled_is_only_a_hint(backend, gen, fmt):
    """sizes_settled (a down projection whose gate/up already read the sizes) may change when a backend reads
    them, never what it computes: decode-sized 16-bit rows (the grouped GEMV's case) give the same bits."""
    sizes = [1, 0, 2, 1, 0, 3]
    x = torch.randn(sum(sizes), 200, generator=gen).bfloat16().to(backend.device)
    lw = LinearWeight.quantize(torch.randn(len(sizes), 136, 200, generator=gen).bfloat16() / 200**0.5, fmt)
    lw = lw.to(backend.device)
    group_sizes = torch.tensor(sizes, dtype=torch.int64, device=backend.device)
    first = backend.grouped_linear(x, lw, group_sizes, validate=False)
    assert torch.equal(backend.grouped_linear(x, lw, group_sizes, validate=False, sizes_settled=True), first)
    assert _rel_err(first, _grouped_reference(x.float().cpu(), lw, sizes)) < 8e-3  # the output's rounding


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes", [[1, 0, 2, 1], [5, 3]], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_linear_is_silu_of_gate_times_up(backend, gen, fmt, sizes, dtype):
    """The first half of a gated MLP (fused on cuda_sm100 at decode sizes) against silu(gate) * up computed
    in float64 from the grouped reference."""
    e, m, k, inter = len(sizes), sum(sizes), 256, 128
    x = torch.randn(m, k, generator=gen)
    lw = LinearWeight.quantize(torch.randn(e, 2 * inter, k, generator=gen) / k**0.5, fmt).to(backend.device)
    group_sizes = torch.tensor(sizes, dtype=torch.int64, device=backend.device)
    out = backend.gated_linear(x.to(dtype).to(backend.device), lw, group_sizes)
    assert out.shape == (m, inter) and out.dtype == dtype
    gate_up = _grouped_reference(x.to(dtype).float(), lw, sizes)
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    tol = _tol(backend, fmt) if dtype == torch.float32 else max(_tol(backend, fmt), 2e-2)
    assert _rel_err(out.float(), ref) < tol


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_linear_of_a_dense_mlp(backend, gen, fmt, m, dtype):
    """A dense MLP's gate/up (a 2-D [2I, K] weight; one row is batch-1 decode, on cuda_sm100's gated GEMV)
    against silu(gate) * up computed in float64 from the reference projection."""
    k, inter = 256, 128
    x = torch.randn(m, k, generator=gen)
    # 16-bit rows meet a weight of their dtype, as in a model (what the dense GEMV takes)
    lw = LinearWeight.quantize((torch.randn(2 * inter, k, generator=gen) / k**0.5).to(dtype), fmt)
    out = backend.gated_linear(x.to(dtype).to(backend.device), lw.to(backend.device))
    assert out.shape == (m, inter) and out.dtype == dtype
    xr = x.to(dtype).float()
    gate_up = (_quant_x_ref(xr) if fmt == "fp8_block" else xr.double()) @ lw.dequantize().double().t()
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    tol = _tol(backend, fmt) if dtype == torch.float32 else max(_tol(backend, fmt), 2e-2)
    assert _rel_err(out.float(), ref) < tol


@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_quantised_activations(backend, gen, m, dtype):
    """FP8 activations quantised ahead (quant.Fp8Activations, row- or column-major scales) give exactly what
    linear computes from the unquantised rows; they need an fp8_block weight of their K."""
    k, n = 300, 136
    x = torch.randn(m, k, generator=gen).to(dtype).to(backend.device)
    lw = LinearWeight.quantize(torch.randn(n, k, generator=gen) / k**0.5, "fp8_block").to(backend.device)
    q, scale = backend.ops.quantize_fp8_per_token_group(x)
    want = backend.linear(x, lw)
    for s in (scale, scale.t().contiguous().t()):
        out = backend.linear(quant.Fp8Activations(q, s, dtype), lw)
        assert out.dtype == dtype and torch.equal(out, want)
    with pytest.raises(InvalidInputError, match="fp8_block"):
        backend.linear(quant.Fp8Activations(q, scale, dtype), LinearWeight.quantize(torch.randn(n, k), "dense").to(backend.device))
    with pytest.raises(InvalidInputError, match="in_features"):
        backend.linear(quant.Fp8Activations(q[:, :256], scale[:, :2], dtype), lw)
    with pytest.raises(InvalidInputError, match="scales"):
        quant.Fp8Activations(q, scale[:, :1], dtype)


@pytest.mark.parametrize("t", [1, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_linear(backend, gen, t, dtype):
    """MLA's absorbed projections: x [T, H, K] (a strided view, as q[..., :nope] is) @ weight[h]^T per head,
    against float64 math; quantize=True gives exactly this backend's quantisation of its own [T, H * N] rows."""
    h, k, n = 4, 64, 128
    x = torch.randn(t, h, k + 32, generator=gen).to(dtype).to(backend.device)[..., :k]
    w = LinearWeight.dense((torch.randn(h, n, k, generator=gen) / k**0.5).to(dtype).to(backend.device))
    out = backend.per_head_linear(x, w)
    assert out.shape == (t, h, n) and out.dtype == dtype
    ref = torch.einsum("thk,hnk->thn", x.cpu().double(), w.data.cpu().double())
    assert _rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    fa = backend.per_head_linear(x, w, quantize=True)
    q, scale = backend.ops.quantize_fp8_per_token_group(out.reshape(t, h * n))
    if isinstance(fa, quant.Fp8Activations):  # exactly this backend's quantisation of its own rows
        assert fa.dtype == dtype and tuple(fa.shape) == (t, h * n)
        assert torch.equal(fa.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(fa.scale, scale)
        rows = fa
    else:  # the plain rows, which the FP8 projection quantises itself to the same bits
        assert torch.equal(fa, out)
        rows = fa.reshape(t, h * n)
    o_proj = LinearWeight.quantize(torch.randn(96, h * n, generator=gen) / (h * n) ** 0.5, "fp8_block").to(backend.device)
    ahead = backend.linear(quant.Fp8Activations(q, scale, dtype), o_proj)
    assert torch.equal(backend.linear(rows, o_proj), ahead)
    with pytest.raises(InvalidInputError, match="x"):
        backend.per_head_linear(x[:, :3], w)  # three heads for a four-head weight
    with pytest.raises(InvalidInputError, match="stacked"):
        backend.per_head_linear(x, LinearWeight.dense(w.data[0]))


def _expert(lw: LinearWeight, g: int) -> LinearWeight:
    if lw.format.value == "dense":
        return LinearWeight.dense(lw.data[g])
    if lw.format.value == "fp8_block":
        return LinearWeight.fp8_block(lw.data[g], lw.scale[g])
    return LinearWeight.nvfp4(lw.data[g], lw.scale[g], lw.global_scale[g], lw.in_features)


def test_grouped_linear_bf16_int32_sizes(backend, gen):
    sizes = [2, 0, 3]
    x = torch.randn(5, 200, generator=gen).bfloat16()
    lw = LinearWeight.quantize(torch.randn(3, 136, 200, generator=gen) / 15, "fp8_block").to(backend.device)
    out = backend.grouped_linear(x.to(backend.device), lw, torch.tensor(sizes, dtype=torch.int32, device=backend.device))
    assert out.dtype == torch.bfloat16
    ref = _grouped_reference(x.float(), lw, sizes)
    assert ((out.cpu().double() - ref).abs() <= ref.abs() * 2.0**-8 + _tol(backend, "fp8_block") * ref.abs().max()).all()


def test_gemm_rejects_bad_inputs(backend, gen):
    dev = backend.device
    x = torch.randn(4, 200, generator=gen).to(dev)
    w2 = LinearWeight.quantize(torch.randn(136, 200, generator=gen), "fp8_block").to(dev)
    w3 = LinearWeight.dense(torch.randn(3, 136, 200, generator=gen).to(dev))
    sizes = lambda v, dtype=torch.int64: torch.tensor(v, dtype=dtype, device=dev)  # noqa: E731
    bad = [
        lambda: backend.linear(x[:, :199], w2),  # wrong K
        lambda: backend.linear(x.to(torch.int32), w2),
        lambda: backend.linear(x.to(quant.FP8_DTYPE), w2),
        lambda: backend.linear(x, w3),  # stacked weight
        lambda: backend.linear(x, torch.randn(136, 200)),  # not a LinearWeight
        lambda: backend.grouped_linear(x, w3, sizes([1, 1, 1])),  # sums to 3, not 4
        lambda: backend.grouped_linear(x, w3, sizes([5, -1, 0])),  # negative
        lambda: backend.grouped_linear(x, w3, sizes([4, 0])),  # wrong length
        lambda: backend.grouped_linear(x, w3, sizes([2, 2, 0], torch.float32)),
        lambda: backend.grouped_linear(x, w3, sizes([[2, 2, 0]])),  # 2-D sizes
        lambda: backend.grouped_linear(x, w2, sizes([4])),  # 2-D weight
        lambda: backend.grouped_linear(x[:, :100], w3, sizes([2, 2, 0])),  # wrong K
        lambda: backend.grouped_linear(x[None], w3, sizes([2, 2, 0])),  # 3-D x
        lambda: backend.grouped_linear(x.to(torch.int64), w3, sizes([2, 2, 0])),
    ]
    if dev.type != "cpu":
        bad.append(lambda: backend.linear(x.cpu(), w2))  # device mismatch
    else:
        bad.append(lambda: backend.linear(x.to("meta"), w2))
    for i, call in enumerate(bad):
        with pytest.raises(InvalidInputError):
            call()
            pytest.fail(f"bad input #{i} was accepted")


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "fp8_activations"])
def test_batch_invariant_reference_rows_do_not_depend_on_the_batch(gen, fmt):
    """The reference in batch-invariant mode: each row of a call equals that row computed alone, bit for bit,
    whether the activations come as floats or pre-quantised (quant.Fp8Activations)."""
    from deepinfer.registry import load_backend

    be = load_backend("reference", batch_invariant=True)
    k, n, m = 384, 72, 9
    x = torch.randn(m, k, generator=gen)
    lw = LinearWeight.quantize(torch.randn(n, k, generator=gen) / k**0.5, "dense" if fmt == "dense" else "fp8_block")
    if fmt == "fp8_activations":
        q, s = be.ops.quantize_fp8_per_token_group(x)
        call = lambda rows: be.linear(quant.Fp8Activations(q[rows], s[rows], torch.float32), lw)  # noqa: E731
    else:
        call = lambda rows: be.linear(x[rows], lw)  # noqa: E731
    full = call(slice(0, m))
    for r in range(m):
        assert torch.equal(call(slice(r, r + 1)), full[r : r + 1])
