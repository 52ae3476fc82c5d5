"""Conformance of a backend's MLA attention over the paged latent cache (write_cache / run_attention).

The reference point is naive multi-head attention on decompressed keys and values in float64:
k_h = [c_kv @ W_UK[h]^T ; k_pe], v_h = c_kv @ W_UV[h]^T. The backend sees the absorbed form
(q_nope = q @ W_UK, output multiplied by W_UV^T here), so agreement checks the absorption algebra, the paged
layout, the causal mask and the log-sum-exp at once. Cache contents are decoded here from the documented
layout (KVCacheSpec), independently of any backend's code.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.attention import AttentionBatch, KVCacheSpec
from deepinfer.errors import InvalidInputError
from deepinfer.quant import FP8_BLOCK, FP8_MAX, cdiv

Q_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.bfloat16}
# Max-norm error relative to the expected tensor's max, against the naive on the values the cache holds:
# float32 math on exact values, or bf16 rounding of q and out (observed ~2e-7 and ~3e-3).
OUT_TOL = {"fp32": 1e-4, "bf16": 1e-2, "fp8_e4m3": 1e-2}
LSE_TOL = {"fp32": 1e-4, "bf16": 1e-2, "fp8_e4m3": 1e-2}
# FP8 latent (3 mantissa bits) against the unquantised values (observed up to ~0.06 for out, ~0.02 for lse).
FP8_VS_EXACT_OUT_TOL, FP8_VS_EXACT_LSE_TOL = 0.15, 0.05


def need_kv_dtype(backend, kv_dtype: str) -> None:
    if kv_dtype not in backend.capabilities.kv_cache_dtypes:
        pytest.skip(f"{backend.name} has no {kv_dtype} kv cache")


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def random_tables(gen, seq_lens, block_size, spare=2):
    """Blocks handed out in a random order, with spares that no sequence uses."""
    need = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, k = [], 0
    for n in need:
        tables.append(tuple(perm[k : k + n]))
        k += n
    return num_blocks, tuple(tables)


def new_cache(backend, spec, gen):
    """A cache whose every slot holds large finite garbage (written by the backend), so stray reads show."""
    cache = backend.allocate_kv_cache(spec)
    n = spec.num_blocks * spec.block_size
    plan = backend.plan_attention(AttentionBatch((n,), (n,), (tuple(range(spec.num_blocks)),)), spec)
    dev = backend.device
    backend.write_cache(plan, cache, randn(gen, n, spec.kv_lora_rank, scale=30).float().to(dev),
                        randn(gen, n, spec.rope_dim, scale=30).float().to(dev))
    return cache


def read_tokens(spec, cache, table, n):
    """Decode a sequence's first n tokens from the cache per the documented layout, in float64."""
    rows = cache.cpu()[list(table)].reshape(-1, spec.entry_size)[:n]
    r = spec.kv_lora_rank
    if not spec.is_fp8:
        return rows[:, :r].double(), rows[:, r:].double()
    s_end = r + 4 * spec.num_scales
    q = rows[:, :r].contiguous().view(torch.float8_e4m3fn).double()
    scales = rows[:, r:s_end].contiguous().view(torch.float32).double()
    rope = rows[:, s_end:].contiguous().view(torch.bfloat16).double()
    return q * scales.repeat_interleave(FP8_BLOCK, dim=-1)[:, :r], rope


def fp8_bound(x):
    """Per-element E4M3 error bound for x [N, R] under per-128-group scales amax/448: 3 mantissa bits
    (|x|/16) plus the subnormal step (2^-9 in scaled units)."""
    n, r = x.shape
    groups = torch.nn.functional.pad(x.abs(), (0, cdiv(r, FP8_BLOCK) * FP8_BLOCK - r)).reshape(n, -1, FP8_BLOCK)
    scale = (groups.amax(-1) / FP8_MAX).repeat_interleave(FP8_BLOCK, -1)[:, :r]
    return x.abs() / 16 + scale * 2**-9


