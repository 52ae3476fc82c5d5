"""cuda_sm100 kernels beyond the Backend contract, against the reference backend's math.

Masked grouped layout, gate/up fused with SiLU-and-mul (+ FP8 quantisation for the down projection),
the activation quantiser bit for bit, split-K and TMA tile paths, batch invariance, the token sort, and
CUDA-graph capture of the decode path. Runs on the GPU, or on CPU under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import quant
from deepinfer.backends.reference import gemm as ref_gemm
from deepinfer.errors import InvalidInputError
from deepinfer.ops import RoutingSpec, select_experts, silu_and_mul
from deepinfer.weights import LinearWeight


@pytest.fixture
def gemm():
    from deepinfer.backends.cuda_sm100 import gemm

    return gemm


@pytest.fixture
def gemv():
    from deepinfer.backends.cuda_sm100 import gemv

    return gemv


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert out.shape == ref.shape
    return ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item() if ref.numel() else 0.0


def _tol(dev: torch.device, fmt: str) -> float:
    """As test_gemm.py's: GPU FP8 tensor cores accumulate with ~14 bits before the per-128 promotion."""
    return 2e-3 if fmt == "fp8_block" and dev.type == "cuda" else 1e-5


def _weight(gen, shape, fmt, dev):
    return LinearWeight.quantize(torch.randn(*shape, generator=gen) / shape[-1] ** 0.5, fmt).to(dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [200, 7168])
def test_quantizer_is_bitwise_the_reference(cuda_backend, gen, dtype, k, gemm):
    x = (torch.randn(5, k, generator=gen) * 3).to(dtype)
    x[0, :128] = torch.linspace(-31.9, 31.9, 128)  # values rounding across e4m3 binades
    x[1, 5] = 0.0
    x[2, :128] = 0.0  # an all-zero group: the scale floor
    q, s = gemm.quantize_fp8(x.to(cuda_backend.device))
    qr, sr = quant.quantize_fp8_per_token_group(x)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu().float(), qr.float())  # value for value (the interpreter may drop the sign of -0)
    qc, sc = gemm.quantize_fp8(x.to(cuda_backend.device), column_major_scales=True)
    assert torch.equal(sc.cpu(), sr) and sc.stride(0) == 1


