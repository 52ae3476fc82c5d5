"""cuda_sm100 MLA kernels beyond the op contract: split-KV + combine, plan reuse, graph capture, batch
invariance, fallbacks. Compared with the reference backend on the same cache bytes.

Under the Triton interpreter (no GPU) the shapes are tiny; on a GPU the same tests run at DeepSeek's dims.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer.attention import AttentionBatch, KVCacheSpec
from deepinfer.errors import InvalidInputError
from deepinfer.quant import cdiv

GPU = torch.cuda.is_available()
RANK, ROPE = (512, 64) if GPU else (32, 16)
HEADS = (16, 128) if GPU else (3, 16)


def tables_for(seq_lens, bs, gen, spare=3):
    need = [cdiv(s, bs) for s in seq_lens]
    perm = torch.randperm(sum(need) + spare, generator=gen).tolist()
    out, k = [], 0
    for n in need:
        out.append(tuple(perm[k : k + n]))
        k += n
    return sum(need) + spare, tuple(out)


def filled_cache(be, spec, gen):
    """Every slot written with random values through the backend's own write kernel."""
    n = spec.num_blocks * spec.block_size
    cache = be.allocate_kv_cache(spec)
    plan = be.plan_attention(AttentionBatch((n,), (n,), (tuple(range(spec.num_blocks)),)), spec)
    c = torch.randn(n, spec.kv_lora_rank, generator=gen)
    k = torch.randn(n, spec.rope_dim, generator=gen)
    be.write_cache(plan, cache, c.to(be.device), k.to(be.device))
    return cache


def queries(be, t, heads, gen, scale=1.0):
    q = (torch.randn(t, heads, RANK, generator=gen) * scale).bfloat16().to(be.device)
    qp = torch.randn(t, heads, ROPE, generator=gen).bfloat16().to(be.device)
    return q, qp


def assert_close_rel(out, want, tol=2e-2):
    """Latent outputs in bf16: one rounding of the output (2^-8 relative; the interpreter truncates, 2^-7)
    on top of bf16 probabilities, so 2e-2 of the largest value."""
    err = (out.float().cpu() - want.float().cpu()).abs().max().item()
    assert err <= tol * want.float().abs().max().item(), f"out error {err:.3g} vs max {want.float().abs().max():.3g}"


def against_reference(kern, ref, batch, spec, cache, q, qp, scale, **plan_kw):
    plan = kern.plan_attention(batch, spec, **plan_kw)
    out, lse = kern.run_attention(plan, cache, q, qp, scale, return_lse=True)
    rplan = ref.plan_attention(batch, spec)
    rout, rlse = ref.run_attention(rplan, cache.cpu(), q.cpu(), qp.cpu(), scale, return_lse=True)
    assert_close_rel(out, rout)
    # FP8: the kernels round dequantised keys, or probabilities times the keys' scales, to 16 bits (the reference
    # keeps float32).
    tol = 1e-2 if spec.is_fp8 else 2e-3
    torch.testing.assert_close(lse.cpu(), rlse, rtol=tol, atol=tol)
    return plan, out, lse


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads", HEADS)
def test_split_kv_combine_matches_reference(kern, ref, gen, kv_dtype, heads):
    """Small forced splits: many partials per sequence, queries straddling split edges (causal), empty
    partials (a query before a split's first key) and unsplit sequences in one batch."""
    split = 64 if GPU else 16
    query_lens = (1, 4, 1, 8, 2, 1)
    seq_lens = (3 * split + 5, split + 2, split, 5 * split - 1, 9, 1)
    if GPU:
        query_lens, seq_lens = query_lens + (1, 3), seq_lens + (4000, 2500)
    spec_nb, tables = tables_for(seq_lens, 64 if GPU else 16, gen)
    spec = KVCacheSpec(spec_nb, 64 if GPU else 16, RANK, ROPE, kv_dtype)
    cache = filled_cache(kern, spec, gen)
    q, qp = queries(kern, sum(query_lens), heads, gen, scale=0.3)
    plan, _, _ = against_reference(kern, ref, AttentionBatch(query_lens, seq_lens, tables), spec, cache, q, qp,
                                   RANK**-0.5, split_tokens=split)
    assert plan.split_tokens == split and plan.num_slots > 0 and not plan.fallback