def naive_mla(c_seqs, kpe_seqs, q_raw, q_pe, w_uk, w_uv, query_lens, scale):
    """Plain causal attention per head on decompressed k/v in float64 -> (out [T, H, v_dim], lse [T, H])."""
    heads = w_uk.shape[0]
    outs, lses, t = [], [], 0
    for c, kpe, ql in zip(c_seqs, kpe_seqs, query_lens):
        s = c.shape[0]
        k = torch.cat([torch.einsum("sr,hdr->hsd", c, w_uk), kpe.expand(heads, s, -1)], dim=-1)
        v = torch.einsum("sr,hvr->hsv", c, w_uv)
        q = torch.cat([q_raw[t : t + ql], q_pe[t : t + ql]], dim=-1).transpose(0, 1)  # [H, ql, d]
        scores = scale * q @ k.transpose(1, 2)
        future = torch.arange(s)[None, :] > torch.arange(s - ql, s)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
        lses.append(torch.logsumexp(scores, dim=-1).transpose(0, 1))
        t += ql
    return torch.cat(outs), torch.cat(lses)


def assert_rel(actual, expected, tol, what):
    err = (actual.double().cpu() - expected).abs().max().item()
    ref = expected.abs().max().item()
    assert err <= tol * ref, f"{what}: max error {err:.3g} exceeds {tol:g} x max |expected| {ref:.3g}"


def run_mla(backend, gen, spec, tables, query_lens, seq_lens, c_seqs, kpe_seqs, q_nope, q_pe, scale):
    """Engine-like steps: write each sequence's cached prefix, then this step's tokens, then attend."""
    dev = backend.device
    cache = new_cache(backend, spec, gen)
    prefix = [i for i, (q, s) in enumerate(zip(query_lens, seq_lens)) if s > q]
    if prefix:
        lens = tuple(seq_lens[i] - query_lens[i] for i in prefix)
        plan = backend.plan_attention(AttentionBatch(lens, lens, tuple(tables[i] for i in prefix)), spec)
        backend.write_cache(plan, cache, torch.cat([c_seqs[i][: n] for i, n in zip(prefix, lens)]).float().to(dev),
                            torch.cat([kpe_seqs[i][: n] for i, n in zip(prefix, lens)]).float().to(dev))
    plan = backend.plan_attention(AttentionBatch(tuple(query_lens), tuple(seq_lens), tables), spec)
    new_c = torch.cat([c[s - q :] for c, q, s in zip(c_seqs, query_lens, seq_lens)])
    new_kpe = torch.cat([k[s - q :] for k, q, s in zip(kpe_seqs, query_lens, seq_lens)])
    backend.write_cache(plan, cache, new_c.float().to(dev), new_kpe.float().to(dev))
    out, lse = backend.run_attention(plan, cache, q_nope.to(dev), q_pe.to(dev), scale, return_lse=True)
    assert out.shape == q_nope.shape and out.dtype == q_nope.dtype
    assert lse.shape == q_nope.shape[:2] and lse.dtype == torch.float32
    return cache, out, lse


def mla_case(backend, gen, kv_dtype, query_lens, seq_lens, heads, block_size, rank, rope):
    """Random problem, run through the backend; returns what the checks need."""
    dn, dv = (128, 128) if rank == 512 else (24, 20)
    num_blocks, tables = random_tables(gen, seq_lens, block_size)
    spec = KVCacheSpec(num_blocks, block_size, rank, rope, kv_dtype)
    c_seqs = [randn(gen, s, rank) for s in seq_lens]
    kpe_seqs = [randn(gen, s, rope) for s in seq_lens]
    w_uk, w_uv = randn(gen, heads, dn, rank, scale=rank**-0.5), randn(gen, heads, dv, rank, scale=rank**-0.5)
    t = sum(query_lens)
    q_raw, q_pe = randn(gen, t, heads, dn), randn(gen, t, heads, rope)
    q_nope = torch.einsum("thd,hdr->thr", q_raw, w_uk).to(Q_DTYPE[kv_dtype])
    scale = (dn + rope) ** -0.5
    cache, out, lse = run_mla(backend, gen, spec, tables, query_lens, seq_lens, c_seqs, kpe_seqs,
                              q_nope, q_pe.to(Q_DTYPE[kv_dtype]), scale)
    stored = [read_tokens(spec, cache, tab, s) for tab, s in zip(tables, seq_lens)]
    q_pe_used = q_pe.to(Q_DTYPE[kv_dtype]).double()  # the naive sees the q_pe values the backend got
    ref = naive_mla([c for c, _ in stored], [k for _, k in stored], q_raw, q_pe_used, w_uk, w_uv, query_lens, scale)
    exact = naive_mla(c_seqs, kpe_seqs, q_raw, q_pe_used, w_uk, w_uv, query_lens, scale) if spec.is_fp8 else None
    out_v = torch.einsum("thr,hvr->thv", out.double().cpu(), w_uv)
    return dict(spec=spec, c_seqs=c_seqs, kpe_seqs=kpe_seqs, stored=stored, out_v=out_v, lse=lse, ref=ref, exact=exact)


