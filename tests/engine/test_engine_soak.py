"""A random soak of the engine: fresh random engine configurations (block size, token budget, cache pressure,
prefix caching, chunked prefill, overlap, batch invariance, MTP or DSpark speculation) against fresh random
request mixes (shared prefixes, n > 1, greedy and seeded sampling, penalties, logit_bias, logprobs, prompt
logprobs, stop ids, min_tokens, requests arriving and aborted mid-run). The fixed-seed engine tests cover each
feature; this covers their combinations, where an n > 1 request with max_tokens 1 once failed the whole step.

What must hold in every run: no step raises; every request ends with one output per completion, of the
length its parameters allow, with one logprob entry per token (and per prompt token); every block is free
at the end; a greedy request yields the tokens it yields alone on a plain engine (exactly under batch
invariance; otherwise up to a float32 tie between the two tokens), and a seeded sampled one without
speculation or penalties does too.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sampling_params import SamplingParams

from engine_loop import reference_engine, run_to_completion
from tiny_checkpoints import build_hf_model, random_dspark, save_checkpoint

VOCAB = 96
TRIALS = 6
MAX_STEPS = 20_000  # a run needs hundreds to a few thousand: far more is a request the engine never finishes
TIE = 1e-4  # log-probability gap under which two tokens are a float32 tie (sums in another order may flip it)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    target = save_checkpoint(build_hf_model("deepseek_v3", seed=11, max_position_embeddings=512), root / "t", mtp=True)
    return target, random_dspark(target, root / "dspark")


def random_config(rng: random.Random, dspark) -> dict:
    block = rng.choice([16, 64])
    cfg = dict(block_size=block, max_num_seqs=rng.choice([2, 8, 32]), enable_prefix_caching=rng.random() < 0.6,
               enable_chunked_prefill=rng.random() < 0.8, overlap_scheduling=rng.random() < 0.5,
               batch_invariant=rng.random() < 0.3)
    cfg["max_num_batched_tokens"] = rng.choice([8, 16, 40, 96, 4096]) if cfg["enable_chunked_prefill"] else 512
    # Under pressure: 768 to 2560 cache tokens for up to 40 requests of up to ~250 tokens (preemption).
    cfg["cache_tokens"] = rng.choice([768, 1280, 2560]) if rng.random() < 0.5 else None
    mode = rng.random()
    if mode < 0.3:
        cfg.update(speculative_engine="mtp", num_speculative_tokens=rng.randint(1, 3))
    elif mode < 0.55:
        cfg.update(speculative_engine="dspark", dspark_model=str(dspark),
                   dspark_confidence_threshold=rng.choice([None, 0.0, 0.5]))
    return cfg


def random_params(rng: random.Random) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.8, n=rng.choice([1, 1, 2, 3]))
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), top_p=rng.choice([1.0, 0.8]), top_k=rng.choice([0, 5, 40]),
                  min_p=rng.choice([0.0, 0.05]), seed=rng.randrange(1 << 30) if rng.random() < 0.7 else None)
        if rng.random() < 0.3:
            kw.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.2:
        kw["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(2, VOCAB)]
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-100.0, -2.0, 1.5, 3.0, 100.0]) for _ in range(3)}
    return SamplingParams(**kw)


def random_requests(rng: random.Random) -> list[tuple[str, list[int], SamplingParams]]:
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.choice([10, 64, 100]))] for _ in range(3)]
    reqs = []
    for i in range(rng.randint(4, 40)):
        shared = rng.choice(prefixes) if rng.random() < 0.5 else []
        prompt = shared + [rng.randrange(2, VOCAB) for _ in range(rng.choice([1, 5, 30, 120]))]
        reqs.append((f"r{i}", prompt, random_params(rng)))
    return reqs


def drive(engine: LLMEngine, reqs, rng: random.Random) -> tuple[dict, set[str]]:
    """Half the requests at once, the rest arriving between steps; now and then one aborted."""
    later, final, aborted = list(reqs[len(reqs) // 2 :]), {}, set()
    for rid, prompt, params in reqs[: len(reqs) // 2]:
        engine.add_request(rid, prompt, params)
    for _ in range(MAX_STEPS):
        if not (engine.has_unfinished() or later):
            break
        if later and (rng.random() < 0.3 or not engine.has_unfinished()):
            engine.add_request(*later.pop(0))
        final.update((out.request_id, out) for out in engine.step() if out.finished)
        if rng.random() < 0.05:
            victim = rng.choice(reqs)[0]
            if victim not in final and (out := engine.abort(victim)) is not None:
                aborted.add(victim)
                final[victim] = out
    assert not engine.has_unfinished(), "the engine still holds requests after MAX_STEPS steps"
    return final, aborted


def alone(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    return run_to_completion(engine)[rid].outputs[0]


def check_like_alone(solo: LLMEngine, rid, prompt, params, got: list[int], exact: bool) -> None:
    want = alone(solo, rid, prompt, params)
    if got == want.token_ids or exact:
        assert got == want.token_ids, rid
        return
    k = next(i for i, (a, b) in enumerate(zip(got, want.token_ids)) if a != b)
    # A float32 tie at the first difference: the solo run's logprobs there (top 2) hold both tokens.
    tied = alone(solo, rid + "-lp", prompt, dataclasses.replace(params, logprobs=2))
    row = tied.logprobs[k]
    assert got[k] in row and abs(row[got[k]].logprob - row[want.token_ids[k]].logprob) < TIE, (rid, k)


def check_outputs(reqs, final, aborted, solo: LLMEngine, cfg: dict) -> None:
    assert set(final) == {rid for rid, _, _ in reqs}
    for rid, prompt, params in reqs:
        out = final[rid]
        if rid in aborted:
            continue
        assert len(out.outputs) == params.n, rid
        for c in out.outputs:
            n = len(c.token_ids)
            assert 1 <= n <= params.max_tokens, rid
            if params.ignore_eos and not params.stop_token_ids:
                assert n == params.max_tokens and c.finish_reason == "length", rid
            if params.logprobs is not None:
                assert len(c.logprobs) == n, rid
        if params.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(prompt), rid
        plain_sampling = (params.n == 1 and params.seed is not None and not cfg.get("speculative_engine")
                          and params.presence_penalty == 0 and params.repetition_penalty == 1.0)
        if params.temperature == 0.0 or (params.temperature > 0 and plain_sampling):
            check_like_alone(solo, rid, prompt, params, out.outputs[0].token_ids,
                             exact=cfg["batch_invariant"] and params.temperature == 0.0)


def test_random_configurations_and_request_mixes(models, gen):
    target, dspark = models
    probe = reference_engine(target, kv_cache_memory=1 << 24)
    token_bytes = probe.runner.spec.bytes_per_token * probe.model.num_cache_layers
    for _ in range(TRIALS):
        rng = random.Random(int(torch.randint(0, 2**62, (), generator=gen)))
        cfg = random_config(rng, dspark)
        cache_tokens = cfg.pop("cache_tokens")
        engine = reference_engine(target, kv_cache_memory=(cache_tokens or 1 << 14) * token_bytes, **cfg)
        cfg["cache_tokens"] = cache_tokens
        reqs = random_requests(rng)
        final, aborted = drive(engine, reqs, rng)
        stats = engine.stats()
        assert stats.free_blocks == stats.num_blocks and stats.running == stats.waiting == 0, cfg
        solo = reference_engine(target, kv_cache_memory=1 << 24, block_size=cfg["block_size"], load_mtp=False,
                           batch_invariant=cfg["batch_invariant"])
        check_outputs(reqs, final, aborted, solo, cfg)
