"""Fused small ops of every backend (backend.ops) against closed forms and plain loops, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import ops as reference_ops
from deepinfer import quant
from deepinfer.errors import InvalidInputError
from deepinfer.ops import FusedOps, RopeSpec, RoutingSpec, YarnScaling


def _randn(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


@pytest.fixture
def no_norm_rope_fallback(backend_name, monkeypatch):
    """cuda_sm100 must run its Triton kernels for these shapes, not fall back to the reference methods."""
    if backend_name == "cuda_sm100":
        for name in ("rms_norm", "add_rms_norm", "apply_rope", "mla_rope_and_norm"):
            def fallback(*args, name=name, **kwargs):
                raise AssertionError(f"cuda_sm100 fell back to the reference {name}")

            monkeypatch.setattr(FusedOps, name, fallback)


@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (3, 5, 200), (13, 512), (2, 7168)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm(backend, gen, shape, dtype, no_norm_rope_fallback):
    x = _randn(gen, *shape, dtype=dtype, device=backend.device)
    w = _randn(gen, shape[-1], dtype=dtype, device=backend.device)
    got = backend.ops.rms_norm(x, w, 1e-6)
    x64, w64 = x.double().cpu(), w.double().cpu()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    assert got.dtype == dtype and got.shape == x.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of a's dtype (a, b finite, same dtype)."""
    ulp = torch.finfo(a.dtype).eps * torch.maximum(a.double().abs(), b.double().abs()).clamp_min(torch.finfo(a.dtype).tiny)
    return (a.double() - b.double()).abs() / ulp


def _rows(gen, layout, rows, d, dtype, device):
    """x [rows, d] (or 3-D), contiguous or strided as the model passes it."""
    if layout == "contiguous":
        return _randn(gen, rows, d, dtype=dtype, device=device)
    if layout == "row_slice":  # c_kv = kv[:, :kv_lora_rank] of the kv_a projection
        return _randn(gen, rows, d + 64, dtype=dtype, device=device)[:, :d]
    # [3, rows, d] from a transpose: the leading dimensions do not collapse into one row stride
    return _randn(gen, rows, 3, d, dtype=dtype, device=device).transpose(0, 1)


@pytest.mark.parametrize("layout", ["contiguous", "row_slice", "transposed"])
@pytest.mark.parametrize("rows,d", [(1, 512), (13, 512), (5, 200), (3, 2048)])
@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_rms_norm_matches_reference(backend, gen, layout, rows, d, dtype, w_dtype, no_norm_rope_fallback):
    x = _rows(gen, layout, rows, d, dtype, backend.device) * 3
    w = _randn(gen, d, dtype=w_dtype, device=backend.device)
    got = backend.ops.rms_norm(x, w, 1e-6).cpu()
    want = reference_ops.rms_norm(x.cpu(), w.cpu(), 1e-6)
    _assert_norm_matches(got, want)