# id: (query_lens, seq_lens, heads, block_size, kv_lora_rank, rope_dim)
CASES = {
    "decode-ragged": ((1,) * 8, (1, 5, 16, 17, 31, 33, 64, 65), 3, 16, 32, 16),
    "decode-odd-block-1-head": ((1, 1, 1), (1, 7, 12), 1, 5, 32, 16),
    "spec-verify": ((2, 3, 5, 8), (2, 9, 20, 40), 16, 16, 32, 16),
    "prefill": ((7, 20), (7, 20), 3, 5, 32, 16),
    "chunked-prefill": ((6, 17, 1), (30, 17, 50), 16, 64, 32, 16),
    "long-chunked-prefill": ((500, 1), (700, 3), 16, 64, 32, 16),
    "decode-real-dims-128-heads": ((1, 1, 1), (1, 70, 130), 128, 64, 512, 64),
    "spec-real-dims-128-heads": ((4, 2), (67, 2), 128, 64, 512, 64),
    "chunked-prefill-real-dims": ((40, 3), (100, 3), 16, 64, 512, 64),
}


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_absorbed_mla_matches_naive(backend, gen, case, kv_dtype):
    need_kv_dtype(backend, kv_dtype)
    r = mla_case(backend, gen, kv_dtype, *CASES[case])
    for (c, kpe), c_in, kpe_in in zip(r["stored"], r["c_seqs"], r["kpe_seqs"]):
        dt = r["spec"].torch_dtype  # float caches store the inputs rounded to their dtype, nothing else
        assert torch.equal(c, c_in.float().to(dt).double()) and torch.equal(kpe, kpe_in.float().to(dt).double())
    assert_rel(r["out_v"], r["ref"][0], OUT_TOL[kv_dtype], "out @ W_UV vs naive")
    assert_rel(r["lse"], r["ref"][1], LSE_TOL[kv_dtype], "lse vs naive")


@pytest.mark.parametrize("case", ["decode-ragged", "chunked-prefill", "spec-real-dims-128-heads", "chunked-prefill-real-dims"])
def test_fp8_cache_attention(backend, gen, case):
    need_kv_dtype(backend, "fp8_e4m3")
    r = mla_case(backend, gen, "fp8_e4m3", *CASES[case])
    for (c, kpe), c_in, kpe_in in zip(r["stored"], r["c_seqs"], r["kpe_seqs"]):
        assert torch.equal(kpe, kpe_in.float().to(torch.bfloat16).double())
        assert ((c - c_in).abs() <= fp8_bound(c_in) + 1e-12).all(), "fp8 latent error beyond E4M3 rounding"
    assert_rel(r["out_v"], r["ref"][0], OUT_TOL["fp8_e4m3"], "out vs naive on dequantised cache")
    assert_rel(r["lse"], r["ref"][1], LSE_TOL["fp8_e4m3"], "lse vs naive on dequantised cache")
    assert_rel(r["out_v"], r["exact"][0], FP8_VS_EXACT_OUT_TOL, "out vs naive on unquantised values")
    assert_rel(r["lse"], r["exact"][1], FP8_VS_EXACT_LSE_TOL, "lse vs naive on unquantised values")