@pytest.mark.skipif(not GPU, reason="DeepSeek's dims, for the GPU's 16 / 32-row tile configurations")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [16, 32])
@pytest.mark.parametrize("seq_lens", [(1, 300, 2000, 5000), (1, 64, 900, 2000)])
def test_few_head_decode_with_the_plans_own_split(kern, ref, gen, kv_dtype, heads, seq_lens):
    """Decode with 16 / 32 heads as the engine runs it: past TINY_STEP_KEYS keys and within it (64-key items of
    one tile). 16 heads on Hopper take the keys-as-M kernels (elsewhere mla_attn_kernel's one-warpgroup tiles, FP8
    scales folded into scores and probabilities); 32 heads on Hopper the Gluon kernels' 64-row tiles."""
    from deepinfer.backends.cuda_sm100.attention import TINY_STEP_KEYS

    nb, tables = tables_for(seq_lens, 64, gen)
    spec = KVCacheSpec(nb, 64, RANK, ROPE, kv_dtype)
    cache = filled_cache(kern, spec, gen)
    q, qp = queries(kern, len(seq_lens), heads, gen, scale=0.3)
    plan, _, _ = against_reference(kern, ref, AttentionBatch((1,) * len(seq_lens), seq_lens, tables), spec, cache,
                                   q, qp, RANK**-0.5)
    assert (plan.split_tokens <= 64) == (sum(seq_lens) <= TINY_STEP_KEYS)


