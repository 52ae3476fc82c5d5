"""cuda_sm100's Gluon MLA decode kernels (Hopper only: Gluon has no interpreter): 64-row tiles (the lockstep and
seesaw kernels), keys-as-M tiles (one warpgroup, or warp-specialised and TMA-fed), which of them runs, and what
TMA's whole-block copies and the FP8 cache's float16 widening must not change. Against the reference backend on
the same cache bytes, and against the Triton kernel on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.attention import AttentionBatch, KVCacheSpec
from test_attention_kernels import (
    GPU, RANK, ROPE, against_reference, assert_close_rel, filled_cache, queries, tables_for,
)


def gluon_against_reference_and_triton(kern, ref, gen, monkeypatch, launcher, off_env, kv_dtype, heads, query_lens,
                                       split, lse_tol):
    """Decode a ragged batch (1 to 9000 keys: a tile's last keys past the sequence, causal queries, direct and
    split items) with mla_launch's `launcher` counted, against the reference; then, with `off_env` set to "0", on
    mla_attn_kernel (the launcher not called), against the Gluon kernel's outputs (lse within lse_tol)."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    seq_lens = (1, 70, 700, 2000, 4100, 9000)
    nb, tables = tables_for(seq_lens, 64, gen)
    spec = KVCacheSpec(nb, 64, RANK, ROPE, kv_dtype)
    cache = filled_cache(kern, spec, gen)
    q, qp = queries(kern, sum(query_lens), heads, gen, scale=0.3)
    ran = []
    real = getattr(A, launcher)
    monkeypatch.setattr(A, launcher, lambda *a: ran.append(True) or real(*a))
    batch = AttentionBatch(query_lens, seq_lens, tables)
    _, out, lse = against_reference(kern, ref, batch, spec, cache, q, qp, RANK**-0.5, split_tokens=split)
    assert any(ran)
    monkeypatch.setenv(off_env, "0")
    ran.clear()
    plan = kern.plan_attention(batch, spec, split_tokens=split)
    t_out, t_lse = kern.run_attention(plan, cache, q, qp, RANK**-0.5, return_lse=True)
    assert not ran
    assert_close_rel(out, t_out, tol=1e-2)
    torch.testing.assert_close(lse, t_lse, rtol=lse_tol, atol=lse_tol)