@pytest.mark.parametrize("rank,rope", [(512, 64), (200, 16)])
def test_fp8_cache_byte_layout(backend, gen, rank, rope):
    need_kv_dtype(backend, "fp8_e4m3")
    spec = KVCacheSpec(3, 4, rank, rope, "fp8_e4m3")
    nscale = cdiv(rank, FP8_BLOCK)
    assert spec.entry_size == spec.bytes_per_token == rank + 4 * nscale + 2 * rope
    if rank == 512:
        assert spec.bytes_per_token == 656
    cache = backend.allocate_kv_cache(spec)
    assert cache.shape == spec.shape and cache.dtype == torch.uint8
    c_kv = randn(gen, 5, rank, scale=3).float()
    c_kv[1] *= 1e-3  # scales must follow each token's own magnitude
    k_pe = randn(gen, 5, rope).float()
    plan = backend.plan_attention(AttentionBatch((5,), (5,), ((2, 0),)), spec)
    backend.write_cache(plan, cache, c_kv.to(backend.device), k_pe.to(backend.device))
    rows = cache.cpu()[[2, 0]].reshape(-1, spec.entry_size)[:5]
    scales = rows[:, rank : rank + 4 * nscale].contiguous().view(torch.float32)
    padded = torch.nn.functional.pad(c_kv, (0, nscale * FP8_BLOCK - rank))
    want = padded.abs().reshape(5, nscale, FP8_BLOCK).amax(-1) / FP8_MAX
    torch.testing.assert_close(scales, want, rtol=1e-6, atol=0)
    rope_vals = rows[:, rank + 4 * nscale :].contiguous().view(torch.bfloat16)
    assert torch.equal(rope_vals, k_pe.to(torch.bfloat16))
    q = rows[:, :rank].contiguous().view(torch.float8_e4m3fn).float()
    q_groups = torch.nn.functional.pad(q.abs(), (0, nscale * FP8_BLOCK - rank)).reshape(5, nscale, FP8_BLOCK)
    assert (q_groups.amax(-1) == FP8_MAX).all(), "each group's largest value must map to E4M3's max"
    deq = q * scales.repeat_interleave(FP8_BLOCK, -1)[:, :rank]
    assert ((deq - c_kv).abs() <= fp8_bound(c_kv) + 1e-12).all()
    assert (cache.cpu()[1] == 0).all(), "block 1 is in no table and must stay untouched"


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp16", "fp8_e4m3"])
def test_write_touches_only_planned_slots(backend, gen, kv_dtype):
    need_kv_dtype(backend, kv_dtype)
    bs, query_lens, seq_lens = 5, (1, 4, 7), (9, 4, 12)
    num_blocks, tables = random_tables(gen, seq_lens, bs, spare=3)
    spec = KVCacheSpec(num_blocks, bs, 32, 16, kv_dtype)
    cache = new_cache(backend, spec, gen)
    before = cache.cpu().view(torch.uint8).reshape(num_blocks * bs, -1).clone()
    plan = backend.plan_attention(AttentionBatch(query_lens, seq_lens, tables), spec)
    c_kv, k_pe = randn(gen, 12, 32).float(), randn(gen, 12, 16).float()
    backend.write_cache(plan, cache, c_kv.to(backend.device), k_pe.to(backend.device))
    after = cache.cpu().view(torch.uint8).reshape(num_blocks * bs, -1)
    slots = [tab[p // bs] * bs + p % bs for tab, q, s in zip(tables, query_lens, seq_lens) for p in range(s - q, s)]
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(after[untouched], before[untouched]), "write_cache changed slots outside the plan"
    c_read, kpe_read = read_tokens(spec, cache, range(num_blocks), num_blocks * bs)
    assert torch.equal(kpe_read[slots], k_pe.to(torch.bfloat16 if spec.is_fp8 else spec.torch_dtype).double())
    if spec.is_fp8:  # E4M3 rounding against each token's own 128-group scale
        assert ((c_read[slots] - c_kv.double()).abs() <= fp8_bound(c_kv.double()) + 1e-12).all()
    else:
        assert torch.equal(c_read[slots], c_kv.to(spec.torch_dtype).double())


def test_permuted_block_tables_match_contiguous(backend, gen):
    need_kv_dtype(backend, "bf16")
    bs, query_lens, seq_lens, heads = 16, (1, 3, 10), (40, 19, 33), 8
    c_seqs = [randn(gen, s, 32) for s in seq_lens]
    kpe_seqs = [randn(gen, s, 16) for s in seq_lens]
    q_nope = randn(gen, 14, heads, 32, scale=0.3).bfloat16()
    q_pe = randn(gen, 14, heads, 16).bfloat16()
    results = []
    for permuted in (False, True):
        if permuted:
            num_blocks, tables = random_tables(gen, seq_lens, bs, spare=4)
        else:
            need = [cdiv(s, bs) for s in seq_lens]
            num_blocks, starts = sum(need), [sum(need[:i]) for i in range(len(need))]
            tables = tuple(tuple(range(a, a + n)) for a, n in zip(starts, need))
        spec = KVCacheSpec(num_blocks, bs, 32, 16, "bf16")
        results.append(run_mla(backend, gen, spec, tables, query_lens, seq_lens, c_seqs, kpe_seqs, q_nope, q_pe, 0.2)[1:])
    (out_a, lse_a), (out_b, lse_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(lse_b, lse_a, rtol=1e-5, atol=1e-5)


# --- bad inputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("rank,rope,heads", [(512, 64, 16), (32, 16, 3)])
def test_rope_norm_and_write_cache_is_the_composition(backend, gen, kv_dtype, rank, rope, heads):
    """The MLA cache update with its ropes (one launch on cuda_sm100) stores exactly what mla_rope_and_norm then
    write_cache store on the same backend, and returns the same roped q_pe, bit for bit; other slots untouched."""
    from deepinfer.backend import Backend
    from deepinfer.ops.rope import RopeSpec

    need_kv_dtype(backend, kv_dtype)
    bs, query_lens, seq_lens = 16, (1, 5, 2), (9, 21, 2)
    num_blocks, tables = random_tables(gen, seq_lens, bs, spare=2)
    spec = KVCacheSpec(num_blocks, bs, rank, rope, kv_dtype)
    plan = backend.plan_attention(AttentionBatch(query_lens, seq_lens, tables), spec)
    dev, t = backend.device, sum(query_lens)
    q_pe = randn(gen, t, heads, rope).bfloat16().to(dev)
    kv = randn(gen, t, rank + rope, scale=2).bfloat16().to(dev)
    weight = (torch.rand(rank, generator=gen) + 0.5).bfloat16().to(dev)
    cos_sin = RopeSpec(rope, 10000.0).cos_sin_cache(64, dev)
    fused = new_cache(backend, spec, gen)
    composed = fused.clone()
    q_fused = backend.rope_norm_and_write_cache(plan, fused, q_pe, kv, weight, 1e-6, cos_sin, False)
    q_composed = Backend.rope_norm_and_write_cache(backend, plan, composed, q_pe, kv, weight, 1e-6, cos_sin, False)
    assert torch.equal(q_fused.cpu(), q_composed.cpu())
    assert torch.equal(fused.cpu().view(torch.uint8), composed.cpu().view(torch.uint8))
    with pytest.raises(InvalidInputError):  # one token short of the plan's
        backend.rope_norm_and_write_cache(plan, fused, q_pe[1:], kv[1:], weight, 1e-6, cos_sin, False)


@pytest.fixture
def small(backend, gen):
    """A valid bf16 decode + chunk step with its tensors; tests break one thing at a time."""
    need_kv_dtype(backend, "bf16")
    spec = KVCacheSpec(6, 4, 32, 16, "bf16")
    plan = backend.plan_attention(AttentionBatch((1, 3), (5, 3), ((4, 1), (2,))), spec)
    dev = backend.device
    args = dict(
        cache=backend.allocate_kv_cache(spec),
        c_kv=randn(gen, 4, 32).bfloat16().to(dev), k_pe=randn(gen, 4, 16).bfloat16().to(dev),
        q_nope=randn(gen, 4, 2, 32).bfloat16().to(dev), q_pe=randn(gen, 4, 2, 16).bfloat16().to(dev),
    )
    backend.write_cache(plan, args["cache"], args["c_kv"], args["k_pe"])
    out = backend.run_attention(plan, args["cache"], args["q_nope"], args["q_pe"], 0.1)  # the valid call works
    assert isinstance(out, torch.Tensor) and out.shape == (4, 2, 32)  # no lse unless asked
    return backend, spec, plan, args


def _write(small, **override):
    backend, _, plan, a = small
    a = {**a, **override}
    backend.write_cache(plan, a["cache"], a["c_kv"], a["k_pe"])


def _run(small, scale=0.1, **override):
    backend, _, plan, a = small
    a = {**a, **override}
    backend.run_attention(plan, a["cache"], a["q_nope"], a["q_pe"], scale)


BAD_RUN = {
    "int-q": (lambda a: dict(q_nope=a["q_nope"].to(torch.int32)), "q_nope.*dtype"),
    "heads-mismatch": (lambda a: dict(q_pe=a["q_pe"][:, :1]), "q_pe.*shape"),
    "latent-dim": (lambda a: dict(q_nope=a["q_nope"][..., :31]), "q_nope.*shape"),
    "rope-dim": (lambda a: dict(q_pe=torch.cat([a["q_pe"], a["q_pe"]], -1)), "q_pe.*shape"),
    "2d-q": (lambda a: dict(q_nope=a["q_nope"][:, 0]), "q_nope.*dimensions"),
    "too-many-tokens": (lambda a: dict(q_nope=torch.cat([a["q_nope"], a["q_nope"][:1]]),
                                       q_pe=torch.cat([a["q_pe"], a["q_pe"][:1]])), "q_nope.*tokens"),
    "cache-shape": (lambda a: dict(cache=a["cache"][:5]), "cache.*shape"),
    "cache-dtype": (lambda a: dict(cache=a["cache"].float()), "cache.*dtype"),
    "meta-device": (lambda a: dict(q_nope=torch.empty_like(a["q_nope"], device="meta")), "q_nope.*meta"),
}


@pytest.mark.parametrize("bad", list(BAD_RUN))
def test_run_attention_rejects_bad_input(small, bad):
    make, pattern = BAD_RUN[bad]
    with pytest.raises(InvalidInputError, match=pattern):
        _run(small, **make(small[3]))


BAD_WRITE = {
    "int-c_kv": (lambda a: dict(c_kv=a["c_kv"].to(torch.int64)), "c_kv.*dtype"),
    "latent-dim": (lambda a: dict(c_kv=a["c_kv"][:, :30]), "c_kv.*shape"),
    "rope-dim": (lambda a: dict(k_pe=a["k_pe"][:, :8]), "k_pe.*shape"),
    "too-few-tokens": (lambda a: dict(c_kv=a["c_kv"][:3], k_pe=a["k_pe"][:3]), "c_kv.*tokens"),
    "cache-shape": (lambda a: dict(cache=a["cache"][:, :3]), "cache.*shape"),
    "cache-dtype": (lambda a: dict(cache=a["cache"].view(torch.float16)), "cache.*dtype"),
    "meta-device": (lambda a: dict(k_pe=torch.empty_like(a["k_pe"], device="meta")), "k_pe.*meta"),
}


@pytest.mark.parametrize("bad", list(BAD_WRITE))
def test_write_cache_rejects_bad_input(small, bad):
    make, pattern = BAD_WRITE[bad]
    with pytest.raises(InvalidInputError, match=pattern):
        _write(small, **make(small[3]))


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf")])
def test_softmax_scale_must_be_positive(small, scale):
    with pytest.raises(InvalidInputError, match="softmax_scale"):
        _run(small, scale=scale)


def test_plan_rejects_bad_block_tables(backend):
    spec = KVCacheSpec(4, 8, 32, 16, "bf16")
    with pytest.raises(InvalidInputError, match="block id 4 is out of range"):
        backend.plan_attention(AttentionBatch((1,), (9,), ((0, 4),)), spec)
    with pytest.raises(InvalidInputError, match="block table has 1 blocks but 9 tokens need 2"):
        backend.plan_attention(AttentionBatch((1,), (9,), ((0,),)), spec)
