"""cuda_sm100 MLA attention over the paged latent cache: plan on the host, Triton kernels per layer.

plan (once per step, host): the reference checks, then a split schedule. A sequence with at most
SPLIT_MAX_QLEN queries (decode, speculative verification) is cut into pieces of `split_tokens` keys, one
work item each, whose float32 partials a combine kernel merges by their log-sum-exp; longer query runs
(prefill chunks) are one item each, parallel over tiles of (query, head) rows instead. Everything the
kernels read is in device tensors built here, so run() only launches kernels: it can be captured in a CUDA
graph. For replay across steps, `plan_mla(..., into=captured_plan)` rewrites the captured plan's
tensors in place (same sequences and query lengths; `max_seq_len` at capture reserves room to grow).

run (per layer): up to three launches: the decode items, the prefill items, the combine.
write (per layer): one launch, FP8 quantisation fused.
Batch-invariant mode (backend batch_invariant): no splits and one tile shape, so a query's result has the
same bits whatever else is in the batch and whichever chunk it arrives in (less parallel at small batch).

Reference math is used (and said so in `MLAPlan.fallback`) for what the kernels do not cover: fp32/fp16
caches (not in this backend's capabilities), kv_lora_rank > 512, rope_dim > 128, FP8 rows whose rank is
not a multiple of 4 (the fp32 scale view needs 4-byte alignment), a cache whose last dimension is strided,
and CPU tensors when the Triton interpreter is off.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from itertools import chain

import torch

from deepinfer.attention import AttentionBatch, AttentionPlan, KVCacheSpec
from deepinfer.backends.cuda_sm100 import mla_launch as L
from deepinfer.backends.reference import attention as ref
from deepinfer.errors import InvalidInputError
from deepinfer.quant import FP8_BLOCK, cdiv
from deepinfer.transfer import host_tensor

SPLIT_MAX_QLEN = 8  # sequences with more queries than this are not KV-split (row tiles give parallelism)
MAX_RANK, MAX_ROPE = 512, 128
_META_ROWS = 5  # q_start, q_len, seq_len, n_splits, first partial slot


@dataclass(frozen=True, eq=False)
class MLAPlan(AttentionPlan):
    """AttentionPlan plus the split schedule, all in device tensors (see the module docstring).

    meta [5, B] int32: per sequence q_start, q_len, seq_len, n_splits, first partial slot (-1: written
    directly, no combine).
    tok_seq [T] int32: each token's sequence. dec_items / pre_items [n, 4] int32: (seq, kv_lo, kv_hi,
    slot) per work item; slot -1 = write the output directly, >= 0 = partial rows slot + j for query j,
    -2 = capacity padding. num_slots: partial rows reserved (capacity).
    """

    split_tokens: int = 0
    one_per_sm: bool = False  # its decode items run one program an SM (choose_split_tokens)
    fallback: str = ""  # non-empty: why this plan runs on the reference math
    batch_invariant: bool = False
    meta: torch.Tensor | None = None
    tok_seq: torch.Tensor | None = None
    dec_items: torch.Tensor | None = None
    pre_items: torch.Tensor | None = None
    dec_max_qlen: int = 0
    pre_max_qlen: int = 0
    dec_max_span: int = 0  # most keys in one item: the interpreter's loop bound
    pre_max_span: int = 0
    max_splits: int = 0
    split_capacity: int = 0  # most splits a sequence may take: a graph-captured plan's room for growth
    num_slots: int = 0
    max_blocks: int = 0
    # Per (heads, rank): float32 partial outputs and lses, allocated at the first run, reused by every layer.
    workspace: dict = field(default_factory=dict, repr=False)
    # A plan made for a CUDA graph (max_seq_len): one int32 buffer that every tensor above views, so that a
    # step's replan (into=) is one host-to-device copy (see _ARENA_INT64 / _ARENA_INT32)
    arena: torch.Tensor | None = field(default=None, repr=False)


# --- plan ---------------------------------------------------------------------------------------------


def _kernel_gap(spec: KVCacheSpec, device: torch.device) -> str:
    """Why the Triton kernels cannot serve this spec on this device ('' if they can)."""
    if spec.dtype not in ("bf16", "fp8_e4m3"):
        return f"{spec.dtype} cache has no Triton kernel (cuda_sm100 advertises bf16 and fp8_e4m3)"
    if spec.kv_lora_rank > MAX_RANK or spec.rope_dim > MAX_ROPE:
        return f"kv_lora_rank {spec.kv_lora_rank} > {MAX_RANK} or rope_dim {spec.rope_dim} > {MAX_ROPE}"
    if spec.is_fp8 and spec.kv_lora_rank % 4:
        return f"fp8 cache with kv_lora_rank {spec.kv_lora_rank} not a multiple of 4"
    if device.type == "cpu" and not _interpreting():
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton kernels for {device.type} tensors"
    return ""


def _interpreting() -> bool:
    from deepinfer.backends.cuda_sm100 import triton_interpreter_requested

    return triton_interpreter_requested()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small, so that the tests' short sequences are split too


SMALL_STEP_KEYS = 32768  # below this many keys in a step, latency beats the partials' traffic
# At most this many keys: 64-key splits (one tile per item). H200, bf16 and FP8 caches, 16 heads
# (mla_decode.py --sweep, 2026-11-29): 1x1024 11.9 vs 15.4 us for 128-key splits, 1x4096 16.4 vs 17.8, 4x1024
# 14.9 vs 17.4; past it 128 wins (1x16384 26.6 vs 32.8 us). e2e batch 1 at 1k context: 386.3 vs 378.5 tok/s.
TINY_STEP_KEYS = 4096


def choose_split_tokens(split_lens: list[int], device: torch.device, rows: int = 0, one_per_sm: bool = False) -> int:
    """Keys per split: a power of two giving about one wave of programs over the splittable sequences.

    `rows` is an item's query rows (heads x queries; 0 = unknown). Items of at most 32 rows are one
    one-warpgroup program: about two items per SM. one_per_sm: such items run one program an SM (the keys-as-M
    kernels' shared memory, or the 64-row Gluon tile's for 17-32 rows), where two items an SM would be two
    waves: about one item per SM, in splits of up to 16384 keys. Larger items launch cdiv(rows, 64) programs of
    64 rows, one per SM (8 warps, ~225 KiB of shared memory): about one program per SM. H200, 128 heads, bf16
    and FP8 caches (mla_decode.py --sweep, 2026-11-30): 64 items (128 programs) were fastest at 64x4096,
    16x32768, 1x65536, 4x4096 and 32x1024 keys; e.g. 64x4096 0.2005 ms vs 0.2460 at two items per SM.

    On GPUs at least 512 (a split's partial costs H x rank x 8 bytes of traffic; smaller splits spend more
    on partials than they gain in parallelism), or 128 for steps with few keys in all, where a handful of
    items would leave most SMs idle and the partials are small in absolute terms, and 64 for the fewest
    (a lone short sequence: its latency is the tiles each item walks); 16 under the interpreter; at most 8192
    (16384 for one_per_sm's one wave).
    """
    env = os.environ.get("DEEPINFER_MLA_SPLIT_TOKENS")
    if env:
        return _check_split(int(env))
    total = sum(split_lens)
    lo = (64 if total <= TINY_STEP_KEYS else 128 if total <= SMALL_STEP_KEYS else 512) if device.type == "cuda" else 16
    sms = _num_sms(device)

    def fit(target: int, most: int = 8192) -> int:
        s = lo
        while s < most and cdiv(total, s) > target:
            s *= 2
        return s

    if rows > 32:
        return fit(max(1, sms // cdiv(rows, 64)))
    # One program an SM: one wave beat two at every size measured. H100, mla_decode.py, 16 heads, the two-wave
    # split / the one-wave split, ms (RESULTS.md, issue 8, fortieth session): bf16 128 x 4096 keys 0.2293 / 0.2213,
    # 64 x 4096 0.1292 / 0.1237, 32 x 4096 0.0775 / 0.0729, 32 x 1024 0.0352 / 0.0294; FP8 0.1522 / 0.1411,
    # 0.0920 / 0.0848, 0.0589 / 0.0527, 0.0307 / 0.0237. e2e V2-Lite batch 32 at 1k, tok/s: FP8 weights and cache
    # 4126.9, 4124.3 / 4161.8, 4156.0; bf16 2637.8 / 2656.8. 32 heads (the 64-row Gluon tile, forty-first session):
    # bf16 64 x 4096 0.1363 / 0.1265, 128 x 1024 0.0884 / 0.0716, 32 x 4096 0.0856 / 0.0749; FP8 0.1569 / 0.1288,
    # 0.1015 / 0.0780, 0.1002 / 0.0818.
    return fit(sms, 16384) if one_per_sm else fit(2 * sms)


def _item_rows(batch: AttentionBatch, spec: KVCacheSpec) -> int:
    """Query rows of the largest splittable item (0 where the spec does not say how many heads)."""
    qmax = max((q for q in batch.query_lens if q <= SPLIT_MAX_QLEN), default=0)
    return spec.query_heads * qmax


def _check_split(s: int) -> int:
    if s < 16 or s & (s - 1):
        raise InvalidInputError(f"split_tokens must be a power of two >= 16, got {s}")
    return s


def _schedule(batch: AttentionBatch, split: int | None, cap_len: int) -> tuple[list, list, list, int]:
    """Work items and per-sequence (n_splits, first slot); split None = no KV splits at all."""
    dec, pre, seq_split = [], [], []
    slots = 0
    for i, (q, s) in enumerate(zip(batch.query_lens, batch.seq_lens)):
        if q > SPLIT_MAX_QLEN or split is None:
            (pre if q > SPLIT_MAX_QLEN else dec).append((i, 0, s, -1))
            seq_split.append((1, -1))
            continue
        n, cap = cdiv(s, split), cdiv(max(s, cap_len), split)
        if cap == 1:
            dec.append((i, 0, s, -1))
            seq_split.append((1, -1))
            continue
        for k in range(n):
            dec.append((i, k * split, min(s, (k + 1) * split), slots + k * q))
        dec.extend((i, 0, 0, -2) for _ in range(cap - n))  # room for the sequence to grow (graph replay)
        seq_split.append((n, slots))
        slots += cap * q
    return dec, pre, seq_split, slots


def plan_mla(
    batch: AttentionBatch,
    spec: KVCacheSpec,
    device: torch.device,
    *,
    batch_invariant: bool = False,
    split_tokens: int | None = None,
    max_seq_len: int | None = None,
    into: MLAPlan | None = None,
) -> MLAPlan:
    """Validate and schedule one step. max_seq_len reserves items, partial rows and block-table width
    for sequences growing up to that length (for a plan captured in a CUDA graph); `into` rewrites
    such a plan's tensors in place for a new step of the same shape and returns the updated plan."""
    device = torch.device(device)
    if into is not None:
        return _replan_into(into, batch, spec)
    gap = _kernel_gap(spec, device)
    base = AttentionPlan.build(batch, spec, device)
    common = {f.name: getattr(base, f.name) for f in dataclasses.fields(AttentionPlan)}
    if gap:
        return MLAPlan(**common, fallback=gap, batch_invariant=batch_invariant)
    cap_len = max_seq_len or 0
    rows = _item_rows(batch, spec)
    one_per_sm = L.one_program_an_sm(spec, rows, device)  # fixed for the plan: its replans (into=) reuse it
    if batch_invariant:
        split = None  # every query reduces over the same key tiles in the same order, in any batch
    elif split_tokens is not None:
        split = _check_split(split_tokens)
    else:
        # A plan captured for a graph serves every length up to max_seq_len: size splits for half of it.
        splittable = [max(s, cap_len // 2) for q, s in zip(batch.query_lens, batch.seq_lens) if q <= SPLIT_MAX_QLEN]
        split = choose_split_tokens(splittable, device, rows, one_per_sm)
    dec, pre, seq_split, slots = _schedule(batch, split, cap_len)
    width = max(cdiv(cap_len, spec.block_size), common["block_table"].shape[1])  # room to grow (graphs)
    if width > common["block_table"].shape[1]:
        table = torch.zeros(batch.num_seqs, width, dtype=torch.int32, device=device)
        table[:, : common["block_table"].shape[1]] = common["block_table"]
        common["block_table"] = table
    meta, tok_seq, dec_t, pre_t = _pack(batch, seq_split, dec, pre, device)
    plan = MLAPlan(
        **common, split_tokens=split or 0, one_per_sm=one_per_sm, batch_invariant=batch_invariant, meta=meta,
        tok_seq=tok_seq, dec_items=dec_t, pre_items=pre_t,
        dec_max_qlen=max((batch.query_lens[i] for i, *_ in dec), default=0),
        pre_max_qlen=max((batch.query_lens[i] for i, *_ in pre), default=0),
        dec_max_span=max((hi - lo for _, lo, hi, _ in dec), default=0),
        pre_max_span=max((hi - lo for _, lo, hi, _ in pre), default=0),
        max_splits=max(n for n, _ in seq_split), num_slots=slots, max_blocks=width,
        split_capacity=max((cdiv(max(s, cap_len), split) for q, s in zip(batch.query_lens, batch.seq_lens)
                            if split and q <= SPLIT_MAX_QLEN), default=1),
    )
    return plan if max_seq_len is None else _in_arena(plan)


def _schedule_lists(batch, seq_split, dec, pre) -> tuple[list[int], list[int], list[int], list[int]]:
    """The schedule's integers, each flat: meta [5, B], tok_seq [T], dec_items [n, 4], pre_items [m, 4]."""
    starts = [0]
    for q in batch.query_lens:
        starts.append(starts[-1] + q)
    meta = [starts[:-1], list(batch.query_lens), list(batch.seq_lens),
            [n for n, _ in seq_split], [s for _, s in seq_split]]
    tok_seq = [i for i, q in enumerate(batch.query_lens) for _ in range(q)]
    return ([v for row in meta for v in row], tok_seq, [v for it in dec for v in it], [v for it in pre for v in it])


def _pack(batch, seq_split, dec, pre, device):
    """All schedule integers in one host tensor, copied to the device at once, then viewed apart."""
    b, t = batch.num_seqs, batch.num_tokens
    host = host_tensor(chain(*_schedule_lists(batch, seq_split, dec, pre)), torch.int32)
    dev = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    o1, o2, o3 = _META_ROWS * b, _META_ROWS * b + t, _META_ROWS * b + t + 4 * len(dec)
    return (dev[:o1].view(_META_ROWS, b), dev[o1:o2], dev[o2:o3].view(-1, 4), dev[o3:].view(-1, 4))


# A graph plan's tensors in its arena, in this order: the int64 ones first (8-byte aligned), then the int32 ones.
_ARENA_INT64 = ("slot_mapping", "positions")
_ARENA_INT32 = ("query_start_loc", "seq_lens", "block_table", "meta", "tok_seq", "dec_items", "pre_items")


def _arena_views(buffer: torch.Tensor, plan: MLAPlan) -> dict[str, torch.Tensor]:
    """Views of a flat int32 buffer (the device arena, or a host image of it) as `plan`'s arena lays its tensors
    out, each of its shape; an int64 value takes two words. The one place that layout is written."""
    views, at = {}, 0
    for name in _ARENA_INT64 + _ARENA_INT32:
        shape = getattr(plan, name).shape
        wide = name in _ARENA_INT64
        n = math.prod(shape) * (2 if wide else 1)
        part = buffer[at : at + n]
        views[name] = (part.view(torch.int64) if wide else part).view(shape)
        at += n
    return views


def _arena_words(plan: MLAPlan) -> int:
    return sum(getattr(plan, name).numel() * (2 if name in _ARENA_INT64 else 1) for name in _ARENA_INT64 + _ARENA_INT32)


def _in_arena(plan: MLAPlan) -> MLAPlan:
    """The plan with every tensor a view of one int32 device buffer (values copied in)."""
    arena = torch.empty(_arena_words(plan), dtype=torch.int32, device=plan.seq_lens.device)
    views = _arena_views(arena, plan)
    for name, view in views.items():
        view.copy_(getattr(plan, name))
    return dataclasses.replace(plan, arena=arena, **views)


def _schedule_within(batch: AttentionBatch, plan: MLAPlan, device: torch.device):
    """This step's own split size (short contexts want small splits, long ones large), doubled until its
    items and partial rows fit what the captured plan reserved, and its schedule. Any power of two >= 64
    keeps the kernels' block-aligned tiles (BN <= 64) that the capture baked in. Batch-invariant plans
    never split."""
    if not plan.split_tokens:
        return None, _schedule(batch, None, 0)
    lens = [s for q, s in zip(batch.query_lens, batch.seq_lens) if q <= SPLIT_MAX_QLEN]
    split = max(64, choose_split_tokens(lens, device, _item_rows(batch, plan.spec), plan.one_per_sm))
    while True:
        schedule = _schedule(batch, split, 0)
        dec, _, _, slots = schedule
        if split >= plan.split_tokens or (len(dec) <= plan.dec_items.shape[0] and slots <= plan.num_slots):
            return split, schedule
        split *= 2


def _replan_into(plan: MLAPlan, batch: AttentionBatch, spec: KVCacheSpec) -> MLAPlan:
    if not isinstance(plan, MLAPlan) or plan.fallback or plan.arena is None:
        raise InvalidInputError("into= needs a kernel plan made by plan_attention with max_seq_len (a graph's plan; "
                                "not a reference fallback)")
    old = plan.batch
    if spec != plan.spec or batch.query_lens != old.query_lens:
        raise InvalidInputError(
            "into= needs the same KVCacheSpec and query_lens as the captured plan "
            f"(got query_lens {batch.query_lens}, captured {old.query_lens})"
        )
    device = plan.seq_lens.device
    n_cap = plan.dec_items.shape[0]
    width = max(cdiv(s, spec.block_size) for s in batch.seq_lens)
    if width > plan.max_blocks:
        raise InvalidInputError(f"the step needs {width} blocks per sequence; the captured plan "
                                f"holds {plan.max_blocks} (plan it with a larger max_seq_len)")
    # validates the batch; the common tensors' values (block-table rows at the step's own width)
    starts, lens, table, slot_map, positions = AttentionPlan.host_rows(batch, spec)
    # Schedule within the captured plan's capacities, so item and slot layouts line up.
    split, (dec, pre, seq_split, slots) = _schedule_within(batch, plan, device)
    real = [it for it in dec if it[3] != -2]
    if len(real) > n_cap or slots > plan.num_slots:
        raise InvalidInputError(f"the step needs {len(real)} work items / {slots} partial rows; the captured plan "
                                f"holds {n_cap} / {plan.num_slots} (plan it with a larger max_seq_len)")
    spans = dict(dec_max_span=max((hi - lo for _, lo, hi, _ in real), default=0),
                 pre_max_span=max((hi - lo for _, lo, hi, _ in pre), default=0),
                 max_splits=max(n for n, _ in seq_split))
    real += [(0, 0, 0, -2)] * (n_cap - len(real))
    # The whole step in one host-to-device copy of an image of the arena: a fresh pinned buffer each step (the
    # copy may still be pending when the next step is planned), filled by C loops.
    host = torch.empty(plan.arena.numel(), dtype=torch.int32, pin_memory=device.type == "cuda")
    image = _arena_views(host, plan)
    values = dict(zip(("slot_mapping", "positions", "query_start_loc", "seq_lens"), (slot_map, positions, starts, lens)))
    values.update(zip(("meta", "tok_seq", "dec_items", "pre_items"), _schedule_lists(batch, seq_split, real, pre)))
    for name, vals in values.items():  # (copy_ narrows the int64 values to an int32 view itself)
        view = image[name]
        view.copy_(host_tensor(vals, torch.int64).view(view.shape))
    image["block_table"].zero_()
    image["block_table"][:, :width].copy_(host_tensor(table, torch.int64).view(batch.num_seqs, width))
    plan.arena.copy_(host, non_blocking=True)
    return dataclasses.replace(plan, batch=batch, split_tokens=split or 0, **spans)


# --- run ------------------------------------------------------------------------------------------------


def _cache_views(spec: KVCacheSpec, cache: torch.Tensor):
    """(lat, scl, rope) typed views, their (block, token) strides and in-row offsets in elements, block size."""
    r = spec.kv_lora_rank
    if spec.is_fp8:
        lat = cache.view(torch.float8_e4m3fn)
        scl = cache.view(torch.float32)
        rope = cache.view(torch.bfloat16)
        scale_off, rope_off = r // 4, (r + 4 * spec.num_scales) // 2
    else:
        lat = scl = rope = cache
        scale_off, rope_off = 0, r
    return (lat, scl, rope, lat.stride(0), lat.stride(1), scl.stride(0), scl.stride(1),
            rope.stride(0), rope.stride(1), scale_off, rope_off, spec.block_size)


def _dims(spec: KVCacheSpec) -> dict:
    r, p = spec.kv_lora_rank, spec.rope_dim
    ch = min(FP8_BLOCK, L.pow2(r))
    return dict(R=r, P=p, CH=ch, NC=cdiv(r, ch), PP=L.pow2(p))


def _usable(plan: AttentionPlan, cache: torch.Tensor) -> bool:
    return isinstance(plan, MLAPlan) and not plan.fallback and cache.stride(-1) == 1


def write_cache(plan: AttentionPlan, cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
    spec = ref._check_plan_and_cache(plan, cache)
    ref._check_tokens("c_kv", c_kv, 2, plan, cache)
    ref._check_tokens("k_pe", k_pe, 2, plan, cache)
    from deepinfer.checks import check_tensor

    check_tensor("c_kv", c_kv, shape=(None, spec.kv_lora_rank))
    check_tensor("k_pe", k_pe, shape=(None, spec.rope_dim))
    if not _usable(plan, cache):
        return ref.write_cache(plan, cache, c_kv, k_pe)
    from deepinfer.backends.cuda_sm100 import mla_kernels as K
    from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

    c_kv = c_kv if c_kv.stride(-1) == 1 else c_kv.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    n = c_kv.shape[0]
    views = _cache_views(spec, cache)
    interp = cache.device.type == "cpu"
    bt = 256 if interp else 16
    dims = _dims(spec)  # the whole latent row at once (BD wide), not NC chunks as the attention kernels take it
    K.mla_write_kernel[(cdiv(n, bt),)](
        c_kv, k_pe, plan.slot_mapping, n, c_kv.stride(0), k_pe.stride(0), *views, R=dims["R"], P=dims["P"],
        CH=dims["CH"], PP=dims["PP"], BD=L.pow2(spec.kv_lora_rank), BT=bt, FP8=spec.is_fp8, EXACT=interp,
        num_warps=4, **launch_kwargs(),
    )


_VIEW_ARGS = ("lat_ptr", "scl_ptr", "rope_ptr", "lat_sb", "lat_st", "scl_sb", "scl_st", "rope_sb", "rope_st",
              "scale_off", "rope_off", "BS")


def fuses_cache_write(plan: AttentionPlan, cache: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rope_norm_and_write serves this step: a kernel plan and cache, and kv / weight of its rank."""
    spec = plan.spec if isinstance(plan, AttentionPlan) else None
    return (spec is not None and _usable(plan, cache) and kv.shape[-1] == spec.kv_lora_rank + spec.rope_dim
            and weight.shape[0] == spec.kv_lora_rank)


def rope_norm_and_write(plan: AttentionPlan, cache: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                        weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Backend.rope_norm_and_write_cache in one launch: the norm and ropes of mla_rope_and_norm, then the cache
    write of write_cache from the rows just computed (the same values, bit for bit). For inputs that passed
    mla_rope_and_norm's checks, where fuses_cache_write holds."""
    spec = ref._check_plan_and_cache(plan, cache)
    ref._check_tokens("kv", kv, 2, plan, cache)
    ref._check_tokens("q_pe", q_pe, 3, plan, cache)
    from deepinfer.backends.cuda_sm100 import mla_kernels as K
    from deepinfer.backends.cuda_sm100 import norm_rope_kernels as NR
    from deepinfer.backends.cuda_sm100.pdl import early_trigger

    q_out, _, _, launch = NR.mla_rope_norm_launch(q_pe, kv, weight, eps, plan.positions, cos_sin_cache, interleaved)
    if launch is not None:
        grid, kwargs = launch
        views = dict(zip(_VIEW_ARGS, _cache_views(spec, cache)))
        K.mla_rope_norm_write_kernel[grid](**kwargs, slot_ptr=plan.slot_mapping, **views, CH=_dims(spec)["CH"],
                                           FP8=spec.is_fp8, EARLY=early_trigger())  # W_UK's GEMV follows
    return q_out


def _check_scale(softmax_scale) -> None:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise InvalidInputError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise InvalidInputError(f"softmax_scale must be finite and > 0, got {softmax_scale}")


def run_attention(plan, cache, q_nope, q_pe, softmax_scale, return_lse=False, batch_invariant=False,
                  tile_choices: L.TileChoices | None = None):
    """tile_choices: the caller's memory of which tile candidates fit this GPU (a fresh one by default)."""
    spec = ref._check_plan_and_cache(plan, cache)
    ref._check_tokens("q_nope", q_nope, 3, plan, cache)
    ref._check_tokens("q_pe", q_pe, 3, plan, cache)
    num_tokens, heads = q_nope.shape[:2]
    from deepinfer.checks import check_tensor

    check_tensor("q_nope", q_nope, shape=(None, None, spec.kv_lora_rank))
    check_tensor("q_pe", q_pe, shape=(num_tokens, heads, spec.rope_dim))
    _check_scale(softmax_scale)
    if not _usable(plan, cache):
        return ref.run_attention(plan, cache, q_nope, q_pe, softmax_scale, return_lse, batch_invariant)
    from deepinfer.backends.cuda_sm100 import mla_kernels as K
    from deepinfer.backends.cuda_sm100.pdl import early_trigger, launch_kwargs

    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    dev = cache.device
    out = torch.empty(num_tokens, heads, spec.kv_lora_rank, dtype=q_nope.dtype, device=dev)
    lse = torch.empty(num_tokens, heads, dtype=torch.float32, device=dev)
    po, plse = _workspace(plan, heads, dev)
    views = _cache_views(spec, cache)
    dims = _dims(spec)
    qk_scale = float(softmax_scale) * K.LOG2E
    common = (q_nope, q_pe, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), *views,
              plan.block_table, plan.block_table.stride(0), plan.meta, plan.meta.stride(0))
    interp = dev.type == "cpu"
    # Float32 queries (a float32 model) get float32 attention: no bf16 rounding of q and P, IEEE MMAs (slow,
    # for exactness: the GPU's greedy tokens then match the reference's up to summation order).
    f32 = q_nope.dtype == torch.float32
    tail = (out, lse, out.stride(0), out.stride(1), po, plse, heads, qk_scale)
    # Tiles that never straddle a block (BN | block size, BN | split) read the block table once per tile.
    aligned = lambda bn: spec.block_size % bn == 0 and plan.split_tokens % bn == 0  # noqa: E731
    gluon = aligned(64) and L.gluon_tile_usable(spec, q_nope.dtype, dev)
    # FP8 candidates that do not say: dequantising the tile measured ~4% faster than folding the scales
    # into scores and probabilities with 8-warp tiles (H200, 2026-11-29), so the GPU dequantises; the
    # interpreter folds wherever BM != 64, so that both paths stay tested.
    fold_ok = lambda bm: interp and bm != 64  # noqa: E731
    for items, qmax, span in ((plan.dec_items, plan.dec_max_qlen, plan.dec_max_span),
                              (plan.pre_items, plan.pre_max_qlen, plan.pre_max_span)):
        if items.shape[0] == 0:
            continue
        rows = qmax * heads
        cfg = L.attn_config(rows, spec, interp, plan.batch_invariant, f32, one_tile=0 < plan.split_tokens <= 64,
                            gluon=gluon)
        row_tiles = cdiv(rows, cfg["BM"])
        grid = (items.shape[0] * row_tiles,)
        if cfg["BM"] == 64 and gluon:
            L.launch_gluon(spec, q_nope, q_pe, views, plan, items, row_tiles, tail, span)
            continue
        if cfg["BM"] == 16 and gluon and L.keys_as_m_usable(spec, rows, dev):
            L.launch_gluon_kt(spec, q_nope, q_pe, views, plan, items, tail)
            continue
        L.launch_triton(K.mla_attn_kernel, grid, (*common, items, *tail, row_tiles),
                dict(**dims, FP8=spec.is_fp8, INTERP=interp, MAX_SPAN=span if interp else 0,
                     DOT_T=K.DOT_INTERP if interp else K.DOT_GPU, F32=f32), cfg, aligned, fold_ok,
                tile_choices if tile_choices is not None else L.TileChoices())
    if plan.num_slots:
        # The interpreter pays per program, so there one program takes all heads and columns of a token.
        if interp:
            hb, dc, st = L.pow2(heads), L.pow2(spec.kv_lora_rank), 16
        else:
            # Splits as the plan may hold them: a captured graph keeps this launch for longer sequences.
            splits = max(plan.max_splits, plan.split_capacity)
            hb, dc, st = L.combine_tiles(num_tokens, heads, spec.kv_lora_rank, splits, _num_sms(dev))
        K.mla_combine_kernel[(num_tokens, cdiv(heads, hb), cdiv(spec.kv_lora_rank, dc))](
            plan.tok_seq, plan.meta, plan.meta.stride(0), po, plse, out, lse, out.stride(0), out.stride(1), heads,
            R=spec.kv_lora_rank, HB=hb, DC=dc, ST=st, INTERP=interp, MAX_SPLITS=plan.max_splits if interp else 0,
            EARLY=early_trigger(), num_warps=4, **launch_kwargs(),
        )
    return (out, lse) if return_lse else out


def _workspace(plan: MLAPlan, heads: int, device: torch.device):
    key = (heads, plan.spec.kv_lora_rank)
    ws = plan.workspace.get(key)
    if ws is None:
        rows = max(plan.num_slots, 1)
        ws = plan.workspace[key] = (
            torch.empty(rows, heads, plan.spec.kv_lora_rank, dtype=torch.float32, device=device),
            torch.empty(rows, heads, dtype=torch.float32, device=device),
        )
    return ws