def seesaw_descriptors_made(monkeypatch) -> list:
    """The TMA descriptors mla_launch makes for the seesaw kernel from now on (it makes them only to launch it)."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    made = []
    real = A.seesaw_descriptors
    monkeypatch.setattr(A, "seesaw_descriptors", lambda *a: made.append(real(*a)) or made[-1])
    return made


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on Hopper GPUs only (no interpreter)")
@pytest.mark.parametrize("kv_dtype,seesaw,tma", [("bf16", True, False), ("bf16", True, True), ("bf16", False, False),
                                                 ("fp8_e4m3", True, True), ("fp8_e4m3", False, False)])
@pytest.mark.parametrize("query_lens", [(1, 1, 1, 1, 1, 1), (1, 2, 3, 1, 4, 2)])
@pytest.mark.parametrize("heads", [128, 32, 16])
@pytest.mark.parametrize("split", [None, 64, 128])
def test_gluon_tiles_match_reference_and_triton(kern, ref, gen, monkeypatch, kv_dtype, seesaw, tma, query_lens, heads,
                                                split):
    """64-row tiles on the Gluon kernels (128 heads; 32 heads, half of each tile padding; 16 heads x 2-4
    queries): bf16 on the seesaw kernel (key blocks by cp.async, and by TMA) and on the lockstep one, FP8 on the
    seesaw kernel (by TMA, widened in place) and on the lockstep one; against the reference, and against
    mla_attn_kernel on the same inputs. Ragged lengths, a tile's last keys past the sequence, causal queries,
    direct and split items, odd numbers of key blocks (the seesaw pairs the last with a masked one); the launch
    counter proves a Gluon kernel ran, and the descriptors made that the TMA-fed seesaw did."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    spec = KVCacheSpec(1, 64, RANK, ROPE, kv_dtype)
    if not A.gluon_tile_usable(spec, torch.bfloat16, kern.device):
        pytest.skip("needs a Hopper GPU and a Triton with Gluon")
    monkeypatch.setenv("DEEPINFER_MLA_SEESAW", "1" if seesaw else "0")
    monkeypatch.setenv("DEEPINFER_MLA_SEESAW_TMA", "1" if tma else "0")
    assert A.seesaw_usable(spec, kern.device) == seesaw
    if heads == 16 and max(query_lens) < 2:
        pytest.skip("16 heads take 64-row tiles only with 2+ queries a sequence")
    made = seesaw_descriptors_made(monkeypatch)
    # FP8: the Triton kernel folds the scales into the fp32 scores (at most 32 rows) or rounds the dequantised tile
    # to bf16, the Gluon kernels round it to float16: the two differ by the reference comparison's FP8 allowance
    # (H200: lse up to 1.7e-3 apart at 64-row tiles), not less.
    tol = 1e-2 if spec.is_fp8 else 1e-3
    gluon_against_reference_and_triton(kern, ref, gen, monkeypatch, "launch_gluon", "DEEPINFER_MLA_GLUON", kv_dtype,
                                       heads, query_lens, split, tol)
    assert bool(made) == (seesaw and tma) and all(d is not None for d in made)


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on Hopper GPUs only (no interpreter)")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,query_lens",
                         [(16, (1, 1, 1, 1, 1, 1)), (8, (1, 2, 1, 2, 2, 1)), (4, (1, 3, 4, 1, 2, 1))])