@pytest.mark.parametrize("fmt", ["fp8_block", "dense", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_grouped_layout(cuda_backend, gen, fmt, dtype, gemm):
    dev = cuda_backend.device
    counts = [3, 0, 7, 1]
    cap, k, n = 8, 200, 136
    x = torch.randn(len(counts), cap, k, generator=gen).to(dtype)
    lw = _weight(gen, (len(counts), n, k), fmt, dev)
    if fmt == "dense":
        lw = LinearWeight.dense(lw.data.to(dtype))
    out = gemm.grouped_linear_masked(x.to(dev), lw, torch.tensor(counts, device=dev))
    assert out.shape == (len(counts), cap, n) and out.dtype == dtype
    for g, c in enumerate(counts):
        if c:
            want = ref_gemm.linear(x[g, :c], ref_gemm._expert(lw.to(torch.device("cpu")), g))
            assert _rel_err(out[g, :c].float(), want.float()) < (_tol(dev, fmt) if dtype == torch.float32 else 1e-2)


def test_masked_layout_accepts_prequantised_input(cuda_backend, gen, gemm):
    dev = cuda_backend.device
    counts = torch.tensor([2, 5], device=dev)
    x = torch.randn(2, 6, 256, generator=gen).to(dev)
    lw = _weight(gen, (2, 128, 256), "fp8_block", dev)
    q, s = gemm.quantize_fp8(x.reshape(12, 256))
    out = gemm.grouped_linear_masked(q.reshape(2, 6, 256), lw, counts, x_scale=s.reshape(2, 6, 2), out_dtype=torch.float32)
    want = gemm.grouped_linear_masked(x, lw, counts)
    for g, c in enumerate(counts.tolist()):
        assert _rel_err(out[g, :c], want[g, :c]) < 1e-6


def _reference_gate_up(x, lw, sizes):
    """silu_and_mul(grouped_linear(x, gate_up)) in x's dtype, on the CPU reference."""
    w = lw.to(torch.device("cpu"))
    y = ref_gemm.grouped_linear(x, w, torch.tensor(sizes)) if w.data.dim() == 3 else ref_gemm.linear(x, w)
    return silu_and_mul(y)


@pytest.mark.parametrize("layout", ["dense_mlp", "contiguous", "masked"])
def test_fused_gate_up_silu_quant(cuda_backend, gen, layout, gemm, monkeypatch):
    dev = cuda_backend.device
    k, inter = 256, 128
    sizes = [3, 0, 6] if layout != "dense_mlp" else [7]
    x = torch.randn(sum(sizes), k, generator=gen).bfloat16()
    shape = (len(sizes), 2 * inter, k) if layout != "dense_mlp" else (2 * inter, k)
    lw = _weight(gen, shape, "fp8_block", dev)
    want = _reference_gate_up(x, lw, sizes).float()  # [M, inter]
    if layout == "masked":
        cap = 8
        xm = torch.zeros(len(sizes), cap, k, dtype=x.dtype)
        start = 0
        for g, c in enumerate(sizes):
            xm[g, :c] = x[start : start + c]
            start += c
        q, s = gemm.gate_up_silu(xm.to(dev), lw, counts=torch.tensor(sizes, device=dev))
        rows = [(g, r) for g, c in enumerate(sizes) for r in range(c)]
        q = torch.stack([q[g, r] for g, r in rows])
        s = torch.stack([s[g, r] for g, r in rows])
    elif layout == "contiguous":
        q, s = gemm.gate_up_silu(x.to(dev), lw, group_sizes=torch.tensor(sizes, device=dev))
    else:
        q, s = gemm.gate_up_silu(x.to(dev), lw)
    assert q.dtype == quant.FP8_DTYPE and s.shape == (sum(sizes), inter // 128)
    deq = quant.dequantize_fp8_per_token_group(q.cpu(), s.cpu())
    # e4m3 rounding of the result (2^-4 relative, 2^-9 of the group scale near zero), plus a bf16 ulp of the
    # intermediate products where accumulation order differs from the reference.
    per_elem = s.cpu().repeat_interleave(128, -1)
    # (+ the FP8 tensor cores' accumulation error on a GPU, relative to the largest output)
    bound = want.abs() * (2.0**-4 + 2.0**-6) + per_elem * 2.0**-9 + _tol(dev, "fp8_block") * want.abs().max()
    assert ((deq - want).abs() <= bound).all()
    qr, sr = quant.quantize_fp8_per_token_group(want.bfloat16())
    torch.testing.assert_close(s.cpu(), sr, rtol=2e-2, atol=0)
    assert (q.cpu().float() == qr.float()).float().mean() > 0.97
    if layout == "contiguous":  # against this backend's own unfused path (same tensor-core sums): nearly bitwise
        monkeypatch.setenv("DEEPINFER_WM", "0")  # (its few rows would take the weights-as-M kernel's E4M3 sums)
        y = gemm.grouped_linear(x.to(dev), lw, torch.tensor(sizes, device=dev))
        q2, s2 = gemm.quantize_fp8(cuda_backend.ops.silu_and_mul(y))
        torch.testing.assert_close(s.cpu(), s2.cpu(), rtol=1e-2, atol=0)
        assert (q.cpu().float() == q2.cpu().float()).float().mean() > 0.99


@pytest.mark.parametrize("fmt", ["dense", "nvfp4", "fp8_block"])
def test_fused_gate_up_silu_unquantised(cuda_backend, gen, fmt, gemm):
    dev = cuda_backend.device
    sizes = [4, 2]
    x = torch.randn(6, 96, generator=gen)
    lw = _weight(gen, (2, 2 * 40, 96), fmt, dev)
    out = gemm.gate_up_silu(x.to(dev), lw, group_sizes=torch.tensor(sizes, device=dev), quantize=False)
    assert out.shape == (6, 40) and out.dtype == torch.float32
    assert _rel_err(out, _reference_gate_up(x, lw, sizes)) < _tol(dev, fmt)


def test_fused_gate_up_rejects_bad_shapes(cuda_backend, gen, gemm):
    dev = cuda_backend.device
    x = torch.randn(4, 256, generator=gen).to(dev)
    with pytest.raises(InvalidInputError):
        gemm.gate_up_silu(x, _weight(gen, (2 * 96, 256), "fp8_block", dev))  # I = 96: not a multiple of 128
    with pytest.raises(InvalidInputError):
        gemm.gate_up_silu(x, _weight(gen, (2, 256, 256), "fp8_block", dev), group_sizes=torch.tensor([1, 1], device=dev))


def test_silu_and_mul_quant_matches_two_steps(cuda_backend, gen):
    x = (torch.randn(9, 512, generator=gen) * 4).bfloat16()
    q, s = cuda_backend.ops.silu_and_mul_quant(x.to(cuda_backend.device))
    qr, sr = quant.quantize_fp8_per_token_group(silu_and_mul(x))
    torch.testing.assert_close(s.cpu(), sr, rtol=1e-2, atol=0)
    deq, want = quant.dequantize_fp8_per_token_group(q.cpu(), s.cpu()), silu_and_mul(x).float()
    assert ((deq - want).abs() <= want.abs() * (2.0**-4 + 2.0**-7) + s.cpu().repeat_interleave(128, -1) * 2.0**-9).all()


@pytest.mark.parametrize("fmt", ["fp8_block", "dense", "nvfp4"])
@pytest.mark.parametrize("variant", ["split_k", "tma", "small_tiles", "large_m"])
def test_tile_variants_agree(cuda_backend, gen, fmt, variant, gemm):
    """Forced tile configurations (split-K with its reduction, TMA descriptors, the large-M tile with its
    grouped tile order) give the reference result."""
    dev = cuda_backend.device
    m, k, n = (40, 512, 136) if variant != "large_m" else (200, 448, 392)  # 448: a partial last K block
    x = torch.randn(m, k, generator=gen)
    lw = _weight(gen, (n, k), fmt, dev)
    bk = 128 if fmt == "fp8_block" else 64
    cfg = {
        "split_k": gemm.TileConfig(bm=64, bn=64, bk=bk, warps=4, stages=2, split_k=4),
        "tma": gemm.TileConfig(bm=64, bn=64, bk=bk, warps=4, stages=3, tma=True),
        "small_tiles": gemm.TileConfig(bm=16, bn=32, bk=bk, warps=4, stages=2, group_m=2),
        "large_m": gemm.TileConfig(bm=64, bn=128, bk=bk, warps=4, stages=3, group_m=16, tma=True),
    }[variant]
    out = gemm.linear(x.to(dev), lw, cfg=cfg, dense_triton=True)
    assert _rel_err(out, ref_gemm.linear(x, lw.to(torch.device("cpu")))) < _tol(dev, fmt)


@pytest.mark.parametrize("fmt", ["fp8_block", "dense"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_grouped_split_k(cuda_backend, gen, fmt, layout, gemm):
    """Split-K over grouped layouts (decode: few rows per expert, the weight spread over more CTAs): each
    split's float32 partials summed by the reduction give the reference result, empty groups included."""
    dev = cuda_backend.device
    counts, k, n = [2, 0, 5, 1], 512, 136
    lw = _weight(gen, (len(counts), n, k), fmt, dev)
    cfg = gemm.TileConfig(bm=16, bn=64, bk=128 if fmt == "fp8_block" else 64, warps=4, stages=2, split_k=4)
    cpu = lw.to(torch.device("cpu"))
    if layout == "contiguous":
        x = torch.randn(sum(counts), k, generator=gen)
        out = gemm.grouped_linear(x.to(dev), lw, torch.tensor(counts, device=dev), cfg=cfg)
        assert _rel_err(out, ref_gemm.grouped_linear(x, cpu, torch.tensor(counts))) < _tol(dev, fmt)
        return
    cap = 6
    x = torch.randn(len(counts), cap, k, generator=gen)
    out = gemm.grouped_linear_masked(x.to(dev), lw, torch.tensor(counts, device=dev), cfg=cfg)
    for g, c in enumerate(counts):
        if c:
            assert _rel_err(out[g, :c], ref_gemm.linear(x[g, :c], ref_gemm._expert(cpu, g))) < _tol(dev, fmt)


def test_batch_invariant_rows(cuda_backend, gen, gemm):
    dev = cuda_backend.device
    lw = _weight(gen, (256, 512), "fp8_block", dev)
    x = torch.randn(70, 512, generator=gen).bfloat16().to(dev)
    full = gemm.linear(x, lw, batch_invariant=True)
    for r in (0, 33, 69):
        assert torch.equal(gemm.linear(x[r : r + 1], lw, batch_invariant=True), full[r : r + 1])


@pytest.mark.parametrize("capacity", [None, 3])
def test_token_sort(cuda_backend, gen, capacity):
    dev = cuda_backend.device
    t, k, e = 150, 4, 12
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    st = cuda_backend.ops.sort_tokens(ids.to(dev), e, capacity)
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert torch.equal(st.group_sizes.cpu(), counts) and st.group_sizes.dtype == torch.int64
    pair_of_row, row_of_pair = st.pair_of_row.cpu().long(), st.row_of_pair.cpu().long()
    flat = ids.flatten()
    if capacity is None:
        # A stable sort by expert: the reference order is torch's stable argsort.
        assert torch.equal(pair_of_row, torch.sort(flat, stable=True).indices)
        assert torch.equal(row_of_pair.flatten()[pair_of_row], torch.arange(t * k))
    else:
        for ex in range(e):
            mine = [p for p in range(t * k) if flat[p] == ex]
            kept = mine[:capacity]
            rows = pair_of_row[ex * capacity : (ex + 1) * capacity]
            assert rows.tolist() == kept + [-1] * (capacity - len(kept))
            for j, p in enumerate(mine):
                assert row_of_pair.flatten()[p] == (ex * capacity + j if j < capacity else -1)
    assert torch.equal(st.token_of_row().cpu(), torch.where(pair_of_row >= 0, pair_of_row // k, 0))


@pytest.mark.parametrize("tokens", [1, 100])
def test_v3_routing_at_scale(cuda_backend, gen, tokens):
    spec = RoutingSpec(num_experts=256, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    logits = torch.randn(tokens, 256, generator=gen) * 2
    bias = torch.randn(256, generator=gen) * 0.1
    w, ids = cuda_backend.ops.select_experts(logits.to(cuda_backend.device), spec, bias.to(cuda_backend.device))
    wr, idr = select_experts(logits, spec, bias)
    for t in range(tokens):
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        want = dict(zip(idr[t].tolist(), wr[t].tolist()))
        assert set(got) == set(want)
        assert all(abs(got[e] - want[e]) <= 1e-5 * abs(want[e]) + 1e-7 for e in want)


def test_moe_decode_path_under_cuda_graph(cuda_backend, gen, gemm):
    """Routing, sort, masked gate/up+SiLU+quant and masked down projection, captured once and replayed."""
    if cuda_backend.device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    dev = cuda_backend.device
    e, k_top, hidden, inter, t, cap = 16, 2, 512, 256, 8, 8
    spec = RoutingSpec(num_experts=e, top_k=k_top, n_group=4, topk_group=2)
    w13 = _weight(gen, (e, 2 * inter, hidden), "fp8_block", dev)
    w2 = _weight(gen, (e, hidden, inter), "fp8_block", dev)
    logits = torch.randn(t, e, generator=gen).to(dev)
    x = torch.randn(t, hidden, generator=gen).bfloat16().to(dev)
    ops = cuda_backend.ops

    def step():
        weights, ids = ops.select_experts(logits, spec)
        st = ops.sort_tokens(ids, e, cap)
        xm = x[st.token_of_row()].reshape(e, cap, hidden)
        q, s = gemm.gate_up_silu(xm, w13, counts=st.group_sizes)
        return gemm.grouped_linear_masked(q, w2, st.group_sizes, x_scale=s), st, weights

    eager, st_e, _ = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, st_c, _ = step()
    logits.copy_(torch.randn(t, e, generator=gen).to(dev))
    graph.replay()
    again, st_a, _ = step()
    torch.cuda.synchronize()
    valid = st_a.pair_of_row.reshape(e, cap) >= 0
    assert torch.equal(st_c.pair_of_row, st_a.pair_of_row)
    assert torch.equal(captured[valid], again[valid])


def test_group_tile_map_covers_every_row_once(cuda_backend, gen):
    """group_tile_map_kernel (the Gluon GEMM's tile map): each group's rows cut into BM-row tiles in order,
    entries past the last tile empty."""
    from deepinfer.backends.cuda_sm100 import gemm_kernels

    dev = cuda_backend.device
    groups, bm = 12, 128
    sizes = torch.randint(0, 300, (groups,), generator=gen)
    sizes[3] = 0
    m = int(sizes.sum())
    t = -(-m // bm) + groups
    tmap = torch.full((t, 3), -7, dtype=torch.int32, device=dev)
    gemm_kernels.group_tile_map_kernel[(t,)](sizes.to(dev), tmap, m, groups, t, BM=bm, G_P=16)
    want, start = [], 0
    for g, size in enumerate(sizes.tolist()):
        want += [(g, r, start + size) for r in range(start, start + size, bm)]
        start += size
    got = [tuple(e) for e in tmap.cpu().tolist()]
    assert got[:len(want)] == want
    assert all(end <= row0 for _, row0, end in got[len(want):])


@pytest.mark.parametrize("fmt,x_kind", [("dense", "bf16"), ("dense", "fp16"), ("fp8_block", "bf16"),
                                        ("fp8_block", "fp32"), ("fp8_block", "fp8_activations")])
@pytest.mark.parametrize("k,n,bk", [(200, 37, None), (300, 64, 128), (1024, 300, 256), (65, 9, None)])
@pytest.mark.parametrize("gated", [False, True])
def test_decode_gemv_matches_the_reference(cuda_backend, gen, gemv, fmt, x_kind, k, n, bk, gated):
    """The batch-1 GEMV: K steps that do not divide K, N not a multiple of the program's rows (nor of 128, the FP8
    blocks); dense 16-bit weights, and FP8 block weights meeting 16-bit rows (quantised in the kernel, as the
    GEMM path quantises them) or already-quantised ones. Against the reference backend's linear on the same
    weight and inputs; gated (a [gate; up] weight), against silu(gate) * up of the reference's projection."""
    dev = cuda_backend.device
    dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(x_kind, torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = LinearWeight.quantize((torch.randn(2 * n if gated else n, k, generator=gen) / k**0.5).to(dtype), fmt)
    if x_kind == "fp8_activations":
        q, s = quant.quantize_fp8_per_token_group(x.float())
        x = quant.Fp8Activations(q, s, torch.bfloat16)
    ref = ref_gemm.linear(x, w)
    if gated:
        ref = silu_and_mul(ref)
    x_dev = quant.Fp8Activations(x.data.to(dev), x.scale.to(dev), x.dtype) if x_kind == "fp8_activations" else x.to(dev)
    out = gemv.gemv(x_dev, w.to(dev), gated, bk=bk)
    assert out.dtype == ref.dtype == dtype and out.shape == (1, n)
    assert _rel_err(out, ref) < {torch.bfloat16: 8e-3, torch.float16: 1e-3}.get(dtype, 1e-5)  # the output's rounding
    if fmt == "fp8_block" and x_kind != "fp8_activations":  # quantised in the kernel = quantised ahead, bit for bit
        q, s = quant.quantize_fp8_per_token_group(x.float())
        ahead = quant.Fp8Activations(q.to(dev), s.to(dev), dtype)
        assert torch.equal(gemv.gemv(ahead, w.to(dev), gated, bk=bk), out)
    if dev.type == "cuda":  # the backend's linear takes one row on the GEMV
        assert gemv.gemv_usable(x_dev, w.to(dev))


@pytest.mark.parametrize("fmt,x_kind", [("dense", "bf16"), ("fp8_block", "bf16"), ("fp8_block", "fp8")])
# Leading, inner and repeated empty groups, a group of several rows, one group, and a tail of one-row groups
# after an empty one ([1, 0, 1, 1, 0, 0, 1] added nothing to these and ~70 s to the interpreter's run).
@pytest.mark.parametrize("sizes", [[0, 2, 0, 0, 1, 3], [1], [2, 0, 1, 1, 1]], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("gated", [False, True])
def test_grouped_decode_gemv_matches_per_group_reference(cuda_backend, gen, gemv, fmt, x_kind, sizes, gated):
    """Rows sorted by expert (empty groups, a group of several rows, one group) each times its expert's weight on
    the grouped GEMV: as grouped_linear (16-bit rows, quantised in the kernel for E4M3 weights, or E4M3 rows with
    their scales) and as gate_up_silu; against the reference's per-group projections, and bit for bit between
    rows quantised in the kernel and the same rows quantised ahead."""
    dev = cuda_backend.device
    groups, m, k, n = len(sizes), sum(sizes), 300, 136
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = LinearWeight.quantize((torch.randn(groups, 2 * n if gated else n, k, generator=gen) / k**0.5).bfloat16(), fmt)
    sizes_dev = torch.tensor(sizes, dtype=torch.int64, device=dev)
    q, s = quant.quantize_fp8_per_token_group(x.float())
    x_in, x_scale = (q.to(dev), s.to(dev)) if x_kind == "fp8" else (x.to(dev), None)
    ref = ref_gemm.grouped_linear(x, w, torch.tensor(sizes))  # E4M3 weights: the reference quantises x as above
    if gated:
        ref = silu_and_mul(ref)
    out = gemv.gemv_grouped(x_in, w.to(dev), sizes_dev, x_scale, gated=gated)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _rel_err(out, ref) < 8e-3  # the output's rounding
    # sizes and the first weight slab read before the PDL wait (sizes settled): the same bits
    assert torch.equal(gemv.gemv_grouped(x_in, w.to(dev), sizes_dev, x_scale, gated=gated, sizes_early=True), out)
    # the trailing groups of one row each (a token's shared-expert slices) computed before the wait, without the
    # sizes, their programs scheduled first: the same bits
    tail = next(i for i in range(groups + 1) if i == groups or sizes[groups - 1 - i] != 1)
    assert torch.equal(gemv.gemv_grouped(x_in, w.to(dev), sizes_dev, x_scale, gated=gated, settled_tail=tail), out)
    if fmt == "fp8_block" and gated:  # the tiles an E4M3 gate/up takes by default, given explicitly: the same
        bn, bk, warps = gemv.FP8_GATED_TILES
        assert gemv.default_tiles(w, k, None, None, None, expert_gate_up=True) == (bn, bk, warps)
        tiled = gemv.gemv_grouped(x_in, w.to(dev), sizes_dev, x_scale, gated=True, bn=bn, bk=bk, warps=warps)
        assert _rel_err(tiled, ref) < 8e-3
    if fmt == "fp8_block" and x_kind == "bf16":
        assert torch.equal(gemv.gemv_grouped(q.to(dev), w.to(dev), sizes_dev, s.to(dev), gated=gated), out)
    if dev.type == "cuda":  # 16-bit experts take the grouped GEMV; E4M3 ones the tile, but for a gate/up of 16-bit rows
        assert gemv.gemv_grouped_fits(x_in, w.to(dev), x_scale)
        assert gemv.gemv_grouped_usable(x_in, w.to(dev), x_scale) == (fmt == "dense")
        # an E4M3 gate/up of 16-bit rows takes the GEMV (its rows quantised in the kernel)
        assert gemv.gemv_grouped_usable(x_in, w.to(dev), x_scale, gated=True) == (fmt == "dense" or x_kind == "bf16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,k,n", [(4, 128, 512), (3, 200, 136)])
def test_per_head_decode_gemv_matches_the_reference(cuda_backend, gen, gemv, dtype, h, k, n):
    """MLA's absorbed projections at one token on the GEMV: each head's row (a strided view, as q[..., :nope]
    is) times its own matrix, against float64 math and the reference's grouped projection (a head a group)."""
    dev = cuda_backend.device
    x = torch.randn(1, h, k + 64, generator=gen).to(dtype)[..., :k]
    w = LinearWeight.dense((torch.randn(h, n, k, generator=gen) / k**0.5).to(dtype))
    out = gemv.gemv_per_head(x.to(dev), w.to(dev))
    assert out.shape == (1, h, n) and out.dtype == dtype
    assert _rel_err(out, torch.einsum("thk,hnk->thn", x.double(), w.data.double())) < 8e-3  # the output's rounding
    assert _rel_err(out[0], ref_gemm.grouped_linear(x[0], w, torch.ones(h, dtype=torch.int64))) < 8e-3
    if dev.type == "cuda":  # the backend's per_head_linear takes one token on the GEMV, more on the tile
        assert gemv.gemv_per_head_usable(x.to(dev), w.to(dev))
        assert not gemv.gemv_per_head_usable(torch.cat([x, x]).to(dev), w.to(dev))


@pytest.mark.parametrize("fmt,k,want", [
    ("dense", 2048, (8, 1024, 4)),  # 16 KiB of weight a row group a step
    ("dense", 1408, (16, 512, 4)),  # 1024-wide steps would pad K by 45%: half the step, twice the rows
    ("dense", 300, (8, 512, 2)),  # no narrower step pads less: the widest that covers K
    ("fp8_block", 7168, (8, 2048, 8)),
    ("fp8_block", 1536, (32, 512, 8)),
])
def test_gemv_tiles_pad_k_little_and_keep_the_slab(gemv, gen, fmt, k, want):
    """The GEMV's default tiles: the widest K step (16 KiB a row group) unless it pads K by more than an eighth,
    then the widest narrower one that does not (or pads least), with the rows a program scaled to keep the
    slab; checked by the rule's own terms on fresh widths too."""
    w = LinearWeight.quantize(torch.randn(16, k, generator=gen).bfloat16(), fmt)
    assert gemv.default_tiles(w, k, None, None, None) == want
    elt = w.data.element_size()
    for k in torch.randint(128, 20000, (50,), generator=gen).tolist():
        bn, bk, warps = gemv.default_tiles(w, k, None, None, None)
        widest = min(2048 // elt, max(128, 1 << (k - 1).bit_length()))
        padded = lambda step: -(-k // step) * step  # noqa: E731
        assert bn * bk == 8 * widest and bk >= 128 and warps == max(1, min(8, bn * bk // 2048))
        narrower = [widest >> i for i in range(4) if widest >> i >= 256]
        if padded(bk) * 7 > k * 8:  # no candidate pads K by at most an eighth: the least padding
            assert padded(bk) == min(map(padded, narrower or [widest]))
        else:  # the widest that pads at most an eighth
            assert all(padded(s) * 7 > k * 8 for s in narrower if s > bk)