@pytest.mark.parametrize("heads", [0, 16, 128])
@pytest.mark.parametrize("seq_lens", [(4096,) * 64, (32768,) * 16, (65536,), (1024,) * 32, (100, 7000, 300)])
def test_split_rule_gives_about_one_wave_of_programs(monkeypatch, heads, seq_lens):
    """Plain Python, the GPU's rule: the smallest power-of-two split (from its floor) whose items x row-tile
    programs fit one wave: two one-warpgroup programs per SM for items of at most 32 rows (and where the head
    count is unknown), one 64-row program per SM otherwise."""
    from deepinfer.backends.cuda_sm100 import attention as A

    monkeypatch.setattr(A, "_num_sms", lambda device: 132)
    monkeypatch.delenv("DEEPINFER_MLA_SPLIT_TOKENS", raising=False)
    split = A.choose_split_tokens(list(seq_lens), torch.device("cuda"), heads)
    items = lambda s: sum(cdiv(n, s) for n in seq_lens)  # noqa: E731
    per_sm = 2 * 132 if heads <= 32 else 132 // cdiv(heads, 64)
    total = sum(seq_lens)
    floor = 64 if total <= A.TINY_STEP_KEYS else 128 if total <= A.SMALL_STEP_KEYS else 512
    assert split & (split - 1) == 0 and floor <= split <= 8192
    assert items(split) <= per_sm or split == 8192
    assert split == floor or items(split // 2) > per_sm
    spec = KVCacheSpec(1, 64, 512, 64, "bf16", heads)
    assert A._item_rows(AttentionBatch((1, 2, 9), (5, 6, 9), ((0,), (0,), (0,))), spec) == 2 * heads


def test_split_rule_picks_the_splits_the_h200_sweep_found_best(monkeypatch):
    """128 heads (two 64-row programs an item), 132 SMs: the splits that measured fastest on the H200
    (benchmarks/RESULTS.md, issue 8, tenth session), bf16 and FP8 alike; 16 heads on tiles that fit two programs an
    SM keep the measured 2048 at 128 x 4096 (the keys-as-M kernels' one wave: test_one_program_an_sm_takes_one_wave)."""
    from deepinfer.backends.cuda_sm100 import attention as A

    monkeypatch.setattr(A, "_num_sms", lambda device: 132)
    monkeypatch.delenv("DEEPINFER_MLA_SPLIT_TOKENS", raising=False)
    best = {((4096,) * 64, 128): 4096, ((32768,) * 16, 128): 8192, ((65536,), 128): 1024, ((4096,) * 4, 128): 256,
            ((1024,) * 32, 128): 512, ((4096,) * 128, 16): 2048}
    for (lens, heads), split in best.items():
        assert A.choose_split_tokens(list(lens), torch.device("cuda"), heads) == split, (len(lens), lens[0], heads)


@pytest.mark.parametrize("seq_lens", [(4096,) * 128, (4096,) * 64, (65536,) * 32, (1024,) * 32, (4096,) * 32,
                                      (1024,) * 300, (100, 70000, 300), (700,)])
def test_one_program_an_sm_takes_one_wave(monkeypatch, seq_lens):
    """Plain Python: items of at most 32 rows that run one program an SM (the keys-as-M kernels up to 16 rows, the
    64-row Gluon tile for 17-32) take the smallest split (from the same floor) giving one wave of programs, up to
    16384 keys, where others get two a SM. mla_launch.one_program_an_sm says yes only where run_attention would
    take those kernels."""
    from deepinfer.backends.cuda_sm100 import attention as A

    monkeypatch.setattr(A, "_num_sms", lambda device: 132)
    monkeypatch.delenv("DEEPINFER_MLA_SPLIT_TOKENS", raising=False)
    cuda = torch.device("cuda")
    two = A.choose_split_tokens(list(seq_lens), cuda, 16)
    one = A.choose_split_tokens(list(seq_lens), cuda, 16, one_per_sm=True)
    waves = lambda s: cdiv(sum(seq_lens), s) / 132  # noqa: E731  (the rule counts keys, not sequences)
    total = sum(seq_lens)
    floor = 64 if total <= A.TINY_STEP_KEYS else 128 if total <= A.SMALL_STEP_KEYS else 512
    assert one & (one - 1) == 0 and max(floor, two) <= one <= 16384
    assert waves(one) <= 1 or one == 16384
    assert one == floor or waves(one // 2) > 1
    expected = {(4096,) * 128: 4096, (4096,) * 64: 2048, (65536,) * 32: 16384, (1024,) * 32: 256, (4096,) * 32: 1024,
                (700,): 64}
    assert one == expected.get(tuple(seq_lens), one)

    spec = KVCacheSpec(1, 64, 512, 64, "bf16", 16)
    batch = AttentionBatch((1,) * len(seq_lens), seq_lens, tuple((0,) for _ in seq_lens))
    L = A.L

    def split_for(b, sp):  # what plan_mla does: the rows, then whether they take one program an SM
        rows = A._item_rows(b, sp)
        return A.choose_split_tokens(list(seq_lens), cuda, rows, L.one_program_an_sm(sp, rows, cuda))

    asked = []
    monkeypatch.setattr(L, "gluon_tile_usable", lambda spec_, q_dtype, device: True)
    monkeypatch.setattr(L, "keys_as_m_usable", lambda spec_, rows, device: asked.append(rows) or rows <= 16)
    assert split_for(batch, spec) == one and asked == [16]
    verify = AttentionBatch((2,) * len(seq_lens), seq_lens, batch.block_tables)  # 32 rows: the 64-row Gluon tile
    assert split_for(verify, spec) == A.choose_split_tokens(list(seq_lens), cuda, 32, True) and asked == [16]
    monkeypatch.setattr(L, "gluon_tile_usable", lambda spec_, q_dtype, device: False)
    assert split_for(batch, spec) == two
    unknown = KVCacheSpec(1, 64, 512, 64, "bf16")  # no head count: the rule cannot tell
    assert split_for(batch, unknown) == A.choose_split_tokens(list(seq_lens), cuda, 0)


def test_plan_sizes_splits_by_what_takes_its_items_and_keeps_it_for_graph_steps(monkeypatch):
    """plan_mla asks mla_launch once whether its decode items run one program an SM, sizes its splits by the
    answer, records it, and a graph step's replan (into=) sizes its own splits by the recorded answer."""
    from deepinfer.backends.cuda_sm100 import attention as A

    monkeypatch.delenv("DEEPINFER_MLA_SPLIT_TOKENS", raising=False)
    asked = []
    monkeypatch.setattr(A.L, "one_program_an_sm", lambda spec, rows, device: asked.append(rows) or True)
    monkeypatch.setattr(A, "_interpreting", lambda: True)  # a CPU plan on a GPU machine too (no kernel runs)
    spec = KVCacheSpec(64, 64, 512, 64, "bf16", 4)
    cpu = torch.device("cpu")
    tables = tuple(tuple(range(i * 8, i * 8 + 8)) for i in range(8))
    plan = A.plan_mla(AttentionBatch((1,) * 8, (500,) * 8, tables), spec, cpu, max_seq_len=512)
    assert plan.one_per_sm and asked == [4]
    assert plan.split_tokens == A.choose_split_tokens([500] * 8, cpu, 4, True)
    assert plan.split_tokens != A.choose_split_tokens([500] * 8, cpu, 4)  # the answer mattered
    again = A.plan_mla(AttentionBatch((1,) * 8, (200,) * 8, tables), spec, cpu, into=plan)
    assert again.one_per_sm and asked == [4]  # not asked again
    assert again.split_tokens == A.choose_split_tokens([200] * 8, cpu, 4, True)
    assert again.split_tokens != A.choose_split_tokens([200] * 8, cpu, 4)


def test_query_heads_must_not_be_negative():
    with pytest.raises(InvalidInputError, match="query_heads"):
        KVCacheSpec(4, 64, 512, 64, "bf16", -1)


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 1000])
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("max_splits", [1, 2, 5, 16, 300])
def test_combine_tiles_cover_the_rows_within_the_register_budget(num_tokens, heads, max_splits):
    """The GPU combine's program shape (plain Python): powers of two within the row, at most 8192 partial
    values a program, and more programs (narrower tiles) when the step has few tokens."""
    from deepinfer.backends.cuda_sm100.mla_launch import combine_tiles

    hb, dc, st = combine_tiles(num_tokens, heads, 512, max_splits, 132)
    for v in (hb, dc, st):
        assert v & (v - 1) == 0
    assert 1 <= hb <= 8 and 32 <= dc <= 512 and st == min(256, 1 << (max_splits - 1).bit_length())
    assert st * hb * dc <= 8192
    programs = num_tokens * cdiv(heads, hb) * cdiv(512, dc)
    assert programs >= 264 or (hb == 1 and dc == 32)
    wider = combine_tiles(num_tokens * 64, heads, 512, max_splits, 132)
    assert wider[0] * wider[1] >= hb * dc  # more tokens never make a program's tile narrower


