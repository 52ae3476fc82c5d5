"""Scheduler: policy unit tests and a simulated engine whose fake "model" reads its context from a simulated
paged cache, so any wrong block table, prefix hit, fork or preemption shows up as a wrong token."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from deepinfer.engine.sequence import EngineStateError, Sequence, SequenceStatus
from deepinfer.errors import ConfigError, InvalidInputError

BS = 4


def make(**overrides) -> Scheduler:
    options = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=32, block_size=BS)
    options.update(overrides)
    return Scheduler(SchedulerConfig(**options))


def run_step(sched: Scheduler, next_token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, {e.seq_id: [next_token] for e in out.scheduled if e.sample})
    return out


def steps_of(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(e.seq_id, e.start, e.num_new_tokens, e.sample) for e in out.scheduled]


# ---- configuration and admission -----------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ConfigError):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8, num_blocks=4)
    with pytest.raises(ConfigError):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, num_blocks=4,
                        num_lookahead_slots=-1)


def test_admission_rejects_what_can_never_fit():
    sched = make(num_blocks=4, max_model_len=32, enable_chunked_prefill=False, max_num_batched_tokens=8)
    with pytest.raises(InvalidInputError, match="whole cache"):
        sched.add(Sequence("a", [1] * 4, max_len=17))  # 5 blocks > 4
    with pytest.raises(InvalidInputError, match="max_model_len"):
        sched.add(Sequence("b", [1] * 33, max_len=34))
    with pytest.raises(InvalidInputError, match="chunked prefill"):
        sched.add(Sequence("c", [1] * 9, max_len=10))
    with pytest.raises(InvalidInputError, match="no room"):
        sched.add(Sequence("d", [1] * 8, max_len=8))
    sched.add(Sequence("ok", [1] * 8, max_len=16))  # exactly the whole cache
    with pytest.raises(InvalidInputError, match="already"):
        sched.add(Sequence("ok", [1], max_len=2))
    assert sched.num_waiting == 1 and not any(sched.get(i) for i in "abcd")


def test_finish_waiting_running_unknown_and_twice():
    sched = make()
    sched.add(Sequence("a", [1] * 5, max_len=20))
    sched.add(Sequence("b", [2] * 5, max_len=20))
    run_step(sched)
    sched.add(Sequence("c", [3] * 5, max_len=20))
    assert sched.finish("c", SequenceStatus.FINISHED_ABORTED) is True  # waiting
    assert sched.finish("a", SequenceStatus.FINISHED_STOPPED) is True  # running
    assert sched.finish("a", SequenceStatus.FINISHED_ABORTED) is False
    assert sched.finish("nope", SequenceStatus.FINISHED_ABORTED) is False
    with pytest.raises(InvalidInputError):
        sched.finish("b", SequenceStatus.RUNNING)
    assert sched.num_running == 1 and sched.num_waiting == 0
    assert sched.finish("b", SequenceStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished() and sched.block_manager.usage == 0


# ---- policy ---------------------------------------------------------------------------------------------


def test_chunked_prefill_slices_a_long_prompt():
    sched = make(max_num_batched_tokens=16)
    seq = Sequence("a", list(range(50)), max_len=60)
    sched.add(seq)
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        (entry,) = out.scheduled
        assert entry.token_ids == list(range(50))[entry.start: entry.start + entry.num_new_tokens]
        chunks.append((entry.start, entry.num_new_tokens, entry.sample))
        sched.update(out, {"a": [99]} if entry.sample else {})
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert seq.output_token_ids == (99,) and seq.num_computed_tokens == 50


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    sched = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add(Sequence("a", [1] * 10, max_len=20))
    sched.add(Sequence("b", [2] * 10, max_len=20))
    assert steps_of(run_step(sched)) == [("a", 0, 10, True)]
    assert steps_of(run_step(sched)) == [("a", 10, 1, True), ("b", 0, 10, True)]


def test_decodes_come_before_prefills_and_budget_is_shared():
    sched = make(max_num_batched_tokens=8)
    sched.add(Sequence("old", [1] * 3, max_len=40))
    run_step(sched)  # old now decodes
    sched.add(Sequence("new", [2] * 20, max_len=40))
    assert steps_of(run_step(sched)) == [("old", 3, 1, True), ("new", 0, 7, False)]
    assert steps_of(run_step(sched)) == [("old", 4, 1, True), ("new", 7, 7, False)]


def test_max_num_seqs_caps_each_step():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        sched.add(Sequence(f"s{i}", [i] * 3, max_len=10))
    out = run_step(sched)
    assert [e.seq_id for e in out.scheduled] == ["s0", "s1"]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_preemption_by_recompute_takes_the_youngest_to_the_front():
    # 4 blocks of 4: a (6 tokens) and b (6 tokens) use 2 blocks each; a's growth past 8 tokens needs a third.
    sched = make(num_blocks=4, max_num_batched_tokens=32, max_model_len=16, enable_prefix_caching=False)
    a, b = Sequence("a", [1] * 6, max_len=16), Sequence("b", [2] * 6, max_len=16)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    run_step(sched)
    run_step(sched)  # both at 9 tokens (8 computed), 4 blocks used
    sched.add(Sequence("c", [3] * 2, max_len=4))
    out = run_step(sched)
    assert out.preempted == ("b",)
    assert [e.seq_id for e in out.scheduled] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]
    assert b.output_token_ids == (7, 7, 7)  # kept: prompt + outputs are recomputed on re-admission
    assert sched.stats().num_preemptions == 1


def test_a_sequence_preempts_itself_rather_than_an_older_one():
    sched = make(num_blocks=4, max_num_batched_tokens=32, max_model_len=16, enable_prefix_caching=False)
    a, b = Sequence("a", [1] * 7, max_len=16), Sequence("b", [2] * 8, max_len=16)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 8 tokens / 2 blocks; b: 9 tokens, needs a third block for its decode
    out = run_step(sched)
    assert out.preempted == ("b",) and [e.seq_id for e in out.scheduled] == ["a"]


def test_lookahead_slots_are_reserved_up_to_max_len():
    sched = make(num_lookahead_slots=3)
    seq = Sequence("a", [1] * 5, max_len=12)
    sched.add(seq)
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_slots == 3 and len(seq.block_table) == 2  # 5 + 3 slots
    # Speculative decoding: two drafts accepted (their KV was written in lookahead slots) plus a bonus token.
    sched.update(out, {"a": [4]})
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 1 and out.scheduled[0].num_lookahead_slots == 3
    sched.update(out, {"a": [5, 6, 7]}, num_accepted_computed={"a": 2})
    assert seq.num_tokens == 9 and seq.num_computed_tokens == 8
    out = sched.schedule()
    entry = out.scheduled[0]
    assert (entry.start, entry.num_new_tokens, entry.num_lookahead_slots) == (8, 1, 3)
    assert len(seq.block_table) == 3  # 9 + 3 = 12 slots
    sched.update(out, {"a": [1, 2]}, num_accepted_computed={"a": 1})
    out = sched.schedule()
    assert out.scheduled[0].num_lookahead_slots == 1  # capped: 11 tokens + 1 slot = max_len 12
    with pytest.raises(EngineStateError):
        sched.update(out, {"a": [1, 2]})  # 13 > max_len


def test_update_rejects_stale_or_misdirected_results():
    sched = make()
    sched.add(Sequence("a", [1] * 20, max_len=30))
    out = sched.schedule()  # a 16-token chunk, no sample
    with pytest.raises(EngineStateError):
        sched.update(out, {"a": [1]})
    with pytest.raises(EngineStateError):
        sched.update(out, {"zzz": [1]})
    sched.update(out, {})
    with pytest.raises(EngineStateError, match="stale"):
        sched.update(out, {})


def test_update_skips_sequences_aborted_after_scheduling():
    sched = make()
    sched.add(Sequence("a", [1] * 5, max_len=30))
    out = sched.schedule()
    assert sched.finish("a", SequenceStatus.FINISHED_ABORTED)
    sched.update(out, {"a": [1]})
    assert sched.block_manager.usage == 0 and not sched.has_unfinished()


def test_prefix_cache_hits_for_a_shared_prefix():
    sched = make(max_num_batched_tokens=64, num_blocks=32)
    prefix = list(range(40))
    sched.add(Sequence("a", prefix + [1, 2, 3], max_len=50))
    run_step(sched)
    sched.add(Sequence("b", prefix + [4, 5], max_len=50))
    out = run_step(sched)
    entry = next(e for e in out.scheduled if e.seq_id == "b")
    assert (entry.start, entry.num_new_tokens) == (40, 2)
    stats = sched.stats()
    assert stats.prefix_cache_hits == 40 and stats.prefix_cache_queries == 43 + 42
    assert stats.num_prompt_tokens_computed == 43 + 2


def test_fork_shares_the_computed_prompt():
    sched = make(max_num_batched_tokens=64)
    sched.add(Sequence("p", list(range(10)), max_len=20))
    out = sched.schedule()
    sched.update(out, {"p": [50]})
    child = Sequence("p#1", list(range(10)), max_len=20, output_token_ids=[51])
    sched.fork("p", child)
    parent = sched.get("p")
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    assert [s.seq_id for s in sched.running] == ["p", "p#1"]
    out = sched.schedule()
    assert steps_of(out) == [("p", 10, 1, True), ("p#1", 8, 3, True)]
    with pytest.raises(InvalidInputError):
        sched.fork("nope", Sequence("x", [1], max_len=4))
    sched.block_manager.check_invariants()


# ---- simulated engine ----------------------------------------------------------------------------------

VOCAB = 50
MOD = (1 << 61) - 1


def mix(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 1) % MOD


def reference_generate(prompt: list[int], max_tokens: int, first: int | None = None) -> list[int]:
    """What the fake model produces for a request run alone (a forked branch's `first` token is forced)."""
    state, out = 0, []
    for t in prompt:
        state = mix(state, t)
    if first is not None:
        out.append(first)
        state = mix(state, first)
    while len(out) < max_tokens:
        out.append(state % VOCAB)
        state = mix(state, out[-1])
    return out


class FakeEngine:
    """Drives a Scheduler like the real engine: the fake model's state at position p is computed from the
    KV it reads at position p - 1 in the paged cache, so the cache must hold exactly the right prefixes."""

    def __init__(self, sched: Scheduler, rng: random.Random, draft_accuracy: float = 0.7, fork_rate: float = 0.25):
        self.sched, self.rng, self.draft_accuracy, self.fork_rate = sched, rng, draft_accuracy, fork_rate
        self.kv: dict[tuple[int, int], int] = {}
        self.max_tokens: dict[str, int] = {}
        self.finished: dict[str, Sequence] = {}
        self.forks: dict[str, tuple[list[int], int, int]] = {}  # branch id -> (prompt, max_tokens, first)
        self.fork_ids: set[str] = set()  # requests that branch (n = 2) after their first token
        self.steps = self.chunked_steps = 0

    def slot(self, seq: Sequence, p: int) -> tuple[int, int]:
        return seq.block_table[p // BS], p % BS

    def write(self, seq: Sequence, p: int, state: int) -> None:
        block, offset = self.slot(seq, p)
        bm = self.sched.block_manager
        assert bm._ref_counts[block] == 1 and bm._block_key[block] is None, f"{seq.seq_id} writes a shared block"
        self.kv[(block, offset)] = state

    def read(self, seq: Sequence, p: int) -> int:
        return self.kv[self.slot(seq, p)] if p >= 0 else 0

    def add(self, seq_id: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add(Sequence(seq_id, prompt, max_len=len(prompt) + max_tokens))
        self.max_tokens[seq_id] = max_tokens
        if max_tokens >= 2 and self.rng.random() < self.fork_rate:
            self.fork_ids.add(seq_id)

    def step(self) -> SchedulerOutput:
        sched = self.sched
        unfinished = [*sched.running, *sched.waiting]
        oldest = min(unfinished, key=lambda s: s.priority) if unfinished else None
        out = sched.schedule()
        self.steps += 1
        self.check_output(out, oldest)
        sampled, accepted = {}, {}
        for e in out.scheduled:
            seq, tokens = e.seq, e.token_ids
            self.chunked_steps += not e.sample
            state = self.read(seq, e.start - 1)
            for p, t in zip(range(e.start, e.seq_len), tokens):
                state = mix(state, t)
                self.write(seq, p, state)
            if not e.sample:
                continue
            # Every context position holds the right prefix state (not only the one the chain read).
            expected = 0
            for p, t in enumerate(seq.all_token_ids):
                expected = mix(expected, t)
                assert self.read(seq, p) == expected, f"{seq.seq_id}: wrong KV at position {p}"
            new = [state % VOCAB]
            room = seq.max_len - seq.num_tokens - 1
            # Speculative tokens: drafts go into the lookahead slots; accepted ones count as computed.
            for i in range(min(e.num_lookahead_slots, room)):
                draft = new[-1] if self.rng.random() < self.draft_accuracy else (new[-1] + 1) % VOCAB
                state = mix(state, draft)
                self.write(seq, e.seq_len + i, state)
                if draft != new[-1]:
                    break
                new.append(state % VOCAB)
            sampled[e.seq_id], accepted[e.seq_id] = new, len(new) - 1
        sched.update(out, sampled, num_accepted_computed=accepted)
        for e in out.scheduled:
            seq = e.seq
            if e.seq_id in self.fork_ids and e.sample and seq.num_output_tokens == len(sampled[e.seq_id]):
                # n = 2: a second branch from the same prompt, with a different first token.
                first, branch_id = (seq.output_token_ids[0] + 1) % VOCAB, e.seq_id + "#1"
                branch = Sequence(branch_id, list(seq.prompt_token_ids), max_len=seq.max_len, output_token_ids=[first])
                sched.fork(e.seq_id, branch)
                self.max_tokens[branch_id] = self.max_tokens[e.seq_id]
                self.forks[branch_id] = (list(seq.prompt_token_ids), self.max_tokens[e.seq_id], first)
        for e in out.scheduled:
            if e.sample and e.seq.num_output_tokens >= self.max_tokens[e.seq_id]:
                assert sched.finish(e.seq_id, SequenceStatus.FINISHED_LENGTH)
                self.finished[e.seq_id] = e.seq
        sched.block_manager.check_invariants()
        return out

    def check_output(self, out: SchedulerOutput, oldest: Sequence | None) -> None:
        cfg = self.sched.config
        ids = [e.seq_id for e in out.scheduled]
        assert len(ids) == len(set(ids)) <= cfg.max_num_seqs
        assert out.num_batched_tokens == sum(e.num_new_tokens for e in out.scheduled) <= cfg.max_num_batched_tokens
        for e in out.scheduled:
            assert e.seq.status is SequenceStatus.RUNNING and e.num_new_tokens >= 1
            assert e.seq_len <= e.seq.num_tokens and e.sample == (e.seq_len == e.seq.num_tokens)
            assert len(e.seq.block_table) * BS >= e.seq_len + e.num_lookahead_slots
        running, waiting = self.sched.running, self.sched.waiting
        for seq_id in out.preempted:
            victim = next(s for s in waiting if s.seq_id == seq_id)
            assert seq_id not in ids and victim.num_computed_tokens == 0 and victim.block_table == []
            assert all(r.priority < victim.priority for r in running), "an older sequence was preempted"
        assert [s.priority for s in running] == sorted(s.priority for s in running)
        assert [s.priority for s in waiting] == sorted(s.priority for s in waiting)
        if running and waiting:
            assert running[-1].priority < waiting[0].priority
        if oldest is not None and cfg.enable_chunked_prefill and cfg.max_num_batched_tokens > cfg.max_num_seqs:
            assert oldest.seq_id in ids, "the oldest unfinished sequence did not progress"

    def run(self, pending: list[tuple[str, list[int], int]], abort_at: int | None = None, max_steps: int = 20_000):
        aborted: set[str] = set()
        while pending or self.sched.has_unfinished():
            for _ in range(self.rng.randint(0, 3)):  # requests keep arriving while others run
                if pending:
                    self.add(*pending.pop(0))
            if self.steps == abort_at:
                live = sorted(s.seq_id for s in (*self.sched.running, *self.sched.waiting))
                for seq_id in self.rng.sample(live, len(live) // 2):
                    assert self.sched.finish(seq_id, SequenceStatus.FINISHED_ABORTED)
                    aborted.add(seq_id)
            self.step()
            assert self.steps < max_steps, "no progress"
        return aborted


def random_requests(rng: random.Random, n: int, max_model_len: int, shared_prefix: bool):
    bases = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
    requests = []
    for i in range(n):
        prompt_len = rng.randint(1, max_model_len - 1)
        if shared_prefix and rng.random() < 0.6:
            base = rng.choice(bases)
            cut = min(prompt_len, len(base))
            prompt = base[:cut] + [rng.randrange(VOCAB) for _ in range(prompt_len - cut)]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        requests.append((f"r{i}", prompt, rng.randint(1, max_model_len - prompt_len)))
    return requests


SIM_CASES = [
    # (chunked prefill, prefix caching, lookahead slots, max_num_batched_tokens)
    (True, True, 0, 16),
    (True, False, 0, 16),
    (False, True, 0, 40),
    (True, True, 2, 16),
    (False, False, 3, 40),
]


@pytest.mark.parametrize("chunked,caching,lookahead,budget", SIM_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_engine_finishes_every_request_exactly(chunked, caching, lookahead, budget, seed):
    rng = random.Random(seed)
    max_model_len = 40
    sched = make(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=max_model_len, num_blocks=12,
                 enable_chunked_prefill=chunked, enable_prefix_caching=caching, num_lookahead_slots=lookahead)
    requests = random_requests(rng, 64, max_model_len, shared_prefix=True)
    engine = FakeEngine(sched, rng)
    engine.run(list(requests))
    for seq_id, prompt, max_tokens in requests:
        seq = engine.finished[seq_id]
        assert seq.status is SequenceStatus.FINISHED_LENGTH
        assert list(seq.output_token_ids) == reference_generate(prompt, max_tokens), seq_id
    assert engine.forks
    for branch_id, (prompt, max_tokens, first) in engine.forks.items():
        assert list(engine.finished[branch_id].output_token_ids) == reference_generate(prompt, max_tokens, first)
    bm = sched.block_manager
    assert bm.usage == 0 and bm.num_free_blocks == bm.num_blocks and not bm._holders
    stats = sched.stats()
    assert stats.num_preemptions > 0  # the tiny cache forces recompute
    if chunked:
        assert engine.chunked_steps > 0
    if caching:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
    assert (stats.num_running, stats.num_waiting) == (0, 0)


@pytest.mark.parametrize("chunked", [True, False])
def test_simulated_engine_aborting_half_midway_frees_everything(chunked):
    rng = random.Random(7)
    sched = make(max_num_seqs=6, max_num_batched_tokens=40, max_model_len=40, num_blocks=12,
                 enable_chunked_prefill=chunked, num_lookahead_slots=1)
    requests = random_requests(rng, 64, 40, shared_prefix=True)
    engine = FakeEngine(sched, rng)
    aborted = engine.run(list(requests), abort_at=15)
    assert aborted
    for seq_id, prompt, max_tokens in requests:
        if seq_id not in aborted:
            assert list(engine.finished[seq_id].output_token_ids) == reference_generate(prompt, max_tokens)
    assert sched.block_manager.usage == 0 and sched.block_manager.num_free_blocks == 12
    assert not sched.has_unfinished()


def test_prefix_sharing_requests_hit_and_match_uncached_results():
    rng = random.Random(3)
    prefix = [rng.randrange(VOCAB) for _ in range(32)]
    requests = [(f"r{i}", prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))], 4) for i in range(8)]
    outputs = {}
    for caching in (True, False):
        sched = make(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=48, num_blocks=40,
                     enable_prefix_caching=caching)
        engine = FakeEngine(sched, rng, fork_rate=0.0)
        engine.run(list(requests))
        outputs[caching] = {k: v.output_token_ids for k, v in engine.finished.items()}
        if caching:
            assert sched.stats().prefix_cache_hits >= 6 * 32  # every later request reuses the prefix
    assert outputs[True] == outputs[False]
