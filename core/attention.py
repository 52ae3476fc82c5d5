"""Per-step attention metadata shared by every backend: the latent cache's layout and a batch's shape.

The engine builds one AttentionBatch per step on the host; the backend's `plan_attention` turns it into
device tensors once, and every layer's `write_cache` / `run_attention` reuses that plan (FlashInfer's
plan/run split: planning is host work, the per-layer launches are graph-capturable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.errors import InvalidInputError
from deepinfer.quant import FP8_BLOCK, FP8_DTYPE, cdiv, dequantize_fp8_per_token_group
from deepinfer.transfer import to_device_many

KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": torch.uint8}


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's paged latent cache: [num_blocks, block_size, entry] per layer.

    Float caches hold kv_lora_rank latent values then rope_dim rope-key values per token (576 for DeepSeek).
    The fp8_e4m3 cache is DeepSeek's FlashMLA layout, in bytes: kv_lora_rank E4M3 values, one fp32 scale per
    128 of them, then rope_dim bf16 values (656 bytes for DeepSeek).

    query_heads: the query heads each token brings to this cache (the model's attention heads; 0 = unknown).
    It does not change the layout; a backend may size its per-step schedule by it (FlashInfer's plan takes
    the head count for the same reason).
    """

    num_blocks: int
    block_size: int = 64
    kv_lora_rank: int = 512
    rope_dim: int = 64
    dtype: str = "bf16"
    query_heads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in KV_CACHE_DTYPES:
            raise InvalidInputError(f"kv cache dtype {self.dtype!r} is not one of {sorted(KV_CACHE_DTYPES)}")
        for field in ("num_blocks", "block_size", "kv_lora_rank", "rope_dim"):
            if getattr(self, field) <= 0:
                raise InvalidInputError(f"KVCacheSpec.{field} must be positive, got {getattr(self, field)}")
        if self.query_heads < 0:
            raise InvalidInputError(f"KVCacheSpec.query_heads must be >= 0 (0 = unknown), got {self.query_heads}")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8_e4m3"

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.dtype]

    @property
    def num_scales(self) -> int:
        return cdiv(self.kv_lora_rank, FP8_BLOCK)

    @property
    def entry_size(self) -> int:
        """Elements of torch_dtype per token."""
        if self.is_fp8:
            return self.kv_lora_rank + 4 * self.num_scales + 2 * self.rope_dim
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        return self.entry_size * self.torch_dtype.itemsize

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_blocks, self.block_size, self.entry_size)


