"""The engine end to end on a tiny random DeepSeek-V3: continuous batching under cache pressure, preemption,
chunked prefill, prefix caching, n > 1, aborts, stop conditions and batch invariance."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.errors import InvalidInputError
from deepinfer.models import embedded_model_path

from engine_loop import reference_engine, run_to_completion
from tiny_checkpoints import build_hf_model, save_checkpoint

VOCAB = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=11, max_position_embeddings=512)
    return save_checkpoint(hf, tmp_path_factory.mktemp("engine-model"))


def run_all(engine: LLMEngine) -> dict[str, object]:
    return run_to_completion(engine)


def random_requests(rng: random.Random, count: int):
    reqs = []
    for i in range(count):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.choice([1, 5, 30, 70, 130]))]
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.7, 1.0, 1.3]),
                                    top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]), seed=rng.randrange(1 << 30),
                                    ignore_eos=True)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def block_bytes(engine: LLMEngine) -> int:
    spec = engine.runner.spec
    return spec.bytes_per_token * spec.block_size * engine.model.num_cache_layers


def test_many_requests_under_cache_pressure(checkpoint):
    rng = random.Random(1234)
    reqs = random_requests(rng, 64)
    probe = reference_engine(checkpoint, kv_cache_memory=1 << 24)
    # A cache of 12 blocks (768 tokens) for 64 requests: forces preemption; a small token budget forces
    # chunked prefill of the long prompts.
    engine = reference_engine(checkpoint, kv_cache_memory=12 * block_bytes(probe), max_num_batched_tokens=96, max_num_seqs=16)
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    first = run_all(engine)
    stats = engine.stats()
    assert stats.preemptions > 0
    assert stats.free_blocks == stats.num_blocks

    # Greedy requests equal the same request run alone; seeded sampled requests repeat exactly.
    alone = reference_engine(checkpoint, kv_cache_memory=1 << 24)
    for rid, prompt, params in reqs:
        if params.temperature == 0.0 or rid in ("r1", "r3", "r5"):
            alone.add_request(rid, prompt, params)
            solo = run_all(alone)[rid]
            assert solo.outputs[0].token_ids == first[rid].outputs[0].token_ids, rid
        assert len(first[rid].outputs[0].token_ids) == params.max_tokens
    again = reference_engine(checkpoint, kv_cache_memory=12 * block_bytes(probe), max_num_batched_tokens=96, max_num_seqs=16)
    for rid, prompt, params in reqs:
        again.add_request(rid, prompt, params)
    second = run_all(again)
    for rid, _, _ in reqs:
        assert second[rid].outputs[0].token_ids == first[rid].outputs[0].token_ids, rid


def test_abort_half_midway_frees_every_block(checkpoint):
    rng = random.Random(99)
    reqs = random_requests(rng, 32)
    engine = reference_engine(checkpoint, kv_cache_memory=1 << 22, max_num_batched_tokens=64, max_num_seqs=8)
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    done = set()
    for _ in range(6):
        done |= {out.request_id for out in engine.step() if out.finished}
    aborted = set()
    for rid, _, _ in reqs[::2]:
        out = engine.abort(rid)
        if rid in done:
            assert out is None  # already finished: nothing to abort
        else:
            assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
            aborted.add(rid)
    assert len(aborted) > 8
    assert engine.abort(next(iter(aborted))) is None  # already gone
    final = run_all(engine)
    assert set(final) == {rid for rid, _, _ in reqs} - aborted - done
    stats = engine.stats()
    assert stats.free_blocks == stats.num_blocks and stats.running == stats.waiting == 0


def test_prefix_cache_hits_and_same_tokens(checkpoint):
    rng = random.Random(5)
    prefix = [rng.randrange(2, VOCAB) for _ in range(200)]
    prompts = [prefix + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(enable: bool):
        engine = reference_engine(checkpoint, kv_cache_memory=1 << 24, enable_prefix_caching=enable)
        outs = []
        for i, p in enumerate(prompts):  # one after another, so later ones find the prefix cached
            engine.add_request(f"p{i}", p, params)
            outs.append(run_all(engine)[f"p{i}"].outputs[0].token_ids)
        return outs, engine.stats()

    cached, stats = run(True)
    plain, plain_stats = run(False)
    assert cached == plain
    assert stats.prefix_cache_hit_rate > 0.5 and plain_stats.prefix_cache_hit_rate == 0


def test_n_completions_share_the_prompt(checkpoint):
    llm = LLM(str(checkpoint), backend="reference", dtype=torch.float32, progress=False)
    prompt = list(range(2, 90))
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([prompt], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    stats = llm.engine.stats()
    assert stats.free_blocks == stats.num_blocks


def test_n_completions_whose_first_token_is_their_last(checkpoint):
    """n > 1 where the first token already ends every completion (max_tokens 1, or a prompt one token short of
    max_model_len): the other completions finish with their token, beside a request that goes on."""
    llm = LLM(str(checkpoint), backend="reference", dtype=torch.float32, progress=False)
    rng = random.Random(5)
    full = [rng.randrange(2, VOCAB) for _ in range(llm.engine.max_model_len - 1)]
    outs = llm.generate([[5, 6, 7], full, [8, 9]],
                        [SamplingParams(n=3, max_tokens=1, temperature=1.0, seed=1, logprobs=1, ignore_eos=True),
                         SamplingParams(n=2, max_tokens=None, temperature=1.0, seed=2, ignore_eos=True),
                         SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    for out, n in zip(outs[:2], (3, 2)):
        assert len(out.outputs) == n
        assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in out.outputs)
    assert all(len(c.logprobs) == 1 for c in outs[0].outputs)
    assert len(outs[2].outputs[0].token_ids) == 6
    stats = llm.engine.stats()
    assert stats.free_blocks == stats.num_blocks and stats.running == stats.waiting == 0


def test_stop_conditions_and_min_tokens(checkpoint):
    llm = LLM(str(checkpoint), backend="reference", dtype=torch.float32, progress=False)
    prompt = [5, 6, 7, 8]
    free = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    stop_at = free[5]
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True))[0].outputs[0]
    first = free.index(stop_at)
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    delayed = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at],
                                                    min_tokens=first + 2, ignore_eos=True))[0].outputs[0]
    assert stop_at not in delayed.token_ids[: first + 2]
    with pytest.raises(InvalidInputError, match="tokenizer"):
        llm.generate([prompt], SamplingParams(max_tokens=3, stop=["x"]))


def test_min_tokens_holds_back_stop_strings():
    """As vLLM: before min_tokens a stop string ends nothing (nor does EOS or a stop id); a token after it
    matches only a string ending in its own text. On the embedded model, whose folder has a tokenizer."""
    llm = LLM(str(embedded_model_path()), backend="reference", dtype=torch.float32, progress=False)
    tok = llm.engine.tokenizer
    greedy = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    free = llm.generate(["def fibonacci(n):"], SamplingParams(**greedy))[0].outputs[0].token_ids
    texts = [tok.decode(free[: i + 1]) for i in range(len(free))]
    # The first token whose new text is a string not seen before it: the stop string.
    i, stop = next((i, t[len(p):]) for i, (p, t) in enumerate(zip(texts, texts[1:]), 1)
                   if t[len(p):].strip() and t[len(p):] not in p)
    cut = llm.generate(["def fibonacci(n):"], SamplingParams(**greedy, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.token_ids == free[: i + 1] and cut.text == texts[i - 1]
    for min_tokens in (i + 1, i + 3):  # the stop string's token is the min_tokens-th, or well inside them
        held = llm.generate(["def fibonacci(n):"], SamplingParams(**greedy, stop=[stop], min_tokens=min_tokens))
        out = held[0].outputs[0]
        assert len(out.token_ids) > min_tokens and out.token_ids[: i + 2] == free[: i + 2]
        assert out.text.startswith(texts[i])


def test_penalties_change_distribution(checkpoint):
    llm = LLM(str(checkpoint), backend="reference", dtype=torch.float32, progress=False)
    prompt = [9] * 20
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    penal = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                  repetition_penalty=2.0, frequency_penalty=2.0))[0].outputs[0].token_ids
    assert len(set(penal)) >= len(set(plain))


@pytest.mark.parametrize("overlap", [True, False])
def test_logit_bias_forces_and_bans_tokens(checkpoint, overlap):
    """+100 makes a token the greedy pick at every step, beside an unbiased request in the same batches; -100
    on each token the unbiased run picks keeps it out; a token id outside the vocabulary is refused."""
    engine = reference_engine(checkpoint, kv_cache_memory=1 << 24, overlap_scheduling=overlap)
    prompt = [5, 6, 7, 8]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("plain", prompt, SamplingParams(**greedy))
    plain = run_all(engine)["plain"].outputs[0].token_ids
    never = next(t for t in range(2, VOCAB) if t not in plain)
    engine.add_request("again", prompt, SamplingParams(**greedy))
    engine.add_request("forced", prompt, SamplingParams(**greedy, logit_bias={never: 100.0}))
    out = run_all(engine)
    assert out["forced"].outputs[0].token_ids == [never] * 8 and out["again"].outputs[0].token_ids == plain
    engine.add_request("banned", prompt, SamplingParams(**greedy, logit_bias={t: -100.0 for t in set(plain)}))
    assert not set(run_all(engine)["banned"].outputs[0].token_ids) & set(plain)
    with pytest.raises(InvalidInputError, match="logit_bias token id 96"):
        engine.add_request("bad", prompt, SamplingParams(**greedy, logit_bias={VOCAB: 1.0}))


def test_request_that_can_never_fit_is_rejected(checkpoint):
    probe = reference_engine(checkpoint, kv_cache_memory=1 << 24)
    engine = reference_engine(checkpoint, kv_cache_memory=2 * block_bytes(probe))
    with pytest.raises(InvalidInputError):
        engine.add_request("big", list(range(2, 90)) * 2, SamplingParams(max_tokens=10))
    engine.add_request("ok", [3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    assert run_all(engine)["ok"].outputs[0].finish_reason in ("length", "stop")


@pytest.mark.slow
def test_batch_invariant_mode_bit_identical(checkpoint):
    rng = random.Random(77)
    target = ("target", [rng.randrange(2, VOCAB) for _ in range(90)],
              SamplingParams(max_tokens=12, temperature=0.8, seed=42, logprobs=3, ignore_eos=True))

    def run(others: int):
        engine = reference_engine(checkpoint, kv_cache_memory=1 << 24, batch_invariant=True, max_num_batched_tokens=64)
        engine.add_request(*target)
        for rid, prompt, params in random_requests(random.Random(others), others):
            engine.add_request(rid, prompt, params)
        return run_all(engine)["target"].outputs[0]

    alone = run(0)
    for others in (1, 7, 32):
        mixed = run(others)
        assert mixed.token_ids == alone.token_ids
        for a, b in zip(mixed.logprobs, alone.logprobs):
            assert {k: v.logprob for k, v in a.items()} == {k: v.logprob for k, v in b.items()}


def test_overlapped_scheduling_changes_nothing_but_timing(checkpoint):
    """Overlapped scheduling (next step launched before this one's tokens are on the host) against fully
    synchronous steps: same tokens, logprobs and finish reasons under preemption, chunked prefill, prefix
    caching, stop tokens, and what a deferred step handles on the device (penalties and min_tokens counting
    the token in flight, logprobs), with n > 1 requests forcing some steps to be synchronous."""
    rng = random.Random(4321)
    reqs = random_requests(rng, 40)
    for i, (rid, prompt, params) in enumerate(reqs):
        if i % 4 == 1:
            params.stop_token_ids = [rng.randrange(2, VOCAB) for _ in range(3)]
            params.ignore_eos = False
        elif i % 4 == 2:  # stop ids that min_tokens holds back for the first tokens
            params.stop_token_ids = sorted(torch.topk(torch.rand(VOCAB), 30).indices.tolist())
            params.ignore_eos, params.min_tokens = False, min(params.max_tokens, 4)
        if i % 7 == 3:  # penalties count the token still in flight, on the device
            params.presence_penalty, params.frequency_penalty, params.repetition_penalty = 0.5, 0.3, 1.3
        if i >= 34:  # forks make their first step synchronous: both kinds of step, and switches
            params.n, params.seed = 2, params.seed or 7
        if i % 6 == 5:
            params.logprobs = i % 4  # 1 or 3: top-n of each size, and the chosen token's entry

    def run(overlap: bool):
        probe = reference_engine(checkpoint, kv_cache_memory=1 << 24)
        engine = reference_engine(checkpoint, kv_cache_memory=14 * block_bytes(probe), max_num_batched_tokens=96,
                             max_num_seqs=12, overlap_scheduling=overlap)
        deferred = []
        for rid, prompt, params in reqs:
            engine.add_request(rid, prompt, params)
        final = run_to_completion(engine, lambda: deferred.append(engine._inflight is not None))
        stats = engine.stats()
        assert stats.free_blocks == stats.num_blocks
        return final, sum(deferred), stats.preemptions

    overlapped, deferred, preemptions = run(True)
    synchronous, none_deferred, _ = run(False)
    assert deferred > 10 and none_deferred == 0 and preemptions > 0
    assert set(overlapped) == set(synchronous) == {rid for rid, _, _ in reqs}
    for rid in overlapped:
        for a, b in zip(overlapped[rid].outputs, synchronous[rid].outputs, strict=True):
            assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason), rid
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:  # computed for a whole step at once, or row by row: equal to float noise
                assert [sorted(p) for p in a.logprobs] == [sorted(p) for p in b.logprobs], rid
                for pa, pb in zip(a.logprobs, b.logprobs):
                    for tok, lp in pa.items():
                        assert lp.rank == pb[tok].rank and abs(lp.logprob - pb[tok].logprob) < 1e-5, rid


def test_outputs_are_snapshots(checkpoint):
    """Each step's RequestOutput keeps the tokens it had (later steps append to the engine's lists, not to
    it), and a consumer changing its output's lists (prompt_token_ids is one list shared by a request's
    outputs) changes nothing the engine computes."""
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    clean = reference_engine(checkpoint, kv_cache_memory=1 << 24)
    clean.add_request("a", prompt, params)
    expected = run_all(clean)["a"].outputs[0].token_ids

    engine = reference_engine(checkpoint, kv_cache_memory=1 << 24)
    engine.add_request("a", list(prompt), params)
    seen = []
    while engine.has_unfinished():
        for out in engine.step():
            seen.append((out, list(out.outputs[0].token_ids), list(out.outputs[0].delta_token_ids)))
            out.prompt_token_ids.append(0)  # a consumer scribbling on its output
            out.outputs[0].token_ids.append(0)
    assert seen[-1][1] == expected
    for out, tokens, delta in seen:
        assert out.outputs[0].token_ids == tokens + [0] and out.outputs[0].delta_token_ids == delta
    assert sum((delta for _, _, delta in seen), []) == expected
