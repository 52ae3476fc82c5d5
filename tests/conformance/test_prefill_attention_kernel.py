"""cuda_sm100's Triton flash prefill kernel (flash_prefill) against float64 math: on CPU under the Triton
interpreter (tests/conftest.py), on the GPU where there is one.

Small tiles (BLOCK_M 32 / BLOCK_N 16) make short sequences cross many key blocks, so both loops (fully
visible blocks, masked diagonal blocks) and the sequence-end masks run. Both load paths are covered: pointer
loads (any head size) and TMA descriptors (head sizes the tiles cover exactly, e.g. 48 = 32 + 16); the
shipped tiles run at DeepSeek's head sizes (192 / 128). v is always a strided view, as MLA passes it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILE = dict(block_m=32, block_n=16)


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=DEVICE, dtype=dtype)


def math_attention(q, k, v, scale):
    """float64 lower-right causal attention -> (out [Lq, H, dv], natural-log lse [Lq, H])."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    lq, ls = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = torch.arange(ls)[None, :] <= (ls - lq + torch.arange(lq))[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v)
    return out, lse.transpose(0, 1)


def _mla_views(gen, lq, ls, h, dk, dv, dtype):
    """q, k as [L, H, dk] and v = kv[..., dk - dv:] of a [Ls, H, dk + dv] tensor: a strided view, as MLA's
    decompressed prefill hands it over (keys contiguous)."""
    q = _randn(gen, lq, h, dk, dtype=dtype)
    k = _randn(gen, ls, h, dk, dtype=dtype)
    kv = _randn(gen, ls, h, dk + dv, dtype=dtype)
    return q, k, kv[..., dk:]


def _check(lq, ls, h, dk, dv, dtype, gen, scale=0.3, tma=None, **tile):
    from deepinfer.backends.cuda_sm100.prefill_attention_kernels import _key_parts, flash_prefill, tma_usable

    q, k, v = _mla_views(gen, lq, ls, h, dk, dv, dtype)
    if tma:
        _, _, _, k2, _, d2, _ = _key_parts(q, k, None, None)
        assert tma_usable(k, k2, v, d2)
    tile["tma"] = tma
    assert v.stride(0) == h * (dk + dv)  # strided, not copied to contiguous
    out, lse = flash_prefill(q, k, v, scale, return_lse=True, **tile)
    assert out.shape == (lq, h, dv) and out.dtype == dtype and lse.shape == (lq, h) and lse.dtype == torch.float32
    want, want_lse = math_attention(q, k, v, scale)
    # float32: a logit of magnitude m is itself rounded by ~m * eps, and exp passes that on to the weights
    # (scale 30 gives logits near 500: 3.6e-5 seen, a seed in CI); a broken kernel is off by far more.
    logit = float((torch.einsum("qhd,khd->hqk", q.double().cpu(), k.double().cpu()) * scale).abs().max())
    tol = 2e-5 + 4 * torch.finfo(torch.float32).eps * logit if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-4)
    # The plain call (no lse) is the same kernel without the extra store.
    torch.testing.assert_close(flash_prefill(q, k, v, scale, **tile), out, rtol=0, atol=0)


# (queries, keys, heads): Lq == Ls, Lq < Ls, one query, lengths off the tile multiples, a prefix longer than a
# tile, a query block starting exactly at a key block boundary (96 + 32 = 128), the first row's last key at a
# block's end and one short of it (offsets 15 and 14: the split between unmasked and masked blocks is tight).
SHAPES = [(1, 1, 1), (1, 45, 2), (7, 7, 3), (40, 40, 1), (33, 70, 4), (64, 64, 2), (20, 129, 3), (32, 128, 2),
          (50, 97, 1), (40, 55, 2), (40, 54, 2)]