@pytest.mark.parametrize("rank", [32, 512])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_every_gpu_launch_has_a_configuration(rank, kv_dtype, monkeypatch):
    """The GPU's configuration table covers every (rows, rank, cache, mode) a launch can ask for: plain
    Python, so a hole in it fails on CPU too, not first on a GPU."""
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    monkeypatch.delenv("DEEPINFER_MLA_CONFIG", raising=False)  # a benchmark's override bypasses the table

    spec = KVCacheSpec(4, 64, rank, 64, kv_dtype)
    for rows in (1, 3, 16, 17, 32, 33, 64, 128, 1024):
        for batch_invariant in (False, True):
            for f32 in (False, True):
                for one_tile, gluon in itertools.product((False, True), (False, True)):
                    cfg = A.attn_config(rows, spec, False, batch_invariant, f32, one_tile, gluon)
                    cands = A._GPU_CONFIGS[cfg.pop("_key")]
                    assert cands and all(len(c) in (4, 6) and c[0] == cands[0][0] for c in cands)
                    assert cfg == dict(zip(A._CONFIG_FIELDS, cands[0]))
                    if batch_invariant and not f32:  # one tile shape whatever the batch
                        assert cfg["BM"] == 64
                    if not f32:  # 16 rows keep their tile; 17-32 take the Gluon kernels' 64-row tile where they run
                        assert cfg["BM"] == (16 if rows <= 16 and not batch_invariant else
                                             64 if rows > 32 or gluon or batch_invariant else 32)


