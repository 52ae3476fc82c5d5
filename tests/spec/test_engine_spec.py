"""Speculative decoding in the engine on a tiny random DeepSeek-V3 with an MTP layer (batch-invariant
reference backend, so non-speculative decoding is an exact reference): greedy outputs are identical to
non-speculative decoding for every drafter and prefix scheduler at batch sizes 1 to 32, also under cache
pressure (preemption, chunked prefill, prefix caching), with n > 1, stops, penalties and logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.spec.sps_profile import SPSCurve, SPSTable

from spec_helpers import RecordingDrafter, engine, run, scripted_speculator
from tiny_checkpoints import random_dspark

VOCAB = 96
SPS_TABLE = ((1, 0.010), (4, 0.011), (16, 0.014), (64, 0.030), (256, 0.100))


def make_requests(count: int, seed: int, max_tokens: int = 14, **params):
    rng = random.Random(seed)
    reqs = []
    for i in range(count):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.choice([1, 3, 9, 30, 70]))]
        reqs.append((f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)))
    return reqs


def tokens_of(final):
    return {rid: [c.token_ids for c in out.outputs] for rid, out in final.items()}


@pytest.fixture(scope="module")
def reference(mtp_checkpoint):
    reqs = make_requests(24, seed=1)
    final = run(engine(mtp_checkpoint, max_num_seqs=32), reqs)
    return reqs, tokens_of(final), {f"{rid}#0": list(p) + final[rid].outputs[0].token_ids for rid, p, _ in reqs}


@pytest.fixture(scope="module")
def dspark_dir(mtp_checkpoint, tmp_path_factory):
    return random_dspark(mtp_checkpoint, tmp_path_factory.mktemp("dspark") / "drafter")


DRAFTERS = {
    "mtp-1": dict(speculative_engine="mtp", num_speculative_tokens=1),
    "mtp-chained-4": dict(speculative_engine="mtp", num_speculative_tokens=4),
    "dspark-block": dict(speculative_engine="dspark", dspark_confidence_threshold=0.0),
    "dspark-threshold": dict(speculative_engine="dspark", dspark_confidence_threshold=0.3),
    "dspark-algorithm1": dict(speculative_engine="dspark", speculative_sps_table=SPS_TABLE),
}


@pytest.mark.parametrize("batch", [1, 7, 32])
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_identical_with_real_drafters(mtp_checkpoint, dspark_dir, reference, name, batch):
    reqs, expected, _ = reference
    opts = dict(DRAFTERS[name])
    if opts["speculative_engine"] == "dspark":
        opts["dspark_model"] = str(dspark_dir)
    eng = engine(mtp_checkpoint, max_num_seqs=batch, **opts)
    assert tokens_of(run(eng, reqs)) == expected
    stats = eng.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens <= stats.num_draft_tokens <= stats.num_proposed_tokens
    assert stats.draft_seconds > 0.0  # the drafter's passes are timed
    assert eng.stats().free_blocks == eng.stats().num_blocks


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("mode", ["fixed", "threshold", "hardware"])
def test_greedy_identical_with_high_acceptance(mtp_checkpoint, reference, mode, batch):
    """A drafter that is right 70% of the time: many drafts accepted at every position, KV of accepted drafts
    kept from the lookahead slots."""
    reqs, expected, continuations = reference
    kw = {"threshold": dict(threshold=0.25), "hardware": dict(curve=SPSCurve(SPS_TABLE))}.get(mode, {})
    spec = scripted_speculator(continuations, 4, VOCAB, mode, **kw)
    eng = engine(mtp_checkpoint, spec, max_num_seqs=batch)
    assert tokens_of(run(eng, reqs)) == expected
    stats = eng.stats().spec_decode
    if mode == "fixed":
        assert stats.mean_accepted_length > 1.8 and all(a > 0 for a in stats.accepted_per_position)
    else:  # cut by the (random) confidences: fewer verified tokens, still several accepted per draft
        assert stats.mean_accepted_length > 1.3 and stats.num_draft_tokens < stats.num_proposed_tokens


def test_greedy_identical_under_cache_pressure(mtp_checkpoint, reference):
    """A 10-block cache for 24 requests (preemption and recomputation), a 48-token budget (chunked prefill),
    shared prompt prefixes (prefix-cache hits), MTP chained drafts."""
    reqs, _, _ = reference
    shared = [5, 6, 7] * 30
    reqs = [(rid, shared + p, params) for rid, p, params in reqs[:12]] + reqs[12:]
    expected = tokens_of(run(engine(mtp_checkpoint, max_num_seqs=32), reqs))
    probe = engine(mtp_checkpoint)
    spec = probe.runner.spec
    block = spec.bytes_per_token * spec.block_size * probe.model.num_cache_layers
    for opts in (dict(speculative_engine="mtp", num_speculative_tokens=3),):
        eng = engine(mtp_checkpoint, kv_cache_memory=10 * block, max_num_batched_tokens=48, max_num_seqs=16, **opts)
        assert tokens_of(run(eng, reqs)) == expected
        stats = eng.stats()
        assert stats.preemptions > 0 and stats.prefix_cache_hits > 0 and stats.free_blocks == stats.num_blocks
        eng.scheduler.block_manager.check_invariants()


def test_n_stops_penalties_and_logprobs(mtp_checkpoint, reference):
    _, _, continuations = reference
    rng = random.Random(3)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.choice([2, 20]))]
        params = SamplingParams(max_tokens=rng.choice([5, 17]), temperature=0.0, ignore_eos=False,
                                min_tokens=rng.choice([0, 3]), repetition_penalty=rng.choice([1.0, 1.3]),
                                frequency_penalty=rng.choice([0.0, 0.5]), stop_token_ids=[rng.randrange(2, VOCAB)],
                                logprobs=2, n=rng.choice([1, 2]))
        reqs.append((f"s{i}", prompt, params))
    plain = run(engine(mtp_checkpoint), reqs)
    # The scripted drafter proposes the known non-speculative continuations (completion 0) with noise.
    cont = {f"{rid}#{j}": list(p) + plain[rid].outputs[j].token_ids for rid, p, _ in reqs
            for j in range(len(plain[rid].outputs))}
    spec_run = run(engine(mtp_checkpoint, scripted_speculator(cont, 4, VOCAB)), reqs)
    for rid, _, _ in reqs:
        for a, b in zip(plain[rid].outputs, spec_run[rid].outputs):
            assert (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason)
            assert [{t: round(l.logprob, 4) for t, l in lp.items()} for lp in a.logprobs] == \
                   [{t: round(l.logprob, 4) for t, l in lp.items()} for lp in b.logprobs]
    del continuations


def test_sampled_requests_are_reproducible_and_batch_independent(mtp_checkpoint, reference):
    reqs, _, continuations = reference
    sampled = [(rid, p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True))
               for i, (rid, p, _) in enumerate(reqs)]
    outs = [tokens_of(run(engine(mtp_checkpoint, scripted_speculator(continuations, 4, VOCAB), max_num_seqs=b), sampled))
            for b in (1, 32, 32)]
    assert outs[0] == outs[1] == outs[2]
    plain = tokens_of(run(engine(mtp_checkpoint), sampled))
    assert plain != outs[0]  # same distribution, different draws: speculation is not a no-op


def test_per_request_opt_out_and_draft_cap(mtp_checkpoint, reference):
    reqs, expected, continuations = reference
    eng = engine(mtp_checkpoint, scripted_speculator(continuations, 4, VOCAB))
    off = [(rid, p, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, dspark_speculation=False))
           for rid, p, _ in reqs[:4]]
    assert tokens_of(run(eng, off)) == {rid: expected[rid] for rid, _, _ in off}
    assert eng.stats().spec_decode.num_drafts == 0
    capped = [(rid, p, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, max_draft_tokens=1))
              for rid, p, _ in reqs[:4]]
    assert tokens_of(run(eng, capped)) == {rid: expected[rid] for rid, _, _ in capped}
    stats = eng.stats().spec_decode
    assert stats.num_drafts > 0 and stats.verified_per_position[1:] == (0, 0, 0)


def test_mtp_drafts_are_the_mtp_modules_own_predictions(mtp_checkpoint, reference):
    """Drafting incrementally (cache entries written by observe, chained steps) gives the first draft token the
    MTP module predicts when run over the whole final sequence at once."""
    from deepinfer.train.trainer import forward_logits, prefill_plan

    reqs, expected, continuations = reference
    eng = engine(mtp_checkpoint, speculative_engine="mtp", num_speculative_tokens=2, max_num_seqs=8)
    eng.speculator.drafter = RecordingDrafter(eng.speculator.drafter)
    run(eng, reqs[:8])
    checked = 0
    for rid, _, _ in reqs[:8]:
        seq = continuations[f"{rid}#0"]
        plan = prefill_plan(eng.backend, eng.config, 1, len(seq) - 2)
        _, mtp_logits = forward_logits(eng.model, eng.backend, plan, torch.tensor([seq]))
        for req, proposal in eng.speculator.drafter.log:
            if req.seq_id == f"{rid}#0" and proposal.tokens:
                assert proposal.tokens[0] == int(mtp_logits[req.position - 1].argmax())
                checked += 1
    assert checked > 20


def test_dspark_drafts_match_the_offline_block_computation(mtp_checkpoint, dspark_dir, reference):
    """The engine's incremental DSpark state (context keys/values per sequence, sliding window, padding in a
    batch) drafts what one offline pass over the final sequence gives."""
    from deepinfer.model.context import ForwardContext
    from deepinfer.train.trainer import prefill_plan

    reqs, _, continuations = reference
    eng = engine(mtp_checkpoint, speculative_engine="dspark", dspark_model=str(dspark_dir),
                 dspark_confidence_threshold=0.0, max_num_seqs=8)
    eng.speculator.drafter = RecordingDrafter(eng.speculator.drafter)
    run(eng, reqs[:8])
    m = eng.speculator.drafter.inner.model
    checked = 0
    for rid, _, _ in reqs[:8]:
        seq = continuations[f"{rid}#0"]
        plan = prefill_plan(eng.backend, eng.config, 1, len(seq))
        caches = tuple(eng.backend.allocate_kv_cache(plan.spec) for _ in range(eng.model.num_cache_layers))
        with torch.no_grad():
            _, captured = eng.model.forward_capture(torch.tensor(seq), ForwardContext(plan, caches), m.cfg.target_layers)
            kv = m.context_kv(m.context_features(torch.cat(captured, -1))[None], torch.arange(len(seq))[None])
            for req, proposal in eng.speculator.drafter.log:
                if req.seq_id != f"{rid}#0" or not proposal.tokens:
                    continue
                p = req.position
                t = torch.arange(len(seq))
                mask = ((t < p) & (t >= p - m.cfg.window))[None, None]
                h, base = m.backbone(torch.tensor([[seq[p]]]), torch.tensor([[p]]), kv, mask)
                prev = seq[p]
                for k, token in enumerate(proposal.tokens):
                    e = m.markov(torch.tensor(prev))
                    assert int((base[0, 0, k] + m.transition(e)).argmax()) == token
                    assert float(m.confidence(h[0, 0, k], e)) == pytest.approx(proposal.confidence[k], abs=1e-4)
                    prev = token
                checked += 1
    assert checked > 20


def test_configuration_errors(mtp_checkpoint, tmp_path):
    with pytest.raises(ConfigError):
        engine(mtp_checkpoint, speculative_engine="dspark", dspark_model=str(tmp_path / "missing"))
    with pytest.raises(ConfigError):
        engine(mtp_checkpoint, dspark_confidence_threshold=0.5)
    with pytest.raises(ConfigError):
        engine(mtp_checkpoint, speculative_engine="mtp", load_mtp=False)


def test_sps_curve_is_profiled_at_start_and_cached(mtp_checkpoint, dspark_dir, reference, tmp_path):
    reqs, expected, _ = reference
    opts = dict(speculative_engine="dspark", dspark_model=str(dspark_dir), speculative_sps_cache=str(tmp_path),
                batch_invariant=False, max_num_batched_tokens=64, max_num_seqs=8)
    first = engine(mtp_checkpoint, **opts)
    curve = first.speculator.scheduler.curve
    assert isinstance(curve, SPSTable) and len(list(tmp_path.iterdir())) == 1
    # one row per sequence count up to max_num_seqs, each over R .. R (1 + k) tokens (k = 4 here)
    assert [(r, [b for b, _ in c.points]) for r, c in curve.rows] == [(r, [r * (1 + j) for j in range(5)]) for r in (1, 2, 4, 8)]
    second = engine(mtp_checkpoint, **opts)
    assert second.speculator.scheduler.curve == curve  # read back, not measured again
    out = tokens_of(run(second, reqs[:6]))
    assert all(len(v[0]) == 14 for v in out.values())


def test_dspark_with_forks(mtp_checkpoint, dspark_dir, reference):
    """n > 1: completions fork from the prompt and the child inherits the parent's drafter context."""
    reqs, _, _ = reference
    greedy = [(rid, p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)) for rid, p, _ in reqs[:6]]
    sampled = [(rid + "s", p, SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, n=3))
               for rid, p, _ in reqs[:6]]
    plain = tokens_of(run(engine(mtp_checkpoint), greedy))
    eng = engine(mtp_checkpoint, speculative_engine="dspark", dspark_model=str(dspark_dir), dspark_confidence_threshold=0.0)
    for rid, prompt, params in greedy + sampled:
        eng.add_request(rid, prompt, params)
    final, inherited = {}, set()
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        inherited |= {k for k, c in eng.speculator.drafter._ctx.items() if not k.endswith("#0") and c.lo == 0}
    out = tokens_of(final)
    assert len(inherited) == 6 * 1 + 6 * 2  # every child starts with its parent's context from position 0
    assert {k: v for k, v in out.items() if k in plain} == plain
    assert all(len(out[rid + "s"]) == 3 and all(len(c) == 10 for c in out[rid + "s"]) for rid, _, _ in reqs[:6])
    assert not eng.speculator.drafter._ctx  # every sequence's state was released