@pytest.mark.parametrize("lq,ls,h", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_prefill_matches_math_small_heads(gen, lq, ls, h, dtype):
    # dk 24 = 16 + 8 (the second key tile padded to 16 and masked), dv 16
    _check(lq, ls, h, 24, 16, dtype, gen, **SMALL_TILE)


@pytest.mark.parametrize("dk,dv", [(32, 16), (20, 12), (48, 32)])
@pytest.mark.parametrize("tma", [False, None])
def test_flash_prefill_head_size_splits(gen, dk, dv, tma):
    """A power-of-two key (one dot), odd sizes (masked columns), and an exact two-tile split (32 + 16); the
    exact ones also through TMA (None: where usable)."""
    _check(37, 90, 2, dk, dv, torch.float32, gen, tma=tma, **SMALL_TILE)


@pytest.mark.parametrize("lq,ls,h", [(1, 1, 1), (1, 45, 2), (33, 70, 4), (20, 129, 3), (32, 128, 2)])
def test_flash_prefill_tma_loads(gen, lq, ls, h):
    """TMA descriptors (rows past the sequence read as zero, no load masks) in bf16."""
    _check(lq, ls, h, 48, 32, torch.bfloat16, gen, tma=True, **SMALL_TILE)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_prefill_deepseek_head_sizes_default_tile(gen, dtype, tma):
    """192 = 128 + 64 and 128, each path's shipped tile: queries over two query blocks, a prefix."""
    _check(130, 200, 2, 192, 128, dtype, gen, scale=192 ** -0.5, tma=tma)


def test_flash_prefill_long_rows_stay_finite(gen):
    """Large logits (the exp2 domain with a running max must not overflow) and a row that sees one key."""
    _check(3, 40, 2, 24, 16, torch.float32, gen, scale=30.0, **SMALL_TILE)


def test_flash_prefill_empty_chunk():
    from deepinfer.backends.cuda_sm100.prefill_attention_kernels import flash_prefill

    q, k, v = (torch.zeros(n, 2, d, device=DEVICE) for n, d in ((0, 24), (5, 24), (5, 16)))
    assert flash_prefill(q, k, v, 0.5).shape == (0, 2, 16)


def test_split_key_dims():
    from deepinfer.backends.cuda_sm100.prefill_attention_kernels import split_key_dims

    assert split_key_dims(192) == (128, 64)
    assert split_key_dims(128) == (128, 0)
    assert split_key_dims(24) == (16, 16)
    assert split_key_dims(576) == (512, 64)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dn,dr,shared", [(32, 16, True), (32, 16, False), (16, 8, True), (24, 8, True)])
def test_flash_prefill_separate_rope_parts(gen, dn, dr, shared, tma):
    """Keys given as parts, as MLA's decompressed prefill has them: (q | q_rope) . (k | k_rope), k a strided view,
    k_rope one key every head shares (a stride-0 head view) or per head; nothing concatenated. dn 24 (not a
    power of two) is joined first; dr 8 reads a masked 16-wide tile (pointers only)."""
    from deepinfer.backends.cuda_sm100.prefill_attention_kernels import flash_prefill

    lq, ls, h, dv = 37, 90, 3, 16
    q, qr = _randn(gen, lq, h, dn, dtype=torch.bfloat16), _randn(gen, lq, h, dr, dtype=torch.bfloat16)
    kv = _randn(gen, ls, h, dn + dv, dtype=torch.bfloat16)
    k, v = kv[..., :dn], kv[..., dn:]
    kr = (_randn(gen, ls, 1, dr, dtype=torch.bfloat16).expand(ls, h, dr) if shared
          else _randn(gen, ls, h, dr, dtype=torch.bfloat16))
    out, lse = flash_prefill(q, k, v, 0.3, return_lse=True, tma=tma, q_rope=qr, k_rope=kr, **SMALL_TILE)
    want, want_lse = math_attention(torch.cat([q, qr], -1), torch.cat([k, kr], -1), v, 0.3)
    torch.testing.assert_close(out.double().cpu(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-4)
    if dn & (dn - 1) == 0:  # the same two dots as the joined keys split at dn: bit for bit
        joined = flash_prefill(torch.cat([q, qr], -1), torch.cat([k, kr], -1), v, 0.3, tma=tma, **SMALL_TILE)
        torch.testing.assert_close(out, joined, rtol=0, atol=0)