def _assert_norm_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """A backend's RMSNorm output against the reference's (both on the CPU)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    # Same float32 operations in the same order except the row sum of squares, which a kernel adds up in its own
    # (tree) order: mean and rsqrt then differ by a float32 ulp or two, and the output by up to ~3 ulp (measured
    # up to D=7168). float32 outputs get 8 ulp; narrower outputs are rounded from those float32 values,
    # so they match bit for bit except where a few-ulp float32 difference straddles a rounding boundary
    # (<1% of elements; a truncating or double-rounding cast would miss about half of them).
    ulps = _ulps(got, want)
    if got.dtype == torch.float32:
        assert float(ulps.max()) <= 8, float(ulps.max())
    else:
        assert float(ulps.max()) <= 1 and float((got != want).double().mean()) < 0.01


def _rope_input(gen, layout, t, dim, dtype, device):
    """x [T, ..., dim] as MLA hands it to rope: whole tensors or strided slices."""
    if layout == "q_pe":  # contiguous [T, H, dim]
        return _randn(gen, t, 16, dim, dtype=dtype, device=device)
    if layout == "q_pe_slice":  # q[..., nope:] of q [T, H, nope + dim]: strided heads, no copy
        return _randn(gen, t, 16, 128 + dim, dtype=dtype, device=device)[..., 128:]
    if layout == "k_pe":  # [T, dim]
        return _randn(gen, t, dim, dtype=dtype, device=device)
    if layout == "k_pe_slice":  # kv[:, lora:] of the kv_a projection [T, lora + dim]
        return _randn(gen, t, 512 + dim, dtype=dtype, device=device)[:, 512:]
    # [T, 2, 3, dim] whose middle dimensions do not collapse into one stride
    return _randn(gen, t, 3, 2, dim, dtype=dtype, device=device).transpose(1, 2)


ROPE_LAYOUTS = ["q_pe", "q_pe_slice", "k_pe", "k_pe_slice", "uncollapsible"]


@pytest.mark.parametrize("n", [1, 48, 1407])
def test_silu_and_mul(backend, gen, n):
    x = _randn(gen, 5, 2 * n, device=backend.device)
    got = backend.ops.silu_and_mul(x).double().cpu()
    g, u = x.double().cpu()[:, :n], x.double().cpu()[:, n:]
    torch.testing.assert_close(got, g / (1 + torch.exp(-g)) * u, rtol=1e-5, atol=1e-6)


def _closed_form_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool, factor: float):
    """Rotation of each pair as a complex multiplication, float64."""
    x = x.double()
    d = x.shape[-1]
    if interleaved:
        pairs = torch.complex(x[..., 0::2], x[..., 1::2])
    else:
        pairs = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    angle = pos.double()[:, None] * inv_freq.double()[None, :]
    rot = torch.polar(torch.full_like(angle, factor), angle)
    rot = rot.reshape(rot.shape[0], *([1] * (x.dim() - 2)), rot.shape[-1])
    out = pairs * rot
    if interleaved:
        return torch.stack([out.real, out.imag], dim=-1).flatten(-2)
    return torch.cat([out.real, out.imag], dim=-1)


YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("yarn", [None, YARN, YarnScaling(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.5)])
@pytest.mark.parametrize("dim,heads", [(64, 16), (8, 1), (16, 3)])
def test_rope_closed_form(backend, gen, interleaved, yarn, dim, heads, no_norm_rope_fallback):
    spec = RopeSpec(dim=dim, theta=10000.0, interleaved=interleaved, yarn=yarn)
    cache = spec.cos_sin_cache(8192, backend.device)
    t = 11
    pos = torch.randint(0, 8192, (t,), generator=gen).to(backend.device)
    x = _randn(gen, t, heads, dim, device=backend.device)
    got = backend.ops.apply_rope(x, pos, cache, interleaved).double().cpu()
    want = _closed_form_rope(x.cpu(), pos.cpu(), spec.inv_freq(), interleaved, spec.attention_factor)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("yarn", [None, YARN])
@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_matches_reference(backend, gen, interleaved, yarn, layout, dtype, pos_dtype, no_norm_rope_fallback):
    spec = RopeSpec(dim=64, theta=10000.0, interleaved=interleaved, yarn=yarn)
    cache = spec.cos_sin_cache(8192, backend.device)
    t = 13
    pos = torch.randint(0, 8192, (t,), generator=gen, dtype=pos_dtype).to(backend.device)
    x = _rope_input(gen, layout, t, spec.dim, dtype, backend.device)
    before = x.clone()
    got = backend.ops.apply_rope(x, pos, cache, interleaved).cpu()
    want = reference_ops.apply_rope(x.cpu(), pos.cpu(), cache.cpu(), interleaved)
    # The same float32 products and sums in the same order (no FMA contraction), one rounding to x's dtype:
    # bit for bit.
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    assert torch.equal(x, before)  # a new tensor, the input untouched


@pytest.mark.parametrize("dim", [8, 24])  # half 4 (one pair per lane block) and 12 (a padded block of pairs)
def test_rope_small_dims_and_bf16_cache(backend, gen, dim, no_norm_rope_fallback):
    cache = RopeSpec(dim=dim, theta=10000.0).cos_sin_cache(64, backend.device).to(torch.bfloat16)
    for interleaved in (True, False):
        x = _randn(gen, 7, 3, dim, device=backend.device)
        pos = torch.randint(0, 64, (7,), generator=gen).to(backend.device)
        got = backend.ops.apply_rope(x, pos, cache, interleaved).cpu()
        assert torch.equal(got, reference_ops.apply_rope(x.cpu(), pos.cpu(), cache.cpu(), interleaved))


def test_yarn_inv_freq_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.DeepseekV3Config(
        qk_rope_head_dim=64, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    spec = RopeSpec(dim=64, theta=10000.0, yarn=YARN)
    torch.testing.assert_close(spec.inv_freq(), inv_freq.float(), rtol=1e-6, atol=0)
    assert math.isclose(spec.attention_factor, attention_factor)
    assert math.isclose(spec.softmax_mscale, (0.1 * math.log(40.0) + 1) ** 2)


def _loop_route(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None):
    """One token at a time, with sorted() instead of topk: an independent statement of DeepSeek's gates."""
    out = []
    per_group = spec.num_experts // spec.n_group
    for row in logits.double().tolist():
        if spec.scoring_func == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            e = [math.exp(v - m) for v in row]
            scores = [v / sum(e) for v in e]
        choice = [s + (float(bias[i]) if bias is not None else 0.0) for i, s in enumerate(scores)]
        allowed = range(spec.num_experts)
        if spec.topk_method != "greedy" and spec.n_group > 1:
            groups = []
            for g in range(spec.n_group):
                members = sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)
                groups.append(sum(members[:2]) if spec.topk_method == "noaux_tc" else members[0])
            keep = sorted(range(spec.n_group), key=lambda g: -groups[g])[: spec.topk_group]
            allowed = [e for e in range(spec.num_experts) if e // per_group in keep]
        ids = sorted(allowed, key=lambda e: -choice[e])[: spec.top_k]
        w = [scores[e] for e in ids]
        if spec.topk_method == "noaux_tc":
            if spec.norm_topk_prob:
                w = [v / sum(w) for v in w]
            w = [v * spec.routed_scaling_factor for v in w]
        elif spec.norm_topk_prob and spec.top_k > 1:
            w = [v / sum(w) for v in w]
        else:
            w = [v * spec.routed_scaling_factor for v in w]
        out.append(dict(zip(ids, w)))
    return out


ROUTINGS = [
    RoutingSpec(num_experts=256, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5),  # DeepSeek-V3
    RoutingSpec(num_experts=16, top_k=3, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5),
    RoutingSpec(num_experts=12, top_k=2, n_group=1, topk_group=1),
    RoutingSpec(num_experts=64, top_k=6, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False),  # V2-Lite
    RoutingSpec(num_experts=160, top_k=6, scoring_func="softmax", topk_method="group_limited_greedy",
                n_group=8, topk_group=3, routed_scaling_factor=16.0, norm_topk_prob=False),  # V2
    RoutingSpec(num_experts=8, top_k=4, scoring_func="softmax", topk_method="greedy", norm_topk_prob=True),
]


@pytest.mark.parametrize("spec", ROUTINGS, ids=lambda s: f"{s.topk_method}-E{s.num_experts}-k{s.top_k}-g{s.n_group}")
@pytest.mark.parametrize("tokens", [1, 37])
def test_routing_matches_plain_loop(backend, gen, spec, tokens):
    logits = _randn(gen, tokens, spec.num_experts, device=backend.device) * 3
    bias = _randn(gen, spec.num_experts, device=backend.device) * 0.5 if spec.topk_method == "noaux_tc" else None
    weights, ids = backend.ops.select_experts(logits, spec, bias)
    assert weights.shape == ids.shape == (tokens, spec.top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    want = _loop_route(logits.cpu(), spec, None if bias is None else bias.cpu())
    for t in range(tokens):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want[t]), f"token {t}: experts {sorted(got)} != {sorted(want[t])}"
        for e, w in want[t].items():
            assert math.isclose(got[e], w, rel_tol=1e-5, abs_tol=1e-7)


def test_correction_bias_changes_selection_not_weights(backend, gen):
    spec = RoutingSpec(num_experts=16, top_k=2, n_group=1, topk_group=1, norm_topk_prob=False)
    logits = _randn(gen, 4, 16, device=backend.device)
    bias = torch.full((16,), -10.0, device=backend.device)
    bias[5] = bias[11] = 10.0  # force the selection
    weights, ids = backend.ops.select_experts(logits, spec, bias)
    assert sorted(ids[0].tolist()) == [5, 11]
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, ids))