@pytest.mark.parametrize("drafter", ["mtp-1", "dspark-block"])
def test_forks_when_the_prompt_ends_in_a_one_token_chunk(mtp_checkpoint, dspark_dir, reference, drafter):
    """A prompt one token longer than the token budget ends in a one-token chunk, which may carry drafts: its
    n > 1 completions still fork there (they hung, never forked, before) and equal non-speculative decoding."""
    reqs, _, _ = reference
    budget = 16
    prompt = list(reqs[0][1] * 20)[:budget] + [5]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)
    plain = tokens_of(run(engine(mtp_checkpoint, max_num_batched_tokens=budget), [("a", prompt, params)]))
    options = dict(DRAFTERS[drafter], max_num_batched_tokens=budget)
    if options["speculative_engine"] == "dspark":
        options["dspark_model"] = str(dspark_dir)
    eng = engine(mtp_checkpoint, **options)
    eng.add_request("a", prompt, params)
    final = {}
    for _ in range(200):  # a bound instead of a hang
        final.update((o.request_id, o) for o in eng.step() if o.finished)
        if not eng.has_unfinished():
            break
    assert tokens_of(final) == plain and [len(c) for c in plain["a"]] == [10, 10]


def test_out_of_memory_while_drafting_fails_the_step_only(mtp_checkpoint, reference, monkeypatch):
    """Drafting runs forwards too: out of device memory there ends that step's requests with an error, as
    in the target forward, and the engine serves on with the same greedy tokens."""
    reqs, expected, continuations = reference
    spec = scripted_speculator(continuations, 4, VOCAB)
    eng = engine(mtp_checkpoint, spec, max_num_seqs=4)
    real, calls = spec.propose, []

    def propose(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(spec, "propose", propose)
    rid, prompt, params = reqs[0]
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].error is not None and "out of memory" in outs[-1].error and outs[-1].finished
    assert eng.stats().free_blocks == eng.stats().num_blocks
    assert tokens_of(run(eng, reqs[1:4])) == {r: expected[r] for r, _, _ in reqs[1:4]}