def test_launch_moves_past_configurations_that_do_not_fit(monkeypatch):
    """A candidate that runs out of resources on this GPU is skipped, the one that launched is remembered in the
    caller's TileChoices (the next launch of the shape starts there), and a table with nothing that fits
    raises a clear error instead of crashing the step."""
    from triton.runtime.errors import OutOfResources

    from deepinfer.backends.cuda_sm100 import mla_launch as A

    monkeypatch.delenv("DEEPINFER_MLA_CONFIG", raising=False)
    spec = KVCacheSpec(4, 64, 512, 64, "bf16")
    key = ("big", 32, False)
    cands = A._GPU_CONFIGS[key]
    too_big = {cands[0][:4]}
    tried, launched = [], []

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **kw):
                shape = (kw["BM"], kw["BN"], kw["num_warps"], kw["num_stages"])
                tried.append(shape)
                if shape in too_big:
                    raise OutOfResources(1 << 20, 232448, "shared memory")
                launched.append(shape)
            return run

    choices = A.TileChoices()
    for _ in range(2):
        cfg = A.attn_config(32, spec, False, False)
        assert cfg["_key"] == key
        A.launch_triton(Kernel(), (1,), (), {"R": 512}, cfg, lambda bn: True, lambda bm: False, choices)
    assert launched == [cands[1][:4]] * 2 and tried == [cands[0][:4]] + launched  # the second starts at cands[1]
    too_big.update(c[:4] for c in cands)
    with pytest.raises(InvalidInputError, match="no MLA kernel configuration fits"):
        A.launch_triton(Kernel(), (1,), (), {"R": 512}, A.attn_config(32, spec, False, False), lambda bn: True,
                        lambda bm: False, A.TileChoices())


def test_one_plan_serves_every_layer(kern, ref, gen):
    """The per-step plan (and its partial workspace) is reused by each layer's write + run."""
    query_lens, seq_lens = (1, 3, 1), (40, 70, 129)
    nb, tables = tables_for(seq_lens, 16, gen)
    spec = KVCacheSpec(nb, 16, RANK, ROPE, "bf16")
    batch = AttentionBatch(query_lens, seq_lens, tables)
    plan = kern.plan_attention(batch, spec, split_tokens=32)
    outs = []
    for layer in range(3):
        cache = filled_cache(kern, spec, gen)
        q, qp = queries(kern, sum(query_lens), HEADS[0], gen, scale=0.3)
        out, lse = kern.run_attention(plan, cache, q, qp, 0.125, return_lse=True)
        again = kern.run_attention(plan, cache, q, qp, 0.125)
        assert torch.equal(out, again), "same plan, same inputs: same bits"
        rout, rlse = ref.run_attention(ref.plan_attention(batch, spec), cache.cpu(), q.cpu(), qp.cpu(), 0.125,
                                       return_lse=True)
        torch.testing.assert_close(lse.cpu(), rlse, rtol=2e-3, atol=2e-3)
        assert_close_rel(out, rout)
        outs.append(out)
    assert len(plan.workspace) == 1, "one partial workspace per (heads, rank), shared by the layers"


