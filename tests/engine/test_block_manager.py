"""BlockManager: property-based interleavings against a shadow model of the cache contents, plus unit tests.

The shadow model records, for every cache slot, the token prefix whose KV was written there. A sequence may
only ever read slots holding exactly its own prefix, and a step may only write into blocks no one else holds
and the prefix cache does not publish.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deepinfer.engine.block_manager import BlockManager, OutOfBlocksError
from deepinfer.engine.sequence import PENDING_TOKEN, EngineStateError, Sequence, SequenceStatus
from deepinfer.errors import InvalidInputError

BS = 4
NUM_BLOCKS = 12
# Prompts are cut from a few shared bases so that prefix hits (and near misses) are common.
BASES = ([1, 2, 3, 4] * 6, [1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 9, 1, 2] * 6)


def new_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, max_len=10**6)


class BlockManagerMachine(RuleBasedStateMachine):
    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=self.caching)
        self.live: dict[str, Sequence] = {}
        self.freed: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> prefix whose KV is there
        self.ids = 0

    # ---- helpers --------------------------------------------------------------------------------------

    def _pick(self, data: st.DataObject) -> Sequence:
        return self.live[data.draw(st.sampled_from(sorted(self.live)))]

    def _check_reads(self, seq: Sequence) -> None:
        """Every computed position of seq reads its own prefix's KV."""
        tokens = seq.all_token_ids
        for p in range(seq.num_computed_tokens):
            slot = (seq.block_table[p // BS], p % BS)
            assert self.kv.get(slot) == tokens[: p + 1], f"{seq.seq_id} reads wrong KV at position {p}"

    def _allocate(self, seq: Sequence, num_tokens: int) -> None:
        """allocate, checking the all-or-nothing contract and that evictions follow LRU order."""
        bm = self.bm
        needed = bm.blocks_needed(seq, num_tokens)
        evictable_before = list(bm._evictable)
        table_before, free_before = list(seq.block_table), bm.num_free_blocks
        if needed > bm.num_free_blocks:
            with pytest.raises(OutOfBlocksError):
                bm.allocate(seq, num_tokens)
            assert seq.block_table == table_before and bm.num_free_blocks == free_before
            return
        admitting = not seq.block_table and seq.num_computed_tokens == 0
        cached = bm.allocate(seq, num_tokens)
        assert bm.num_free_blocks == free_before - needed
        assert len(seq.block_table) >= -(-num_tokens // BS)
        if admitting:
            assert cached == seq.num_computed_tokens and cached % BS == 0
            assert cached <= seq.num_tokens - 1
            if not self.caching:
                assert cached == 0
        taken = [b for b in evictable_before if bm._ref_counts[b] > 0 and bm._block_key[b] is not None]
        evicted = [b for b in evictable_before if bm._block_key[b] is None]
        remaining = [b for b in evictable_before if b not in taken]
        assert evicted == remaining[: len(evicted)], "evictions must take the least recently freed first"
        self._check_reads(seq)

    # ---- rules ----------------------------------------------------------------------------------------

    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 24), suffix=st.lists(st.integers(0, 2), max_size=6),
          extra=st.integers(0, 6))
    def admit(self, base, cut, suffix, extra):
        self.ids += 1
        seq = new_seq(f"s{self.ids}", base[:cut] + suffix)
        self._allocate(seq, seq.num_tokens + extra)
        if seq.seq_id in self.bm._holders:
            self.live[seq.seq_id] = seq

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 12))
    def compute(self, data, k):
        """Write KV for the next k tokens (as a model step would), then register newly full blocks."""
        seq = self._pick(data)
        end = min(seq.num_computed_tokens + k, seq.num_tokens, len(seq.block_table) * BS)
        tokens = seq.all_token_ids
        for p in range(seq.num_computed_tokens, end):
            block = seq.block_table[p // BS]
            assert self.bm._ref_counts[block] == 1, f"writing into block {block} shared by others"
            assert self.bm._block_key[block] is None, f"writing into published cached block {block}"
            self.kv[(block, p % BS)] = tokens[: p + 1]
        seq.num_computed_tokens = end
        self.bm.mark_computed(seq, end)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 9), min_size=1, max_size=6))
    def append(self, data, tokens):
        self._pick(data).append_token_ids(tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(0, 4))
    def grow(self, data, extra):
        seq = self._pick(data)
        self._allocate(seq, max(seq.num_tokens + extra, len(seq.block_table) * BS))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 9), max_size=3))
    def fork(self, data, tail):
        parent = self._pick(data)
        self.ids += 1
        child = new_seq(f"s{self.ids}", list(parent.all_token_ids) + tail)
        self.bm.fork(parent, child)
        n = len(child.block_table)
        assert child.block_table == parent.block_table[:n]
        assert child.num_computed_tokens == n * BS <= parent.num_computed_tokens
        assert n * BS <= child.num_tokens - 1
        self.live[child.seq_id] = child
        self._check_reads(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = self._pick(data)
        assert self.bm.free(seq) is True
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        del self.live[seq.seq_id]
        self.freed.append(seq)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_again(self, data):
        seq = data.draw(st.sampled_from(self.freed))
        free_before = self.bm.num_free_blocks
        assert self.bm.free(seq) is False
        assert self.bm.num_free_blocks == free_before

    @rule(size=st.integers(1, NUM_BLOCKS * BS))
    def pressure(self, size):
        """A burst of fresh tokens that forces eviction of cached blocks, held briefly then freed."""
        self.ids += 1
        seq = new_seq(f"s{self.ids}", [100 + self.ids] * size)
        self._allocate(seq, size)
        self.bm.free(seq)

    # ---- invariants -----------------------------------------------------------------------------------

    @invariant()
    def bookkeeping_consistent(self):
        self.bm.check_invariants()
        referenced = sum(1 for c in self.bm._ref_counts if c > 0)
        assert self.bm.num_free_blocks + referenced == NUM_BLOCKS

    @invariant()
    def sharing_only_with_identical_prefix(self):
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in self.live.values():
            for i, block in enumerate(seq.block_table):
                holders.setdefault(block, []).append((seq, i))
        for block, held in holders.items():
            if len(held) < 2:
                continue
            prefixes = {seq.all_token_ids[: (i + 1) * BS] for seq, i in held}
            assert len(prefixes) == 1, f"block {block} shared by sequences whose prefixes differ"
            for seq, i in held:  # shared blocks are full and computed for every holder
                assert (i + 1) * BS <= seq.num_computed_tokens

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        for seq in self.live.values():
            self._check_reads(seq)

    @invariant()
    def cached_blocks_hold_what_they_claim(self):
        for block_hash, block in self.bm._cache.items():
            _, _, tokens = self.bm._block_key[block]
            for slot in range(BS):
                assert self.kv[(block, slot)][-1] == tokens[slot]


class BlockManagerNoCachingMachine(BlockManagerMachine):
    caching = False


machine_settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = machine_settings
TestBlockManagerNoCachingStateful = BlockManagerNoCachingMachine.TestCase
TestBlockManagerNoCachingStateful.settings = settings(machine_settings, max_examples=40)


# ---- unit tests ---------------------------------------------------------------------------------------


def computed_seq(bm: BlockManager, seq_id: str, tokens: list[int]) -> Sequence:
    """A sequence admitted and fully computed (all its full blocks registered)."""
    seq = new_seq(seq_id, tokens)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq, seq.num_tokens)
    return seq