@pytest.mark.parametrize("split", [None, 64, 128])
@pytest.mark.parametrize("ws", [False, True])
def test_keys_as_m_tiles_match_reference_and_triton(kern, ref, gen, monkeypatch, kv_dtype, heads, query_lens, split,
                                                    ws):
    """Tiles of at most 16 rows on the keys-as-M Gluon kernels (16 heads; 8 heads x 1-2 queries; 4 heads x 1-4
    queries, tiles part padding), against the reference and against mla_attn_kernel's 16-row tile on the same
    inputs: ragged lengths, a tile's last keys past the sequence, causal queries, direct and split items. ws: an
    FP8 cache on the warp-specialised kernel."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    monkeypatch.setenv("DEEPINFER_MLA_KT", "1")
    monkeypatch.setenv("DEEPINFER_MLA_KT_WS", "1" if ws else "0")
    spec = KVCacheSpec(1, 64, RANK, ROPE, kv_dtype)
    if not (A.gluon_tile_usable(spec, torch.bfloat16, kern.device) and A.keys_as_m_usable(spec, 16, kern.device)):
        pytest.skip("needs a Hopper GPU and a Triton with Gluon")
    if ws and not A.keys_as_m_ws_usable(spec, kern.device):
        pytest.skip("the warp-specialised kernel takes FP8 caches only")
    # FP8: the Triton tile rounds the probabilities to bf16, this kernel rounds them times the keys' scales to
    # float16 (the widened tile is exact in both).
    gluon_against_reference_and_triton(kern, ref, gen, monkeypatch, "launch_gluon_kt", "DEEPINFER_MLA_KT", kv_dtype,
                                       heads, query_lens, split, 1e-2 if spec.is_fp8 else 1e-3)


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on Hopper GPUs only (no interpreter)")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [128, 32])
def test_seesaw_by_tma_ignores_what_the_cache_holds_past_a_sequence(kern, ref, gen, monkeypatch, heads, kv_dtype):
    """TMA copies whole cache blocks, so a sequence's last block brings in slots it has not written (another
    sequence's keys, or NaN where nothing was written): with every such slot NaN (FP8: every byte 0xFF, NaN as
    E4M3, as a scale and as a rope value), the seesaw kernel's outputs still match the reference, which reads a
    sequence's own slots only (0 x NaN in the products would not)."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    spec = KVCacheSpec(1, 64, RANK, ROPE, kv_dtype)
    if not A.gluon_tile_usable(spec, torch.bfloat16, kern.device):
        pytest.skip("needs a Hopper GPU and a Triton with Gluon")
    monkeypatch.setenv("DEEPINFER_MLA_SEESAW", "1")
    monkeypatch.setenv("DEEPINFER_MLA_SEESAW_TMA", "1")
    seq_lens = (1, 70, 700, 2000, 4100, 200)  # 1, 3 and 4 blocks: odd counts pair with a block past the end
    nb, tables = tables_for(seq_lens, 64, gen)
    spec = KVCacheSpec(nb, 64, RANK, ROPE, kv_dtype)
    cache = filled_cache(kern, spec, gen)
    written = torch.zeros(nb, 64, dtype=torch.bool)
    for n, table in zip(seq_lens, tables):
        for i, blk in enumerate(table):
            written[blk, : n - 64 * i] = True
    cache[~written.to(cache.device)] = float("nan") if cache.is_floating_point() else 0xFF
    q, qp = queries(kern, len(seq_lens), heads, gen, scale=0.3)
    for split in (None, 128):
        _, out, _ = against_reference(kern, ref, AttentionBatch((1,) * len(seq_lens), seq_lens, tables), spec, cache,
                                      q, qp, RANK**-0.5, split_tokens=split)
        assert torch.isfinite(out).all()


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on Hopper GPUs only (no interpreter)")
def test_fp8_items_take_the_seesaw_from_its_span_on(kern, ref, gen, monkeypatch):
    """By default an FP8 cache's 64-row tiles run on the seesaw kernel where the items span SEESAW_E4M3_KEYS keys
    or more, on the lockstep kernel below (the seesaw's widening costs more a program); both match the
    reference."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    if not A.gluon_tile_usable(KVCacheSpec(1, 64, RANK, ROPE, "fp8_e4m3"), torch.bfloat16, kern.device):
        pytest.skip("needs a Hopper GPU and a Triton with Gluon")
    monkeypatch.delenv("DEEPINFER_MLA_SEESAW", raising=False)
    monkeypatch.setenv("DEEPINFER_MLA_SEESAW_TMA", "1")  # as under a CUDA graph
    made = seesaw_descriptors_made(monkeypatch)
    seq_lens = (4096, 3000)
    nb, tables = tables_for(seq_lens, 64, gen)
    spec = KVCacheSpec(nb, 64, RANK, ROPE, "fp8_e4m3")
    cache = filled_cache(kern, spec, gen)
    q, qp = queries(kern, len(seq_lens), 128, gen, scale=0.3)
    for split, seesaw in ((A.SEESAW_E4M3_KEYS // 2, False), (A.SEESAW_E4M3_KEYS, True)):
        made.clear()
        against_reference(kern, ref, AttentionBatch((1, 1), seq_lens, tables), spec, cache, q, qp, RANK**-0.5,
                          split_tokens=split)
        assert bool(made) == seesaw


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on Hopper GPUs only (no interpreter)")
def test_tma_fed_kernel_runs_in_graphs_unless_told(kern, monkeypatch):
    """An FP8 cache's keys-as-M tiles take the TMA-fed kernel while a CUDA graph is captured and the one-warpgroup
    kernel in eager calls (whose launches would encode its three TMA descriptors every time), unless
    DEEPINFER_MLA_KT_WS says "1" (always) or "0" (never); a bf16 cache never takes it."""
    from deepinfer.backends.cuda_sm100 import gluon_gate, mla_launch as A

    fp8, bf16 = KVCacheSpec(1, 64, RANK, ROPE, "fp8_e4m3"), KVCacheSpec(1, 64, RANK, ROPE, "bf16")
    if not gluon_gate.runs_on(kern.device, "mla_gluon_kt_ws_kernels"):
        pytest.skip("needs a Hopper GPU and a Triton with Gluon")

    def usable(env):
        if env is None:
            monkeypatch.delenv("DEEPINFER_MLA_KT_WS", raising=False)
        else:
            monkeypatch.setenv("DEEPINFER_MLA_KT_WS", env)
        eager = A.keys_as_m_ws_usable(fp8, kern.device)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            captured = (A.keys_as_m_ws_usable(fp8, kern.device), A.keys_as_m_ws_usable(bf16, kern.device))
        return eager, captured

    assert usable(None) == (False, (True, False))
    assert usable("1") == (True, (True, False))
    assert usable("0") == (False, (False, False))

    def seesaw_tma(env):  # the seesaw kernel's key copies: TMA under capture, as above; FP8 caches only by TMA
        if env is None:
            monkeypatch.delenv("DEEPINFER_MLA_SEESAW_TMA", raising=False)
        else:
            monkeypatch.setenv("DEEPINFER_MLA_SEESAW_TMA", env)
        eager = A.seesaw_tma_usable(), A.seesaw_usable(fp8, kern.device), A.seesaw_usable(bf16, kern.device)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            return eager, (A.seesaw_tma_usable(), A.seesaw_usable(fp8, kern.device), A.seesaw_usable(bf16, kern.device))

    on, off = (True, True, True), (False, False, True)
    assert (seesaw_tma(None), seesaw_tma("1"), seesaw_tma("0")) == ((off, on), (on, on), (off, off))


@pytest.mark.skipif(not GPU, reason="the Gluon kernel runs on Hopper GPUs only (no interpreter)")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("magnitude", [2.0**17, 2.0**-24])
@pytest.mark.parametrize("tma", [False, True])
def test_e4m3_gluon_kernels_take_queries_outside_float16_range(kern, ref, gen, monkeypatch, heads, magnitude, tma):
    """With an FP8 cache the Gluon kernels multiply float16 copies of the queries, each row scaled by a power of
    two: keys-as-M at 16 heads (one warpgroup, or with tma warp-specialised), 64-row tiles at 128 (lockstep, or
    with tma the seesaw). Rows past float16's range (2^17 here) and rows below its subnormals (2^-24) come out as
    the reference's. The scores are those of unscaled queries (the softmax scale divided by the magnitude)."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    monkeypatch.setenv("DEEPINFER_MLA_KT_WS", "1" if tma else "0")
    monkeypatch.setenv("DEEPINFER_MLA_SEESAW_TMA", "1" if tma else "0")
    monkeypatch.setenv("DEEPINFER_MLA_SEESAW", "1")
    spec = KVCacheSpec(1, 64, RANK, ROPE, "fp8_e4m3")
    if not (A.gluon_tile_usable(spec, torch.bfloat16, kern.device) and A.keys_as_m_usable(spec, 16, kern.device)):
        pytest.skip("needs a Hopper GPU and a Triton with Gluon")
    seq_lens = (70, 700, 4100)
    nb, tables = tables_for(seq_lens, 64, gen)
    spec = KVCacheSpec(nb, 64, RANK, ROPE, "fp8_e4m3")
    cache = filled_cache(kern, spec, gen)
    q, qp = queries(kern, len(seq_lens), heads, gen, scale=0.3)
    q, qp = (q.float() * magnitude).bfloat16(), (qp.float() * magnitude).bfloat16()
    assert (q.float().abs().amax() > 65504) == (magnitude > 1)
    batch = AttentionBatch((1,) * len(seq_lens), seq_lens, tables)
    _, out, _ = against_reference(kern, ref, batch, spec, cache, q, qp, RANK**-0.5 / magnitude)
    assert torch.isfinite(out.float()).all()
