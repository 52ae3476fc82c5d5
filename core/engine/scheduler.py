"""Scheduler: continuous batching over the paged latent cache (pure Python, no torch).

Each step spends a token budget (max_num_batched_tokens) on at most max_num_seqs sequences: running decodes
first (one token each, plus lookahead slots reserved for speculative tokens), then running sequences still
in (chunked) prefill, then waiting sequences FCFS, taking prefix-cache hits. When a running sequence needs a
block and none is free, the youngest running sequence is preempted by recompute (blocks freed, computed
tokens reset, back to the front of waiting); a sequence never preempts an older one, so the oldest unfinished
sequence always progresses, and any sequence that fits in the cache alone eventually finishes.

Priority is FCFS by (arrival, fork index); running sequences are always older than waiting ones (admission
never skips the head of the queue), so "front of waiting" and "priority order" agree.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from deepinfer.engine.block_manager import BlockManager, cdiv
from deepinfer.engine.sequence import EngineStateError, Sequence, SequenceStatus
from deepinfer.errors import ConfigError, InvalidInputError


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_blocks: int
    block_size: int = 64
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_lookahead_slots: int = 0  # extra cache slots per sampling sequence, for speculative tokens

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_lookahead_slots, int) or self.num_lookahead_slots < 0:
            raise ConfigError(f"SchedulerConfig.num_lookahead_slots must be >= 0, got {self.num_lookahead_slots!r}")


@dataclass(frozen=True)
class ScheduledSequence:
    """This step feeds seq.all_token_ids[start : start + num_new_tokens] (positions likewise). `sample`: the
    step completes the sequence's known tokens, so a token is sampled from its last row. The cache also has
    `num_lookahead_slots` slots reserved after those tokens for draft tokens."""

    seq: Sequence
    num_new_tokens: int
    sample: bool
    num_lookahead_slots: int = 0
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", self.seq.num_computed_tokens)

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.get_token_ids(self.start, self.start + self.num_new_tokens)

    @property
    def seq_len(self) -> int:
        """Tokens in the cache for this sequence once the step has run (context length for attention)."""
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    preempted: tuple[str, ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    cache_usage: float  # fraction of blocks referenced
    prefix_cache_queries: int  # tokens looked up, once per admission (re-admissions after preemption too)
    prefix_cache_hits: int  # tokens found
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_prompt_tokens_computed: int  # prompt tokens run through the model (recomputation included, hits not)
    num_generation_tokens: int  # tokens appended by update()
    num_evictions: int  # cached blocks reclaimed


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._waiting: deque[Sequence] = deque()  # priority order
        self._running: list[Sequence] = []  # priority order
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._arrivals = itertools.count()
        self._fork_indices = itertools.count(1)
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0

    # ---- accessors ------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    def get(self, seq_id: str) -> Sequence | None:
        """The unfinished sequence with this id, or None."""
        return self._seqs.get(seq_id)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self._running), num_waiting=len(self._waiting), cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate, num_preemptions=self.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generation_tokens=self.num_generation_tokens, num_evictions=bm.num_evictions)

    # ---- admission ------------------------------------------------------------------------------------

    def _check_new(self, seq: Sequence) -> None:
        """Reject, at admission, a sequence that could never be scheduled."""
        cfg = self.config
        if seq.seq_id in self._seqs:
            raise InvalidInputError(f"a sequence with id {seq.seq_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise InvalidInputError(f"sequence {seq.seq_id!r} is not new ({seq.status.name}, "
                                    f"{seq.num_computed_tokens} computed, blocks {seq.block_table})")
        if seq.num_prompt_tokens > cfg.max_model_len:
            raise InvalidInputError(f"prompt of {seq.num_prompt_tokens} tokens is longer than max_model_len "
                                    f"({cfg.max_model_len})")
        if seq.max_len > cfg.max_model_len:
            raise InvalidInputError(f"sequence {seq.seq_id!r}: max_len {seq.max_len} exceeds max_model_len "
                                    f"({cfg.max_model_len})")
        if seq.num_tokens >= seq.max_len:
            raise InvalidInputError(f"sequence {seq.seq_id!r} has {seq.num_tokens} tokens, leaving no room to "
                                    f"generate within max_len {seq.max_len} (max_model_len {cfg.max_model_len})")
        needed = cdiv(seq.max_len, cfg.block_size)
        if needed > cfg.num_blocks:
            raise InvalidInputError(
                f"sequence {seq.seq_id!r} may grow to {seq.max_len} tokens ({needed} blocks of {cfg.block_size}) "
                f"but the whole cache holds {cfg.num_blocks} blocks ({cfg.num_blocks * cfg.block_size} tokens); "
                f"lower max_tokens or give the cache more memory")
        if not cfg.enable_chunked_prefill and seq.num_prompt_tokens > cfg.max_num_batched_tokens:
            raise InvalidInputError(
                f"prompt of {seq.num_prompt_tokens} tokens exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) and chunked prefill is off")

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FCFS); raises InvalidInputError if it can never fit."""
        self._check_new(seq)
        seq.arrival = next(self._arrivals)
        seq.fork_index = 0
        self._waiting.append(seq)
        self._seqs[seq.seq_id] = seq

    def fork(self, parent_id: str, child: Sequence) -> None:
        """Start a branch of a running sequence (n > 1): the child, whose tokens start with the parent's,
        shares the parent's full computed blocks copy-free and joins the running sequences right after it."""
        parent = self._seqs.get(parent_id)
        if parent is None or parent.status is not SequenceStatus.RUNNING:
            raise InvalidInputError(f"fork: {parent_id!r} is not a running sequence")
        self._check_new(child)
        self.block_manager.fork(parent, child)
        child.arrival, child.fork_index = parent.arrival, next(self._fork_indices)
        child.status = SequenceStatus.RUNNING
        bisect.insort(self._running, child, key=lambda s: s.priority)
        self._seqs[child.seq_id] = child

    def finish(self, seq_id: str, status: SequenceStatus) -> bool:
        """Remove a sequence (waiting or running) and free its blocks. False if unknown or finished already."""
        if not isinstance(status, SequenceStatus) or not status.is_finished:
            raise InvalidInputError(f"finish: {status!r} is not a finished status")
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        return True

    # ---- scheduling -----------------------------------------------------------------------------------

    def _num_new_tokens(self, remaining: int, budget: int) -> int:
        if self.config.enable_chunked_prefill or remaining <= budget:
            return min(remaining, budget)
        # Without chunked prefill a prompt runs whole or waits; only a recompute after preemption can exceed
        # the whole budget (prompt + outputs), and it is chunked so it cannot wait forever.
        return budget if remaining > self.config.max_num_batched_tokens else 0

    def _slots(self, seq: Sequence, start: int, num_new: int) -> tuple[int, int]:
        """(cache slots the step needs, lookahead slots among them); lookahead never reaches past max_len."""
        end = start + num_new
        if end < seq.num_tokens:
            return end, 0
        lookahead = min(self.config.num_lookahead_slots, max(0, seq.max_len - end))
        return end + lookahead, lookahead

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.block_manager.free(seq)  # also resets num_computed_tokens: prompt + outputs are recomputed
        seq.status = SequenceStatus.WAITING
        i = 0
        while i < len(self._waiting) and self._waiting[i].priority < seq.priority:
            i += 1
        self._waiting.insert(i, seq)  # the front, in practice: it is older than every waiting sequence
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, ScheduledSequence] = {}
        preempted: list[str] = []

        decodes, prefills = [], []
        for s in self._running:
            remaining = s.num_tokens - s.num_computed_tokens
            if remaining == 1:
                decodes.append(s)
            elif remaining > 1:
                prefills.append(s)
        bs = cfg.block_size
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            if budget == 0 or len(scheduled) >= cfg.max_num_seqs:
                break
            # A branch forked before any block was full has no blocks yet: like an admission, it starts
            # after its prefix-cache hits.
            start = seq.num_computed_tokens or bm.num_cached_tokens(seq)
            num_new = self._num_new_tokens(seq.num_tokens - start, budget)
            if num_new == 0:
                continue
            num_slots, lookahead = self._slots(seq, start, num_new)
            # Most decode steps write into the sequence's last block: nothing to allocate, nobody to preempt.
            if not seq.block_table or num_slots > len(seq.block_table) * bs:
                while bm.blocks_needed(seq, num_slots) > bm.num_free_blocks:
                    victim = self._running[-1]  # the youngest: possibly seq itself, never an older one
                    self._preempt(victim)
                    preempted.append(victim.seq_id)
                    if victim is seq:
                        break
                    undone = scheduled.pop(victim.seq_id, None)
                    if undone is not None:
                        budget += undone.num_new_tokens
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                bm.allocate(seq, num_slots)
                if seq.num_computed_tokens != start:
                    raise EngineStateError(f"prefix-cache hits for {seq.seq_id!r} changed while scheduling")
            scheduled[seq.seq_id] = ScheduledSequence(
                seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens, lookahead)
            budget -= num_new

        # Admit only when nobody was preempted: freshly freed blocks go to the preempted sequences first.
        while (not preempted and self._waiting and budget > 0 and len(scheduled) < cfg.max_num_seqs
               and len(self._running) < cfg.max_num_seqs):
            seq = self._waiting[0]
            cached = bm.num_cached_tokens(seq)
            num_new = self._num_new_tokens(seq.num_tokens - cached, budget)
            if num_new == 0:
                break
            num_slots, lookahead = self._slots(seq, cached, num_new)
            if bm.blocks_needed(seq, num_slots) > bm.num_free_blocks:
                break  # FCFS: nobody overtakes the head of the queue
            self._waiting.popleft()
            bm.allocate(seq, num_slots)
            if seq.num_computed_tokens != cached:
                raise EngineStateError(f"prefix-cache hits for {seq.seq_id!r} changed during admission")
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)  # youngest running: it was the oldest waiting
            scheduled[seq.seq_id] = ScheduledSequence(seq, num_new, cached + num_new == seq.num_tokens, lookahead)
            budget -= num_new

        entries = tuple(scheduled.values())
        return SchedulerOutput(entries, tuple(preempted), sum(e.num_new_tokens for e in entries))

    def update(self, output: SchedulerOutput, sampled: Mapping[str, list[int]],
               num_accepted_computed: Mapping[str, int] | None = None) -> None:
        """Apply a step's results: advance num_computed_tokens by each scheduled sequence's num_new_tokens,
        append the tokens sampled for sequences whose step had `sample` set, register newly full blocks.
        Sequences finished (e.g. aborted) since schedule() are skipped. Stopping is the engine's call.

        Speculative decoding: `num_accepted_computed[seq_id]` counts leading appended tokens (accepted drafts)
        whose KV the step already wrote in lookahead slots; they count as computed too."""
        accepted = num_accepted_computed or {}
        ids = {e.seq.seq_id for e in output.scheduled}
        if not ids.issuperset(sampled) or not ids.issuperset(accepted):
            unknown = (set(sampled) | set(accepted)) - ids
            raise EngineStateError(f"update: results for sequences not scheduled in this output: {sorted(unknown)}")
        applied = []  # validate every entry before changing anything, so an engine bug leaves no half-update
        seqs, running = self._seqs, SequenceStatus.RUNNING
        for entry in output.scheduled:
            seq = entry.seq
            seq_id = seq.seq_id
            if seqs.get(seq_id) is not seq or seq.status is not running:
                continue
            if seq.num_computed_tokens != entry.start:
                raise EngineStateError(f"update: stale output for {seq_id!r} (scheduled at {entry.start}, "
                                       f"now {seq.num_computed_tokens} computed); was it applied twice?")
            new_tokens = sampled.get(seq_id) or ()
            if type(new_tokens) is not list:
                new_tokens = list(new_tokens)
            extra = accepted.get(seq_id, 0) if accepted else 0
            if entry.sample and not new_tokens:
                raise EngineStateError(f"update: {seq.seq_id!r} was due a sampled token and got none")
            if not entry.sample and (new_tokens or extra):
                raise EngineStateError(f"update: {seq.seq_id!r} is mid-prefill and cannot take sampled tokens")
            if extra and (extra < 0 or extra > min(entry.num_lookahead_slots, max(0, len(new_tokens) - 1))):
                raise EngineStateError(f"update: {seq.seq_id!r}: {extra} accepted tokens computed, but only "
                                       f"{entry.num_lookahead_slots} lookahead slots and {len(new_tokens)} tokens")
            if seq.num_tokens + len(new_tokens) > seq.max_len:
                raise EngineStateError(f"update: {seq.seq_id!r} would exceed max_len {seq.max_len}; the engine "
                                       f"must stop it (or truncate speculative tokens) first")
            applied.append((entry, new_tokens, extra))
        mark_computed = self.block_manager.mark_computed
        for entry, new_tokens, extra in applied:
            seq, start = entry.seq, entry.start
            if start < seq.num_prompt_tokens:  # decodes (start past the prompt) add nothing
                self.num_prompt_tokens_computed += min(start + entry.num_new_tokens, seq.num_prompt_tokens) - start
            seq.num_computed_tokens += entry.num_new_tokens + extra
            if new_tokens:
                seq.append_token_ids(new_tokens)
                self.num_generation_tokens += len(new_tokens)
            mark_computed(seq, seq.num_computed_tokens)
