"""ops.prefill_attention (MLA's decompressed prefill) of every backend against float64 math, and the
cuda_sm100 split into a square causal block plus a prefix merged by log-sum-exp."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cuda_sm100 import prefill_attention as PA
from deepinfer.errors import InvalidInputError
from deepinfer.ops import FusedOps


def _randn(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def math_attention(q, k, v, scale, with_lse=False, causal_offset=None):
    """float64 [Lq, H, d] attention; query i sees keys 0 .. causal_offset + i (default Ls - Lq: lower right)."""
    q, k, v = q.double(), k.double(), v.double()
    lq, ls = q.shape[0], k.shape[0]
    off = ls - lq if causal_offset is None else causal_offset
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = torch.arange(ls)[None, :] <= (off + torch.arange(lq))[:, None]
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v)
    return (out, lse) if with_lse else out


def math_attend(q, k, v, causal, scale):
    """PA.Attend on [1, H, L, d] views with the upper-left causal mask of SDPA's is_causal."""
    out, lse = math_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), scale, True,
                              causal_offset=0 if causal else k.shape[2])
    return out.transpose(0, 1)[None].to(q.dtype), lse.float()[None]


SHAPES = [(1, 1), (1, 9), (5, 5), (6, 33), (33, 33), (17, 70)]  # (queries, keys)


@pytest.mark.parametrize("lq,ls", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_math(backend, gen, lq, ls, dtype):
    h, dk, dv = 3, 24, 16
    q, k = (_randn(gen, n, h, dk, dtype=dtype, device=backend.device) for n in (lq, ls))
    v = _randn(gen, ls, h, dv, dtype=dtype, device=backend.device)
    got = backend.ops.prefill_attention(q, k, v, 0.3)
    assert got.shape == (lq, h, dv) and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double().cpu(), math_attention(q, k, v, 0.3).cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("lq,ls", SHAPES + [(300, 300), (300, 1000), (257, 1300)])
@pytest.mark.parametrize("bucketed", [False, True])
def test_split_and_merge_equals_one_causal_pass(gen, lq, ls, bucketed):
    """The square causal block (with dummy leading queries and zero padding when bucketed) plus the prefix,
    merged, is lower-right causal attention."""
    q, k, v = _randn(gen, lq, 2, 8), _randn(gen, ls, 2, 8), _randn(gen, ls, 2, 4)
    got = PA.split_prefill_attention(q, k, v, 0.5, attend=math_attend, bucketed=bucketed)
    torch.testing.assert_close(got.double(), math_attention(q, k, v, 0.5), rtol=1e-5, atol=1e-5)


def test_buckets_bound_padding():
    for n in (1, 255, 256, 257, 1000, 2048, 2049, 16384, 16385, 100_000):
        b = PA.bucket(n)
        assert b >= 256 and -(-n // b) * b - n < max(256, n / 8 + 1)


def test_unknown_prefill_attention_impl_is_refused():
    from deepinfer.backends.cuda_sm100.fused_ops import CudaFusedOps
    from deepinfer.errors import ConfigError

    with pytest.raises(ConfigError, match="DEEPINFER_PREFILL_ATTENTION"):
        CudaFusedOps(prefill_attention="flashinfer")


def test_prefill_attention_rejects_bad_input(backend, gen):
    dev = backend.device
    q, k, v = _randn(gen, 4, 2, 8, device=dev), _randn(gen, 3, 2, 8, device=dev), _randn(gen, 3, 2, 4, device=dev)
    with pytest.raises(InvalidInputError, match="queries"):
        backend.ops.prefill_attention(q, k, v, 0.5)
    with pytest.raises(InvalidInputError):
        backend.ops.prefill_attention(q[:2], k.double(), v, 0.5)
    with pytest.raises(InvalidInputError, match="scale"):
        backend.ops.prefill_attention(q[:2], k, v, -1.0)
    qr, kr = _randn(gen, 2, 2, 4, device=dev), _randn(gen, 3, 2, 4, device=dev)
    with pytest.raises(InvalidInputError, match="q_rope and k_rope"):
        backend.ops.prefill_attention(q[:2], k, v, 0.5, q_rope=qr)
    with pytest.raises(InvalidInputError, match="k_rope"):
        backend.ops.prefill_attention(q[:2], k, v, 0.5, q_rope=qr, k_rope=kr[..., :3])


@pytest.mark.parametrize("lq,ls", [(1, 9), (6, 33), (17, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_rope_parts(backend, gen, lq, ls, dtype):
    """Keys in two parts, the rope key shared by every head (a stride-0 view, as MLA passes it): the attention of
    the joined keys."""
    h, dn, dr, dv, dev = 3, 16, 8, 16, backend.device
    q, qr = _randn(gen, lq, h, dn, dtype=dtype, device=dev), _randn(gen, lq, h, dr, dtype=dtype, device=dev)
    k, v = _randn(gen, ls, h, dn, dtype=dtype, device=dev), _randn(gen, ls, h, dv, dtype=dtype, device=dev)
    kr = _randn(gen, ls, 1, dr, dtype=dtype, device=dev).expand(ls, h, dr)
    got = backend.ops.prefill_attention(q, k, v, 0.3, q_rope=qr, k_rope=kr)
    want = math_attention(torch.cat([q, qr], -1), torch.cat([k, kr], -1), v, 0.3)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU kernels (Triton, cuDNN's SDPA) need a GPU")
@pytest.mark.parametrize("impl", ["triton", "cudnn"])
@pytest.mark.parametrize("lq,ls", [(2048, 2048), (2100, 5000), (3000, 3001), (130, 200)])
def test_cuda_prefill_attention_runs_its_kernels_at_mla_sizes(gen, lq, ls, impl, monkeypatch):
    from deepinfer.backends.cuda_sm100.fused_ops import CudaFusedOps

    if impl == "cudnn" and lq < PA.MIN_QUERIES:
        pytest.skip("short chunks stay off cuDNN")
    ops = CudaFusedOps(prefill_attention=impl)

    def fallback(*args, **kwargs):
        raise AssertionError(f"cuda_sm100 fell back to PyTorch's SDPA choice instead of {impl}")

    monkeypatch.setattr(FusedOps, "prefill_attention", fallback)
    h, dk, dv = 16, 192, 128
    q, k = (_randn(gen, n, h, dk, dtype=torch.bfloat16, device="cuda") for n in (lq, ls))
    v = _randn(gen, ls, h, dv, dtype=torch.bfloat16, device="cuda")
    got = ops.prefill_attention(q, k, v, dk ** -0.5)
    want = math_attention(q, k, v, dk ** -0.5)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2
    # MLA's parts: nope keys a strided view of [Ls, H, 128 + 128], one rope key [Ls, 64] shared by every head
    kv = _randn(gen, ls, h, 128 + dv, dtype=torch.bfloat16, device="cuda")
    kr = _randn(gen, ls, 1, dk - 128, dtype=torch.bfloat16, device="cuda").expand(ls, h, dk - 128)
    got = ops.prefill_attention(q[..., :128], kv[..., :128], kv[..., 128:], dk ** -0.5, q_rope=q[..., 128:], k_rope=kr)
    want = math_attention(q, torch.cat([kv[..., :128], kr], -1), kv[..., 128:], dk ** -0.5)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2