def test_hit_never_covers_the_last_token():
    bm = BlockManager(8, BS)
    computed_seq(bm, "a", list(range(8)))
    # Block-aligned and fully cached: the last block must be recomputed to get logits for the last token.
    assert bm.find_cached_prefix(list(range(8))) == (bm._holders["a"].block_table[:1], 4)
    assert bm.find_cached_prefix(list(range(9)))[1] == 8
    assert bm.find_cached_prefix(list(range(7)))[1] == 4
    assert bm.find_cached_prefix([0, 1, 2])[1] == 0
    assert bm.find_cached_prefix([0, 1, 2, 9, 4, 5, 6, 7, 8])[1] == 0  # first block differs


def test_hit_requires_the_whole_prefix():
    bm = BlockManager(8, BS)
    computed_seq(bm, "a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    # Same second block after a different first block: no hit (the hash chain includes the parent).
    assert bm.find_cached_prefix([3, 3, 3, 3, 2, 2, 2, 2, 0])[1] == 0
    assert bm.find_cached_prefix([1, 1, 1, 1, 2, 2, 2, 2, 0])[1] == 8


def test_hash_collisions_never_share_blocks():
    bm = BlockManager(8, BS)
    # A weak hash that collides for every block with the same parent: only the stored tokens tell them apart.
    bm._hash_block = lambda parent, tokens: hashlib.sha256(b"p" + (parent or b"")).digest()
    a = computed_seq(bm, "a", [1, 2, 3, 4, 0])
    b = new_seq("b", [5, 6, 7, 8, 0])
    assert bm.allocate(b, b.num_tokens) == 0
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.check_invariants()


def test_fork_shares_full_computed_blocks_only():
    bm = BlockManager(8, BS)
    parent = computed_seq(bm, "p", list(range(10)))  # blocks: [0-3] [4-7] [8,9 partial]
    child = new_seq("c", list(range(10)) + [42])
    bm.fork(parent, child)
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed_tokens == 8
    assert [bm._ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    bm.check_invariants()
    # A child that diverges inside the shared region is refused.
    with pytest.raises(InvalidInputError):
        bm.fork(parent, new_seq("d", [0, 1, 2, 3, 9, 9, 9, 9, 9]))
    assert bm.free(parent) and bm.free(child)
    assert bm.usage == 0 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_hit_counters_in_tokens():
    bm = BlockManager(8, BS)
    computed_seq(bm, "a", list(range(10)))
    b = new_seq("b", list(range(9)) + [77, 78])
    assert bm.allocate(b, b.num_tokens) == 8
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 21)


def test_lru_eviction_order():
    bm = BlockManager(3, BS)
    seqs = {}
    for i, name in enumerate("abc"):
        seq = new_seq(name, [i] * 4)
        bm.allocate(seq, 4)
        seq.num_computed_tokens = 4
        bm.mark_computed(seq, 4)
        seqs[name] = seq
    for name in "bac":  # freed in this order: b least recently
        bm.free(seqs[name])
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 3
    fresh = new_seq("x", [50] * 4)
    bm.allocate(fresh, 4)
    assert bm.num_evictions == 1
    assert bm.find_cached_prefix([1] * 4 + [0])[1] == 0  # b evicted
    assert bm.find_cached_prefix([0] * 4 + [0])[1] == 4
    assert bm.find_cached_prefix([2] * 4 + [0])[1] == 4
    bm.check_invariants()


def test_free_blocks_are_used_before_evicting():
    bm = BlockManager(4, BS)
    a = computed_seq(bm, "a", [7] * 4 + [1])  # 2 blocks, the first one cached
    bm.free(a)
    b = new_seq("b", [8] * 8)
    bm.allocate(b, 8)  # 2 blocks: the never-cached ones come first
    assert bm.num_evictions == 0
    assert bm.find_cached_prefix([7] * 4 + [1])[1] == 4


def test_taking_an_evictable_hit_revives_it():
    bm = BlockManager(2, BS)
    a = computed_seq(bm, "a", [3] * 4 + [1])
    bm.free(a)
    b = new_seq("b", [3] * 4 + [2, 2, 2])
    assert bm.blocks_needed(b, 7) == 2  # one evictable hit + one new block
    assert bm.allocate(b, 7) == 4
    assert bm.num_evictions == 0 and bm.num_free_blocks == 0
    bm.check_invariants()


def test_out_of_blocks_changes_nothing_and_double_free_is_a_no_op():
    bm = BlockManager(2, BS)
    a = new_seq("a", [1] * 9)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(a, 9)
    assert a.block_table == [] and bm.num_free_blocks == 2
    bm.allocate(a, 8)
    assert bm.free(a) is True
    assert bm.free(a) is False
    bm.check_invariants()
    # A different object reusing a live id cannot free or grow the other one's blocks.
    b = new_seq("b", [1] * 4)
    bm.allocate(b, 4)
    with pytest.raises(EngineStateError):
        bm.free(_impostor(b))


def test_growing_a_running_sequence():
    """The decode fast path of allocate() and mark_computed(): growth only at block boundaries, running
    out of blocks changes nothing, an impostor cannot grow the holder's table, and a block registers in
    the prefix cache on the step that fills it."""
    bm = BlockManager(3, BS)
    a = new_seq("a", [1, 2, 3])
    bm.allocate(a, 4)
    a.num_computed_tokens = 3
    bm.mark_computed(a, 3)
    assert bm.num_cached_blocks == 0
    a.append_token_ids([4])
    assert bm.blocks_needed(a, 5) == 1 and bm.allocate(a, 4) == 0 and len(a.block_table) == 1
    a.num_computed_tokens = 4
    bm.mark_computed(a, 4)  # the first block is full: registered
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == (a.block_table[:1], 4)
    with pytest.raises(EngineStateError):
        bm.allocate(_impostor(a), 5)
    assert bm.allocate(a, 12) == 0 and len(a.block_table) == 3 and bm.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        bm.allocate(a, 13)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 0
    bm.mark_computed(a, 4)  # nothing newly full: a no-op
    assert bm.num_cached_blocks == 1
    with pytest.raises(EngineStateError):
        bm.mark_computed(a, 5)  # more computed tokens than the sequence has
    bm.check_invariants()


def _impostor(seq: Sequence) -> Sequence:
    other = new_seq(seq.seq_id, list(seq.all_token_ids))
    other.block_table = list(seq.block_table)
    return other


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    computed_seq(bm, "a", list(range(10)))
    b = new_seq("b", list(range(10)))
    assert bm.allocate(b, 10) == 0
    assert bm.num_cached_blocks == 0
    bm.check_invariants()


def test_sequence_rejects_bad_tokens():
    with pytest.raises(InvalidInputError):
        Sequence("a", [], 4)
    with pytest.raises(InvalidInputError):
        Sequence("a", [1, -2], 4)
    with pytest.raises(InvalidInputError):
        Sequence("a", [1, "x"], 4)
    seq = Sequence("a", [1, 2], 4)
    assert seq.status is SequenceStatus.WAITING and not seq.status.is_finished
    # One sampled token at a time (the decode fast path) is checked like a list of them.
    for bad in ([-2], [2**63], ["x"], [1.0]):
        with pytest.raises(InvalidInputError):
            seq.append_token_ids(bad)
    seq.append_token_ids([True])  # an index, like any int
    assert seq.all_token_ids == (1, 2, 1) and seq.get_token_id(-1) == 1
    seq.append_token_ids([PENDING_TOKEN])
    with pytest.raises(EngineStateError):
        seq.append_token_ids([5])  # the pending token must be resolved first
    for bad in (-1, -2, 2**63, "x"):
        with pytest.raises(InvalidInputError):
            seq.resolve_pending(bad)
    seq.resolve_pending(7)
    assert seq.all_token_ids == (1, 2, 1, 7) and not seq.has_pending_token
    with pytest.raises(EngineStateError):
        seq.resolve_pending(8)
    assert SequenceStatus.FINISHED_ABORTED.is_finished


def test_scheduling_modules_do_not_import_torch():
    code = ("import sys\n"
            "import deepinfer.engine.sequence, deepinfer.engine.block_manager, deepinfer.engine.scheduler\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