def test_batch_invariant_mode_is_bit_identical_across_batches(gen):
    from deepinfer.backends.cuda_sm100 import CudaSM100Backend

    if CudaSM100Backend.probe().usable is False:
        pytest.skip("cuda_sm100 not usable here")
    be = CudaSM100Backend(batch_invariant=True)
    seq_lens = (300, 57, 129)
    nb, tables = tables_for(seq_lens, 16, gen)
    spec = KVCacheSpec(nb, 16, RANK, ROPE, "bf16")
    cache = filled_cache(be, spec, gen)
    q, qp = queries(be, 3, HEADS[0], gen, scale=0.3)
    together = be.run_attention(be.plan_attention(AttentionBatch((1, 1, 1), seq_lens, tables), spec), cache, q, qp, 0.1)
    alone = be.run_attention(be.plan_attention(AttentionBatch((1,), seq_lens[:1], tables[:1]), spec), cache,
                             q[:1], qp[:1], 0.1)
    assert torch.equal(together[:1], alone)
    # The same query as the last of a 5-token chunk (a prefill-like step) gives the same bits too.
    q5 = torch.cat([queries(be, 4, HEADS[0], gen)[0], q[:1]]), torch.cat([queries(be, 4, HEADS[0], gen)[1], qp[:1]])
    chunk = be.run_attention(be.plan_attention(AttentionBatch((5,), seq_lens[:1], tables[:1]), spec), cache, *q5, 0.1)
    assert torch.equal(chunk[4:], alone)


def test_unsupported_specs_fall_back_to_reference(kern, ref, gen):
    spec = KVCacheSpec(4, 16, RANK, ROPE, "fp32")
    batch = AttentionBatch((2,), (20,), ((3, 1),))
    plan = kern.plan_attention(batch, spec)
    assert "fp32" in plan.fallback
    cache = filled_cache(kern, spec, gen)
    q, qp = queries(kern, 2, 2, gen)
    torch.testing.assert_close(kern.run_attention(plan, cache, q, qp, 0.1).cpu(),
                               ref.run_attention(ref.plan_attention(batch, spec), cache.cpu(), q.cpu(), qp.cpu(), 0.1))