@dataclass(frozen=True)
class AttentionBatch:
    """Host-side shape of one step: per sequence, how many new tokens it brings and how long it is.

    Sequence i holds seq_lens[i] tokens once this step's query_lens[i] new tokens are written; its new
    tokens are the last query_lens[i] positions and each attends causally to every position up to its own.
    This covers decode (1 query), speculative verification (k queries) and chunked prefill (a cached
    prefix plus a chunk) alike. block_tables[i] lists the cache blocks of sequence i in order.
    """

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.query_lens)
        if n == 0:
            raise InvalidInputError("AttentionBatch needs at least one sequence")
        if len(self.seq_lens) != n or len(self.block_tables) != n:
            raise InvalidInputError(
                f"AttentionBatch: query_lens ({n}), seq_lens ({len(self.seq_lens)}) and block_tables "
                f"({len(self.block_tables)}) must have one entry per sequence"
            )
        for i, (q, s) in enumerate(zip(self.query_lens, self.seq_lens)):
            if q < 1:
                raise InvalidInputError(f"sequence {i}: query_len must be >= 1, got {q}")
            if s < q:
                raise InvalidInputError(f"sequence {i}: seq_len {s} is shorter than its query_len {q}")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def positions(self) -> list[int]:
        """Position of every new token, sequence by sequence."""
        return [p for q, s in zip(self.query_lens, self.seq_lens) for p in range(s - q, s)]

    def validate_for(self, spec: KVCacheSpec) -> None:
        """Every block table covers its sequence and names only blocks that exist."""
        bs, num_blocks = spec.block_size, spec.num_blocks
        for i, (s, table) in enumerate(zip(self.seq_lens, self.block_tables)):
            need = -(-s // bs)
            if len(table) < need:
                raise InvalidInputError(
                    f"sequence {i}: block table has {len(table)} blocks but {s} tokens need {need} of size {bs}"
                )
            used = table[:need]
            # min / max / set run in C: this runs for every sequence of every step
            if used and (min(used) < 0 or max(used) >= num_blocks):
                bad = next(b for b in used if not 0 <= b < num_blocks)
                raise InvalidInputError(f"sequence {i}: block id {bad} is out of range [0, {num_blocks})")
            if len(set(used)) != need:
                raise InvalidInputError(f"sequence {i}: block table repeats a block id: {list(used)}")


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """Device tensors of one step, built by `Backend.plan_attention`; backends may subclass it.

    query_start_loc [B+1] int32: token offsets of each sequence's queries; seq_lens [B] int32;
    block_table [B, max_blocks] int32 (padded with 0); slot_mapping [T] int64: cache slot
    (block * block_size + offset) of each new token; positions [T] int64.
    """

    batch: AttentionBatch
    spec: KVCacheSpec
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def host_rows(batch: AttentionBatch, spec: KVCacheSpec) -> tuple[list[int], ...]:
        """Validate `batch` against `spec`; the common tensors' values as host lists: query_start_loc,
        seq_lens, the block table flattened with rows padded by 0 to the step's widest, slot_mapping,
        positions."""
        batch.validate_for(spec)
        bs = spec.block_size
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        used = [-(-s // bs) for s in batch.seq_lens]
        width = max(used)
        flat_table, pad = [], [0] * width
        slots, positions = [], []
        for table, n, q, s in zip(batch.block_tables, used, batch.query_lens, batch.seq_lens):
            flat_table.extend(table[:n])
            flat_table.extend(pad[: width - n])
            for p in range(s - q, s):
                slots.append(table[p // bs] * bs + p % bs)
            positions.extend(range(s - q, s))
        return starts, list(batch.seq_lens), flat_table, slots, positions

    @classmethod
    def build(cls, batch: AttentionBatch, spec: KVCacheSpec, device: torch.device, **extra) -> AttentionPlan:
        """Validate `batch` against `spec` and lay out the common tensors on `device`."""
        starts, lens, flat_table, slots, positions = cls.host_rows(batch, spec)
        starts_t, lens_t, table_t, slots_t, pos_t = to_device_many(
            [starts, lens, flat_table, slots, positions], torch.int64, device)
        return cls(
            batch=batch,
            spec=spec,
            query_start_loc=starts_t.to(torch.int32),
            seq_lens=lens_t.to(torch.int32),
            block_table=table_t.to(torch.int32).view(batch.num_seqs, -1),
            slot_mapping=slots_t,
            positions=pos_t,
            **extra,
        )


def decode_cache_rows(spec: KVCacheSpec, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, entry_size] cache rows -> (c_kv [N, kv_lora_rank], k_pe [N, rope_dim]) in float32."""
    r = spec.kv_lora_rank
    if not spec.is_fp8:
        return rows[:, :r].float(), rows[:, r:].float()
    s_end = r + 4 * spec.num_scales
    # .contiguous() before each .view: a byte slice may start at an offset the wider dtype cannot view.
    q = rows[:, :r].contiguous().view(FP8_DTYPE)
    scales = rows[:, r:s_end].contiguous().view(torch.float32)
    rope = rows[:, s_end:].contiguous().view(torch.bfloat16)
    return dequantize_fp8_per_token_group(q, scales), rope.float()


def read_cached_sequence(plan: AttentionPlan, cache: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `index` of the plan's batch, all seq_len cached tokens: (c_kv, k_pe) in float32. Whole blocks
    are gathered in table order and the unused tail of the last one dropped."""
    spec, seq_len = plan.spec, plan.batch.seq_lens[index]
    blocks = plan.block_table[index, : cdiv(seq_len, spec.block_size)].long()
    return decode_cache_rows(spec, cache[blocks].reshape(-1, spec.entry_size)[:seq_len])
