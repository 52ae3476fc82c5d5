"""BlockManager: reference-counted blocks of the paged latent cache, with prefix caching.

A block holds `block_size` consecutive tokens of one sequence. A full block whose KV is computed is
registered under a chained hash, sha256(parent block hash, its token ids), so a later sequence reuses it
only when its whole token prefix up to that block matches. Registered blocks nobody references stay
cached but are evictable, least recently freed first; allocation takes never-cached blocks first.

Only full computed blocks are ever shared (prefix hits, fork), so every block a step writes into is
private to one sequence: sharing needs no copy-on-write.

Pure Python (no torch).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque

from deepinfer.engine.sequence import EngineStateError, Sequence
from deepinfer.errors import ConfigError, InvalidInputError


class OutOfBlocksError(EngineStateError):
    """allocate() was asked for more blocks than are free or evictable (callers check blocks_needed first)."""


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained hash of a full block: sha256 over the parent block's hash (or a root marker) and the tokens."""
    h = hashlib.sha256(b"\x00" if parent_hash is None else b"\x01" + parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 64, enable_prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_block = hash_block  # an attribute so tests can force collisions
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; front = evict first
        self._cache: dict[bytes, int] = {}  # block hash -> block id
        # What each cached block holds, compared on every hit so a hash collision can never share a block.
        self._block_key: list[tuple[bytes, bytes | None, tuple[int, ...]] | None] = [None] * num_blocks
        self._holders: dict[str, Sequence] = {}  # sequences that hold (or may hold) blocks
        self._num_registered: dict[str, int] = {}  # per holder: leading table blocks already registered
        # Statistics, in tokens: prefix-cache lookups happen once per admission (re-admissions included).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # ---- capacity -------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out: never-cached free blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache lookup (pure) -------------------------------------------------------------------

    def _match(self, tokens: list[int] | tuple[int, ...], hashes: list[bytes]) -> list[int]:
        """Cached blocks covering the longest prefix of `tokens`, leaving at least the last token uncached
        (it must be computed to get logits). Extends `hashes` (the chain for `tokens`) as it goes."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        blocks: list[int] = []
        for i in range((len(tokens) - 1) // bs):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            parent = hashes[i - 1] if i else None
            if i == len(hashes):
                hashes.append(self._hash_block(parent, block_tokens))
            block = self._cache.get(hashes[i])
            if block is None or self._block_key[block] != (hashes[i], parent, block_tokens):
                break
            blocks.append(block)
        return blocks

    def find_cached_prefix(self, token_ids: list[int] | tuple[int, ...]) -> tuple[list[int], int]:
        """(cached block ids, number of tokens they cover) for a token sequence; never all of the tokens."""
        blocks = self._match(token_ids, [])
        return blocks, len(blocks) * self.block_size

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of a sequence without blocks that admission would take from the prefix cache."""
        return len(self._match_seq(seq)) * self.block_size

    def _match_seq(self, seq: Sequence) -> list[int]:
        if seq.block_table or seq.num_computed_tokens or seq.skip_prefix_cache:
            return []  # only an admission (empty table, nothing computed) takes cache hits
        # Only whole blocks are hashed, so passing the first (num_full_blocks * bs) + 1 tokens is enough.
        n = min(seq.num_tokens, ((seq.num_tokens - 1) // self.block_size) * self.block_size + 1)
        return self._match(seq.get_token_ids(0, n), seq.block_hashes)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free-or-evictable blocks allocate(seq, num_tokens) would consume (cache hits that are evictable
        count: taking them removes them from the evictable pool)."""
        if seq.block_table:  # holding blocks: not an admission, so no prefix-cache lookup (the hot case)
            return max(0, cdiv(num_tokens, self.block_size) - len(seq.block_table))
        hits = self._match_seq(seq)
        new = max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table) - len(hits))
        return new + sum(1 for b in hits if self._ref_counts[b] == 0)

    # ---- allocation -----------------------------------------------------------------------------------

    def _check_holder(self, seq: Sequence) -> None:
        held = self._holders.get(seq.seq_id)
        if held is not None and held is not seq:
            raise EngineStateError(f"another sequence object with id {seq.seq_id!r} already holds blocks")
        if held is None and seq.block_table:
            raise EngineStateError(f"sequence {seq.seq_id!r} has blocks this manager did not give it")

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._block_key[block]
            del self._cache[key[0]]
            self._block_key[block] = None
            self.num_evictions += 1
        self._ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Grow seq.block_table to hold `num_tokens` slots. On admission (empty table, nothing computed) it
        first takes prefix-cache hits and sets seq.num_computed_tokens to the tokens they cover.
        Returns that number (0 when not admitting). Raises OutOfBlocksError, changing nothing, when
        blocks_needed(seq, num_tokens) exceeds num_free_blocks."""
        table = seq.block_table
        if table and self._holders.get(seq.seq_id) is seq:
            # Growing a running sequence (every decode step): no hits to take, only new blocks at the end.
            missing = cdiv(num_tokens, self.block_size) - len(table)
            if missing > self.num_free_blocks:
                raise OutOfBlocksError(f"sequence {seq.seq_id!r} needs {missing} blocks for {num_tokens} tokens, "
                                       f"{self.num_free_blocks} are free")
            for _ in range(missing):
                table.append(self._take_block())
            return 0
        self._check_holder(seq)
        admitting = not seq.block_table and seq.num_computed_tokens == 0
        hits = self._match_seq(seq)
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq.seq_id!r} needs {needed} blocks for {num_tokens} tokens, "
                f"{self.num_free_blocks} are free")
        for block in hits:  # before taking new blocks, so eviction cannot reclaim a hit
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        seq.block_table.extend(hits)
        cached_tokens = len(hits) * self.block_size
        if admitting:
            seq.num_computed_tokens = cached_tokens
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached_tokens
            self._num_registered[seq.seq_id] = len(hits)
        for _ in range(self.blocks_for_tokens(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_block())
        self._holders[seq.seq_id] = seq
        self._num_registered.setdefault(seq.seq_id, 0)
        return cached_tokens

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register in the prefix cache the full blocks among the first `num_computed_tokens` tokens (whose
        KV is now in the cache). A block whose content is already cached elsewhere stays private."""
        self._check_holder(seq)
        if num_computed_tokens > min(len(seq.block_table) * self.block_size, seq.num_tokens):
            raise EngineStateError(
                f"sequence {seq.seq_id!r}: {num_computed_tokens} computed tokens, but it has "
                f"{seq.num_tokens} tokens in {len(seq.block_table)} blocks")
        if not self.enable_prefix_caching or seq.seq_id not in self._holders:
            return
        bs = self.block_size
        start, end = self._num_registered[seq.seq_id], num_computed_tokens // bs
        if end <= start:
            # No block filled since the last call (most decode steps). Registered blocks always have their
            # hashes (admission and fork hand them over with the blocks), so the loops below would do nothing.
            return
        hashes = seq.block_hashes
        while len(hashes) < end:
            i = len(hashes)
            hashes.append(self._hash_block(hashes[i - 1] if i else None, seq.get_token_ids(i * bs, (i + 1) * bs)))
        for i in range(start, end):
            block_tokens = tuple(seq.get_token_ids(i * bs, (i + 1) * bs))
            parent = hashes[i - 1] if i else None
            block, block_hash = seq.block_table[i], hashes[i]
            key = self._block_key[block]
            if key is not None:  # a hit or a forked block: registered already, and must be this content
                if key[0] != block_hash:
                    raise EngineStateError(f"block {block} of {seq.seq_id!r} is cached with other content")
                continue
            if block_hash not in self._cache:
                self._cache[block_hash] = block
                self._block_key[block] = (block_hash, parent, block_tokens)
        self._num_registered[seq.seq_id] = max(start, end)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share the parent's full computed blocks with a new child (copy-free, reference counted); the child
        starts with num_computed_tokens = the tokens in those blocks and recomputes the rest itself."""
        self._check_holder(parent)
        if child.block_table or child.seq_id in self._holders:
            raise EngineStateError(f"fork: child {child.seq_id!r} already holds blocks")
        bs = self.block_size
        num_shared = min(parent.num_computed_tokens // bs, len(parent.block_table), (child.num_tokens - 1) // bs)
        num_shared_tokens = num_shared * bs
        if child.get_token_ids(0, num_shared_tokens) != parent.get_token_ids(0, num_shared_tokens):
            raise InvalidInputError(
                f"fork: child {child.seq_id!r} does not start with the first {num_shared_tokens} tokens "
                f"of {parent.seq_id!r}")
        shared = parent.block_table[:num_shared]
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table = list(shared)
        child.num_computed_tokens = num_shared_tokens
        child.block_hashes = parent.block_hashes[:num_shared]  # same tokens, so the same chain
        self._holders[child.seq_id] = child
        self._num_registered[child.seq_id] = min(self._num_registered.get(parent.seq_id, 0), num_shared)

    def free(self, seq: Sequence) -> bool:
        """Release a sequence's blocks (cached ones become evictable, the rest free) and reset it to nothing
        computed. Returns False, changing nothing, when the sequence holds nothing (e.g. freed already)."""
        self._check_holder(seq)
        if seq.seq_id not in self._holders:
            return False
        # Tail first, so a prefix's later blocks are evicted before its earlier ones (which more prompts share).
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_key[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        del self._holders[seq.seq_id]
        del self._num_registered[seq.seq_id]
        return True

    # ---- checking -------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise EngineStateError if the bookkeeping is inconsistent (used by tests)."""
        def fail(msg: str) -> None:
            raise EngineStateError(f"block manager invariant broken: {msg}")

        held = Counter(b for seq in self._holders.values() for b in seq.block_table)
        for seq in self._holders.values():
            if len(set(seq.block_table)) != len(seq.block_table):
                fail(f"{seq.seq_id!r} holds a block twice: {seq.block_table}")
            if seq.num_computed_tokens > len(seq.block_table) * self.block_size:
                fail(f"{seq.seq_id!r} has computed tokens beyond its blocks")
        for block in range(self.num_blocks):
            if self._ref_counts[block] != held[block]:
                fail(f"block {block} has refcount {self._ref_counts[block]} but {held[block]} holders")
        free, evictable = set(self._free), set(self._evictable)
        referenced = {b for b in range(self.num_blocks) if self._ref_counts[b] > 0}
        if len(free) != len(self._free):
            fail("a block is in the free queue twice")
        if free & evictable or free & referenced or evictable & referenced:
            fail("a block is in two of free / evictable / referenced")
        if len(free) + len(evictable) + len(referenced) != self.num_blocks:
            fail(f"{len(free)} free + {len(evictable)} evictable + {len(referenced)} referenced "
                 f"!= {self.num_blocks} blocks")
        if any(self._block_key[b] is not None for b in free) or any(self._block_key[b] is None for b in evictable):
            fail("free blocks must be uncached and evictable blocks cached")
        keyed = [b for b in range(self.num_blocks) if self._block_key[b] is not None]
        if sorted(self._cache.values()) != keyed:
            fail("cached hashes and blocks with recorded content disagree")
        for block_hash, block in self._cache.items():
            recorded_hash, parent, tokens = self._block_key[block]
            if recorded_hash != block_hash or self._hash_block(parent, tokens) != block_hash:
                fail(f"block {block}'s recorded content does not produce its hash")
            if len(tokens) != self.block_size:
                fail(f"cached block {block} is not full")