def test_replan_into_rejects_other_shapes(kern):
    spec = KVCacheSpec(16, 16, RANK, ROPE, "bf16")
    batch = AttentionBatch((1, 1), (20, 30), ((0, 1), (2, 3)))
    plan = kern.plan_attention(batch, spec, max_seq_len=64, split_tokens=16)
    with pytest.raises(InvalidInputError, match="query_lens"):
        kern.plan_attention(AttentionBatch((2, 1), (20, 30), ((0, 1), (2, 3))), spec, into=plan)
    with pytest.raises(InvalidInputError, match="blocks per sequence"):
        kern.plan_attention(AttentionBatch((1, 1), (20, 100), ((0, 1), tuple(range(2, 9)))), spec, into=plan)
    with pytest.raises(InvalidInputError, match="power of two"):
        kern.plan_attention(AttentionBatch((1,), (20,), ((0, 1),)), spec, split_tokens=24)
    grown = kern.plan_attention(AttentionBatch((1, 1), (40, 64), ((0, 1, 4), (2, 3, 5, 6))), spec, into=plan)
    assert grown.meta is plan.meta and grown.batch.seq_lens == (40, 64)
    # The captured launches (the combine's split width) are sized for the splits the plan can grow to.
    assert plan.max_splits == 2 and plan.split_capacity == grown.split_capacity == 4 >= grown.max_splits


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_replan_into_holds_what_a_fresh_plan_holds(kern, ref, gen, kv_dtype):
    """A graph's plan re-planned in place (one copy into its arena) for steps of other lengths and blocks: the
    same common tensors as a fresh plan of the step (block-table rows zero past the step's width), never a new
    tensor, and attention through it equals the reference's."""
    bs, max_len = 16, 96
    spec = KVCacheSpec(40, bs, RANK, ROPE, kv_dtype)
    cache = filled_cache(kern, spec, gen)
    q, qp = queries(kern, 3, HEADS[0], gen, scale=0.3)
    blocks = torch.randperm(40, generator=gen).tolist()

    def step(lens):
        tables, at = [], 0
        for s in lens:
            tables.append(tuple(blocks[at : at + cdiv(s, bs)]))
            at += cdiv(s, bs)
        return AttentionBatch((1, 1, 1), tuple(lens), tuple(tables))

    plan = kern.plan_attention(step((20, 7, 33)), spec, max_seq_len=max_len)
    arena = plan.arena
    for _ in range(3):
        lens = torch.randint(1, max_len + 1, (3,), generator=gen).tolist()
        plan = kern.plan_attention(step(lens), spec, into=plan)
        fresh = kern.plan_attention(step(lens), spec)
        assert plan.arena is arena and plan.block_table.data_ptr() >= arena.data_ptr()
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "positions"):
            assert torch.equal(getattr(plan, name), getattr(fresh, name)), name
        w = fresh.block_table.shape[1]
        assert torch.equal(plan.block_table[:, :w], fresh.block_table) and not plan.block_table[:, w:].any()
        out = kern.run_attention(plan, cache, q, qp, 0.1)
        want = ref.run_attention(ref.plan_attention(step(lens), spec), cache.cpu(), q.cpu(), qp.cpu(), 0.1)
        torch.testing.assert_close(out.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("cvt", [0, 1])
def test_fp8_operand_conversion_is_exact_for_every_code(kern, cvt):
    """Both E4M3 -> bf16 operand conversions, over all 254 finite codes (subnormals and -0 included)."""
    from deepinfer.backends.cuda_sm100 import mla_kernels as K

    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    x = codes.view(torch.float8_e4m3fn).view(16, 16).to(kern.device)
    out = torch.empty(16, 16, device=kern.device)
    scale = torch.full((16,), 0.37, device=kern.device)
    interp = kern.device.type == "cpu"
    K.fp8_operand_kernel[(1,)](x, scale, out, N=16, CVT=cvt, FOLD=True, DOT_T=K.DOT_INTERP if interp else K.DOT_GPU,
                               INTERP=interp)
    assert torch.equal(out.cpu(), x.cpu().float())


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_run_is_graph_capturable_and_replans_in_place(kern, ref, gen, kv_dtype):
    """Capture write + run once; later steps re-plan into the captured plan and replay the graph."""
    heads, bs, max_len = 128, 64, 4096
    seq_lens = (1000, 3000, 17, 2048)
    nb = 4 * cdiv(max_len, bs) + 2
    tables = tuple(tuple(range(i * cdiv(max_len, bs), (i + 1) * cdiv(max_len, bs))) for i in range(4))
    spec = KVCacheSpec(nb, bs, RANK, ROPE, kv_dtype)
    cache = filled_cache(kern, spec, gen)
    t = len(seq_lens)
    c_new = torch.randn(t, RANK, generator=gen).cuda()
    k_new = torch.randn(t, ROPE, generator=gen).cuda()
    q, qp = queries(kern, t, heads, gen, scale=0.3)

    def step(lens):
        return AttentionBatch((1,) * t, lens, tuple(tab[: cdiv(s, bs)] for tab, s in zip(tables, lens)))

    plan = kern.plan_attention(step(seq_lens), spec, max_seq_len=max_len, split_tokens=512)
    kern.write_cache(plan, cache, c_new, k_new)  # warm-up: compile outside the capture
    kern.run_attention(plan, cache, q, qp, 0.07, return_lse=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern.write_cache(plan, cache, c_new, k_new)
        g_out, g_lse = kern.run_attention(plan, cache, q, qp, 0.07, return_lse=True)
    for lens in (seq_lens, (1001, 4096, 18, 64), (3, 2, 1, 4000)):
        plan = kern.plan_attention(step(lens), spec, into=plan)
        c_new.normal_(generator=None)
        graph.replay()
        eager_plan = kern.plan_attention(step(lens), spec)
        e_out, e_lse = kern.run_attention(eager_plan, cache, q, qp, 0.07, return_lse=True)
        r_out, r_lse = ref.run_attention(ref.plan_attention(step(lens), spec), cache.cpu(), q.cpu(), qp.cpu(), 0.07,
                                         return_lse=True)
        torch.testing.assert_close(g_lse.cpu(), r_lse, rtol=1e-2, atol=1e-2)
        assert_close_rel(g_out, r_out)
        assert_close_rel(g_out, e_out)