@pytest.mark.parametrize("k", [128, 200, 7168])
def test_activation_fp8_quantisation(backend, gen, k):
    x = _randn(gen, 6, k, device=backend.device) * 5
    q, scale = backend.ops.quantize_fp8_per_token_group(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, -(-k // 128))
    deq = (q.float() * scale.repeat_interleave(128, dim=-1)[:, :k]).cpu()
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 of each group's scale * 448 range
    err = (deq - x.cpu()).abs()
    bound = scale.cpu().repeat_interleave(128, dim=-1)[:, :k] * 448 * 2.0**-4
    assert bool((err <= bound + 1e-12).all())
    groups = x.cpu().abs()
    for g in range(scale.shape[1]):
        amax = groups[:, g * 128:(g + 1) * 128].amax(dim=-1)
        torch.testing.assert_close(scale[:, g].cpu(), amax / 448)


def test_bad_inputs_raise(backend, gen):
    dev = backend.device
    x = _randn(gen, 4, 8, device=dev)
    with pytest.raises(InvalidInputError, match="weight"):
        backend.ops.rms_norm(x, torch.ones(7, device=dev), 1e-6)
    with pytest.raises(InvalidInputError, match="dtype"):
        backend.ops.rms_norm(torch.ones(4, 8, dtype=torch.int64, device=dev), torch.ones(8, device=dev), 1e-6)
    with pytest.raises(InvalidInputError, match="even"):
        backend.ops.silu_and_mul(_randn(gen, 4, 7, device=dev))
    cache = RopeSpec(dim=8, theta=10000.0).cos_sin_cache(16, dev)
    with pytest.raises(InvalidInputError, match="positions"):
        backend.ops.apply_rope(x, torch.tensor([0, 1, 2, 99], device=dev), cache, True)
    with pytest.raises(InvalidInputError, match="positions"):
        backend.ops.apply_rope(x, torch.tensor([0, 1, 2], device=dev), cache, True)
    with pytest.raises(InvalidInputError, match="cos_sin_cache"):
        backend.ops.apply_rope(_randn(gen, 4, 2, 6, device=dev), torch.arange(4, device=dev), cache, True)
    spec = RoutingSpec(num_experts=8, top_k=2)
    with pytest.raises(InvalidInputError, match="router_logits"):
        backend.ops.select_experts(_randn(gen, 3, 9, device=dev), spec)
    with pytest.raises(InvalidInputError, match="n_group"):
        RoutingSpec(num_experts=10, top_k=2, n_group=3)
    with pytest.raises(InvalidInputError, match="top_k"):
        RoutingSpec(num_experts=8, top_k=9)
    with pytest.raises(InvalidInputError, match="scoring_func"):
        RoutingSpec(num_experts=8, top_k=2, scoring_func="relu")


# --- fused residual add + RMSNorm, and MLA's norm + ropes ------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "row_slice", "transposed"])
@pytest.mark.parametrize("rows,d", [(1, 512), (13, 512), (5, 200), (3, 2048)])
@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_add_rms_norm_matches_reference(backend, gen, layout, rows, d, dtype, w_dtype, no_norm_rope_fallback):
    # the residual stream in each layout with a contiguous x (a branch output), then the other way round
    for strided_residual in (True, False):
        strided = _rows(gen, layout, rows, d, dtype, backend.device)
        dense = _randn(gen, *strided.shape, dtype=dtype, device=backend.device)
        x, residual = (dense, strided * 3) if strided_residual else (strided, dense * 3)
        w = _randn(gen, d, dtype=w_dtype, device=backend.device)
        before = (x.clone(), residual.clone())
        normed, summed = backend.ops.add_rms_norm(x, residual, w, 1e-6)
        want_normed, want_summed = reference_ops.add_rms_norm(x.cpu(), residual.cpu(), w.cpu(), 1e-6)
        # the sum is PyTorch's own `x + residual` bit for bit; the norm reads that rounded sum
        assert summed.dtype == dtype and summed.shape == x.shape
        assert torch.equal(summed.cpu(), x.cpu() + residual.cpu()) and torch.equal(want_summed, summed.cpu())
        _assert_norm_matches(normed.cpu(), want_normed)
        assert torch.equal(want_normed, reference_ops.rms_norm(want_summed, w.cpu(), 1e-6))
        assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def test_add_rms_norm_3d(backend, gen, no_norm_rope_fallback):
    x = _randn(gen, 3, 5, 200, dtype=torch.bfloat16, device=backend.device)
    residual = _randn(gen, 5, 3, 200, dtype=torch.bfloat16, device=backend.device).transpose(0, 1)
    w = _randn(gen, 200, dtype=torch.bfloat16, device=backend.device)
    normed, summed = backend.ops.add_rms_norm(x, residual, w, 1e-5)
    want_normed, want_summed = reference_ops.add_rms_norm(x.cpu(), residual.cpu(), w.cpu(), 1e-5)
    assert torch.equal(summed.cpu(), want_summed)
    _assert_norm_matches(normed.cpu(), want_normed)


@pytest.mark.parametrize("rows,d", [(1, 2048), (7, 512), (5, 200), (3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_quantised_is_norm_then_quantise(backend, gen, rows, d, dtype, no_norm_rope_fallback):
    """quantize=True hands the norm over as FP8 activations: bit for bit this backend's add_rms_norm, then its
    per-token-group quantisation, which is what an FP8 linear would have computed from the plain norm."""
    x = _randn(gen, rows, d, dtype=dtype, device=backend.device)
    residual = _randn(gen, rows, d, dtype=dtype, device=backend.device) * 3
    w = _randn(gen, d, dtype=dtype, device=backend.device)
    fa, summed = backend.ops.add_rms_norm(x, residual, w, 1e-6, quantize=True)
    normed, want_summed = backend.ops.add_rms_norm(x, residual, w, 1e-6)
    q, scale = backend.ops.quantize_fp8_per_token_group(normed)
    assert isinstance(fa, quant.Fp8Activations) and fa.dtype == dtype and tuple(fa.shape) == (rows, d)
    assert torch.equal(summed, want_summed)
    assert torch.equal(fa.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(fa.scale, scale)
    with pytest.raises(InvalidInputError, match="x"):
        backend.ops.add_rms_norm(x[None], residual[None], w, 1e-6, quantize=True)  # [T, D] only


def _mla_inputs(gen, t, heads, rank, rope, dtype, device, kv_slice):
    """q_pe = q[..., nope:] of q [T, H, nope + rope]; kv [T, R + rope], a column slice of the fused q / kv_a
    projection's output (kv_slice) or a whole tensor."""
    q = _randn(gen, t, heads, 48 + rope, dtype=dtype, device=device) * 2
    kv = _randn(gen, t, (72 if kv_slice else 0) + rank + rope, dtype=dtype, device=device) * 2
    return q[..., 48:], (kv[:, 72:] if kv_slice else kv)


def _mla_reference(q_pe, kv, w, eps, pos, cache, interleaved):
    """What core/model/mla.py did before the fusion, with the reference ops (on the CPU)."""
    q_pe, kv, w, pos, cache = (a.cpu() for a in (q_pe, kv, w, pos, cache))
    r = w.shape[0]
    return (reference_ops.apply_rope(q_pe, pos, cache, interleaved), reference_ops.rms_norm(kv[:, :r], w, eps),
            reference_ops.apply_rope(kv[:, r:], pos, cache, interleaved))


# (T, H, kv_lora_rank, rope): a V3 decode token (heads in two tiles); 13 tokens over two token blocks, the
# second partly empty; odd dims (3 pairs of rope, a padded norm row); a prefill-like span of many blocks
MLA_SHAPES = [(1, 128, 512, 64), (13, 16, 512, 64), (37, 3, 24, 6), (200, 5, 512, 64)]


@pytest.mark.parametrize("t,heads,rank,rope", MLA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("kv_slice", [True, False])
def test_mla_rope_and_norm_matches_reference(backend, gen, t, heads, rank, rope, dtype, interleaved, kv_slice,
                                             no_norm_rope_fallback):
    dev = backend.device
    spec = RopeSpec(dim=rope, theta=10000.0, interleaved=interleaved, yarn=YARN if rope == 64 else None)
    cache = spec.cos_sin_cache(8192, dev)
    q_pe, kv = _mla_inputs(gen, t, heads, rank, rope, dtype, dev, kv_slice)
    w = _randn(gen, rank, dtype=dtype, device=dev)
    before = (q_pe.clone(), kv.clone())
    for pos_dtype in (torch.int32, torch.int64):
        pos = torch.randint(0, 8192, (t,), generator=gen, dtype=pos_dtype).to(dev)
        got_q, got_c, got_k = backend.ops.mla_rope_and_norm(q_pe, kv, w, 1e-6, pos, cache, interleaved,
                                                            validate=pos_dtype == torch.int64)
        want_q, want_c, want_k = _mla_reference(q_pe, kv, w, 1e-6, pos, cache, interleaved)
        # rope: the reference's float32 operations in its order (no FMA), bit for bit; the norm to a few ulp
        for got, want in ((got_q, want_q), (got_k, want_k)):
            assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
            assert torch.equal(got.cpu(), want)
        assert got_c.is_contiguous()
        _assert_norm_matches(got_c.cpu(), want_c)
    assert torch.equal(q_pe, before[0]) and torch.equal(kv, before[1])


def test_mla_rope_and_norm_mixed_dtypes_and_empty(backend, gen, no_norm_rope_fallback):
    """A float32 kv with a bf16 query and weight (outputs in their inputs' dtypes), a bf16 cache, and no tokens."""
    dev = backend.device
    cache = RopeSpec(dim=16, theta=10000.0).cos_sin_cache(64, dev).to(torch.bfloat16)
    q_pe, _ = _mla_inputs(gen, 9, 4, 40, 16, torch.bfloat16, dev, True)
    _, kv = _mla_inputs(gen, 9, 4, 40, 16, torch.float32, dev, True)
    w = _randn(gen, 40, dtype=torch.bfloat16, device=dev)
    pos = torch.randint(0, 64, (9,), generator=gen).to(dev)
    got = backend.ops.mla_rope_and_norm(q_pe, kv, w, 1e-6, pos, cache, False)
    want = _mla_reference(q_pe, kv, w, 1e-6, pos, cache, False)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[2].cpu(), want[2])
    _assert_norm_matches(got[1].cpu(), want[1])
    empty = backend.ops.mla_rope_and_norm(q_pe[:0], kv[:0], w, 1e-6, pos[:0], cache, True)
    assert [tuple(e.shape) for e in empty] == [(0, 4, 16), (0, 40), (0, 16)]


def test_fused_norm_rope_bad_inputs_raise(backend, gen):
    dev = backend.device
    x, w = _randn(gen, 4, 8, device=dev), _randn(gen, 8, device=dev)
    add = backend.ops.add_rms_norm
    with pytest.raises(InvalidInputError, match="residual"):
        add(x, _randn(gen, 4, 7, device=dev), w, 1e-6)
    with pytest.raises(InvalidInputError, match="residual"):
        add(x, _randn(gen, 4, 8, dtype=torch.bfloat16, device=dev), w, 1e-6)
    with pytest.raises(InvalidInputError, match="residual"):
        add(x, torch.empty(4, 8, device="meta"), w, 1e-6)
    with pytest.raises(InvalidInputError, match="weight"):
        add(x, _randn(gen, 4, 8, device=dev), _randn(gen, 7, device=dev), 1e-6)
    with pytest.raises(InvalidInputError, match="dtype"):
        add(torch.ones(4, 8, dtype=torch.int64, device=dev), torch.ones(4, 8, dtype=torch.int64, device=dev), w, 1e-6)

    cache = RopeSpec(dim=8, theta=10000.0).cos_sin_cache(16, dev)
    q_pe, kv = _mla_inputs(gen, 4, 2, 24, 8, torch.float32, dev, True)
    w, pos = _randn(gen, 24, device=dev), torch.arange(4, device=dev)
    mla = backend.ops.mla_rope_and_norm
    with pytest.raises(InvalidInputError, match="kv "):
        mla(q_pe, kv[:, 1:], w, 1e-6, pos, cache, True)
    with pytest.raises(InvalidInputError, match="kv "):
        mla(q_pe, kv[:3], w, 1e-6, pos, cache, True)
    with pytest.raises(InvalidInputError, match="q_pe"):
        mla(q_pe[:, 0], kv, w, 1e-6, pos, cache, True)
    with pytest.raises(InvalidInputError, match="kv_norm_weight"):
        mla(q_pe, kv, w[None], 1e-6, pos, cache, True)
    with pytest.raises(InvalidInputError, match="positions"):
        mla(q_pe, kv, w, 1e-6, pos[:3], cache, True)
    with pytest.raises(InvalidInputError, match="positions"):
        mla(q_pe, kv, w, 1e-6, torch.tensor([0, 1, 2, 16], device=dev), cache, True)
    with pytest.raises(InvalidInputError, match="cos_sin_cache"):
        mla(q_pe, kv, w, 1e-6, pos, cache[:, :6], True)
    with pytest.raises(InvalidInputError, match="dtype"):
        mla(q_pe, kv.long(), w, 1e-6, pos, cache, True)


def _first_argmax(row: list[float]) -> int:
    """Plain Python: the first NaN if any, else the first index of the largest value."""
    for i, v in enumerate(row):
        if math.isnan(v):
            return i
    best = max(row)
    return row.index(best)


@pytest.mark.parametrize("shape", [(1, 102400), (3, 5000), (4, 1), (2, 2049), (5, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_first_maximum(backend, gen, shape, dtype):
    r, v = shape
    x = _randn(gen, r, v, dtype=dtype)
    if v > 1:
        # ties: a row of few distinct values (the first occurrence wins), a row all -inf but one later -inf
        # tie, a row with NaNs (the first NaN wins), a maximum in the row's last column
        x[0, : v // 2] = torch.randint(-3, 3, (v // 2,), generator=gen).to(dtype)
        x[0, v // 2 :] = -5
        if r > 1:
            x[1] = float("-inf")
        if r > 2:
            nans = torch.randint(0, v, (2,), generator=gen)
            x[2, nans] = float("nan")
        if r > 3:
            x[3, -1] = 100
    got = backend.ops.argmax(x.to(backend.device))
    assert got.dtype == torch.int64 and got.shape == (r,)
    assert got.cpu().tolist() == [_first_argmax(row) for row in x.float().tolist()]


def test_argmax_rejects_bad_input(backend, gen):
    assert backend.ops.argmax(torch.empty(0, 7, device=backend.device)).shape == (0,)
    for bad in (torch.randn(5, generator=gen), torch.randn(3, 0), torch.randint(0, 5, (2, 3), generator=gen)):
        with pytest.raises(InvalidInputError):
            backend.ops.argmax(bad.to(backend.device))
