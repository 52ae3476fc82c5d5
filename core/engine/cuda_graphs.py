"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step (one new token per sequence, logits for every row) is padded up to the nearest captured batch
size with dummy sequences of one token whose cache slot is a reserved sink block. The attention plan of
each graph is made once with room for sequences up to max_seq_len; a step re-plans into it on the host
(`plan_attention(..., into=plan)` rewrites its device tensors), copies the token ids into the graph's input
buffer and replays. Everything a step changes lives in those persistent tensors, so the captured kernels
never see a new pointer.

Under expert parallelism (moe_capacity) each graph's MoE dispatch is sized for its batch size, so it uses
fixed-size buffers with no host synchronisation, and the ranks replay graphs of one size together (the size
agreed on for the step; a rank with nothing to run replays it on dummy rows alone, see run_idle).

On a CPU device (the Triton interpreter in CI) there is nothing to capture: a "replay" re-runs the same
forward on the same persistent buffers, so the padding and re-planning logic is tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from deepinfer.attention import AttentionBatch, AttentionPlan, KVCacheSpec
from deepinfer.backend import Backend
from deepinfer.errors import ConfigError
from deepinfer.model.context import ForwardContext
from deepinfer.model.deepseek import DeepseekModel

logger = logging.getLogger(__name__)


def default_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 (vLLM's spacing: padding wastes at most 15 rows), up to the max."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    sizes += range(16, max_batch_size + 1, 16)
    if max_batch_size not in sizes:
        sizes.append(max_batch_size)
    return tuple(sorted(set(sizes)))


@dataclass
class _Captured:
    """One batch size's graph and the persistent tensors it reads and writes."""

    size: int
    input_ids: torch.Tensor  # [size] int64
    plan: AttentionPlan
    graph: torch.cuda.CUDAGraph | None  # None on CPU: replay re-runs the forward
    hidden: torch.Tensor | None = None  # [size, hidden]
    logits: torch.Tensor | None = None  # [size, vocab] float32


class DecodeGraphs:
    def __init__(self, model: DeepseekModel, backend: Backend, spec: KVCacheSpec, kv_caches: Sequence[torch.Tensor],
                 sink_block: int, batch_sizes: Sequence[int], max_seq_len: int, moe_capacity: bool = False):
        if not backend.capabilities.graph_capture:
            raise ConfigError(f"backend {backend.name!r} cannot capture graphs (capabilities.graph_capture is False)")
        if not batch_sizes or min(batch_sizes) < 1:
            raise ConfigError(f"graph batch sizes must be positive, got {tuple(batch_sizes)}")
        self.model, self.backend, self.spec = model, backend, spec
        self.kv_caches = tuple(kv_caches)
        self.sink_block = sink_block
        self.max_seq_len = max_seq_len
        self.moe_capacity = moe_capacity
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self._graphs: dict[int, _Captured] = {}
        self._on_gpu = backend.device.type == "cuda"
        self.capture_seconds = 0.0

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _padded(self, batch: AttentionBatch | None, size: int) -> AttentionBatch:
        """`batch` plus one-token dummy sequences on the sink block, up to `size` (all dummies for None)."""
        q, s, t = (batch.query_lens, batch.seq_lens, batch.block_tables) if batch is not None else ((), (), ())
        pad = size - len(q)
        return AttentionBatch(q + (1,) * pad, s + (1,) * pad, t + ((self.sink_block,),) * pad)

    def _forward(self, ids: torch.Tensor, plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        capacity = ids.shape[0] if self.moe_capacity else None
        hidden = self.model.forward(ids, ForwardContext(plan, self.kv_caches, moe_capacity=capacity))
        return hidden, self.model.compute_logits(hidden)

    def capture(self) -> None:
        """Capture every batch size, largest first so that the smaller graphs reuse its memory pool."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self._on_gpu else None
        for size in reversed(self.batch_sizes):
            dummy = self._padded(None, size)
            plan = self.backend.plan_attention(dummy, self.spec, max_seq_len=self.max_seq_len)
            ids = torch.zeros(size, dtype=torch.int64, device=self.backend.device)
            entry = _Captured(size, ids, plan, None)
            # Eager first: compiles and tunes the kernels for this shape, and allocates per-plan workspaces,
            # outside the capture.
            entry.hidden, entry.logits = self._forward(ids, plan)
            if self._on_gpu:
                torch.cuda.synchronize(self.backend.device)
                entry.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(entry.graph, pool=pool):
                    entry.hidden, entry.logits = self._forward(ids, plan)
                torch.cuda.synchronize(self.backend.device)
            self._graphs[size] = entry
        self.capture_seconds = time.perf_counter() - started
        logger.info("captured decode graphs for batch sizes %s in %.1f s", self.batch_sizes, self.capture_seconds)

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size holding num_seqs sequences, or None (run eagerly)."""
        for size in self.batch_sizes:
            if size >= num_seqs:
                return size
        return None

    def serves(self, batch: AttentionBatch, logit_rows: Sequence[int]) -> bool:
        """A decode step (one query per sequence, logits for each in order) that fits a captured size."""
        return (bool(self._graphs) and batch.num_seqs > 0 and all(q == 1 for q in batch.query_lens)
                and max(batch.seq_lens) <= self.max_seq_len and self.size_for(batch.num_seqs) is not None
                and len(logit_rows) == batch.num_seqs and all(r == i for i, r in enumerate(logit_rows)))

    def run(self, batch: AttentionBatch, input_ids: torch.Tensor, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for this decode step: (hidden [B, H], logits [B, V]) views of the graph's outputs,
        valid until the next replay of the same size. size: a captured size to pad to (default the smallest
        that holds the batch)."""
        size = size or self.size_for(batch.num_seqs)
        entry = self._graphs[size]
        n = batch.num_seqs
        plan = self.backend.plan_attention(self._padded(batch, size), self.spec, into=entry.plan)
        entry.input_ids[:n].copy_(input_ids, non_blocking=True)
        if n < size:
            entry.input_ids[n:].zero_()
        self._replay(entry, plan)
        return entry.hidden[:n], entry.logits[:n]

    def release(self) -> None:
        """Free every captured graph now, once the device is done with them (an overlapped step may still be
        replaying one). Under expert parallelism this must come before the process group is destroyed: graphs
        holding captured NCCL kernels make its destruction hang (pytorch/pytorch#115388)."""
        if self._on_gpu:
            torch.cuda.synchronize(self.backend.device)
        for entry in self._graphs.values():
            if entry.graph is not None:
                entry.graph.reset()
        self._graphs.clear()

    def run_idle(self, size: int) -> None:
        """Replay one size's graph on dummy rows alone (expert parallelism: a rank with nothing to run still
        enters the step's collectives with the others)."""
        entry = self._graphs[size]
        plan = self.backend.plan_attention(self._padded(None, size), self.spec, into=entry.plan)
        entry.input_ids.zero_()
        self._replay(entry, plan)

    def replay(self, size: int) -> None:
        """Replay the graph of one captured size on its current buffers (profiling: no re-planning)."""
        entry = self._graphs[size]
        self._replay(entry, entry.plan)

    def _replay(self, entry: _Captured, plan: AttentionPlan) -> None:
        if entry.graph is not None:
            entry.graph.replay()
        else:
            entry.hidden, entry.logits = self._forward(entry.input_ids, plan)


def reserve_sink(spec: KVCacheSpec) -> tuple[KVCacheSpec, int]:
    """The cache spec with one more block, and that block's id: padded graph rows write and read only there."""
    return replace(spec, num_blocks=spec.num_blocks + 1), spec.num_blocks

