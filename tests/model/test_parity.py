"""DeepInfer's DeepSeek V2/V3 against transformers' models on tiny random checkpoints made in the test."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.attention import AttentionBatch
from deepinfer.engine.runner import ModelRunner
from deepinfer.quant import cdiv

from tiny_checkpoints import build_hf_model, save_checkpoint

V3_CASES = {
    "v3-qlora-groups": dict(),
    "v3-no-qlora-yarn": dict(
        q_lora_rank=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    "v3-odd-dims": dict(
        hidden_size=72, intermediate_size=88, moe_intermediate_size=24, num_attention_heads=3, num_key_value_heads=3,
        q_lora_rank=40, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10,
        n_routed_experts=12, num_experts_per_tok=3, n_group=4, topk_group=2, vocab_size=101,
    ),
    "v3-moe-freq-2": dict(num_hidden_layers=4, moe_layer_freq=2, first_k_dense_replace=1),
    "v3-not-interleaved": dict(rope_interleave=False, norm_topk_prob=False),
}
V2_CASES = {
    "v2-greedy": dict(),
    "v2-group-limited": dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0,
                             q_lora_rank=40),
}
CASES = [("deepseek_v3", k, v) for k, v in V3_CASES.items()] + [("deepseek_v2", k, v) for k, v in V2_CASES.items()]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Lazily built (hf_model, path) per case, shared by the tests of this module."""
    cache = {}

    def get(model_type: str, name: str, overrides: dict, mtp: bool = False):
        key = (name, mtp)
        if key not in cache:
            model = build_hf_model(model_type, seed=len(cache) + 1, **overrides)
            path = save_checkpoint(model, tmp_path_factory.mktemp(name), mtp=mtp)
            cache[key] = (model, path)
        return cache[key]

    return get


def full_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Log-softmax of DeepInfer's logits at every position of `ids`, from one full-sequence forward."""
    spec = ModelRunner.cache_spec(llm.model, cdiv(len(ids), 64), 64, llm.kv_cache_dtype)
    runner = ModelRunner(llm.model, llm.backend, spec)
    batch = AttentionBatch((len(ids),), (len(ids),), (tuple(range(spec.num_blocks)),))
    return runner.execute(batch, ids, list(range(len(ids)))).logits.log_softmax(-1).cpu()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def random_prompt(gen: torch.Generator, vocab: int, length: int) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=gen).tolist()


@pytest.mark.parametrize("model_type,name,overrides", CASES, ids=[c[1] for c in CASES])
def test_logprobs_and_greedy_match_transformers(checkpoints, gen, model_type, name, overrides):
    hf, path = checkpoints(model_type, name, overrides)
    llm = LLM(str(path), backend="reference", dtype=torch.float32)
    vocab = hf.config.vocab_size
    prompt = random_prompt(gen, vocab, 21)

    want = hf_logprobs(hf, prompt)
    got = full_logprobs(llm, prompt)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    # Prompt log-probs through the public API agree with transformers' log-softmax.
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        lp = out.prompt_logprobs[i][prompt[i]].logprob
        assert abs(lp - float(want[i - 1, prompt[i]])) < 1e-4

    # 32-token greedy continuations are identical.
    with torch.no_grad():
        hf_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    ours = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == hf_ids
    assert ours.outputs[0].finish_reason == "length"


def test_prompt_logprobs_in_slices_and_chunks(checkpoints, gen, monkeypatch):
    """Prompt log-probs are computed a slice of rows at a time (bounded memory) over prefill chunks: every
    position still matches transformers' log-softmax."""
    from deepinfer.engine import llm_engine

    hf, path = checkpoints("deepseek_v3", "v3-qlora-groups", V3_CASES["v3-qlora-groups"])
    monkeypatch.setattr(llm_engine, "PROMPT_LOGITS_ROWS", 3)
    llm = LLM(str(path), backend="reference", dtype=torch.float32, max_num_batched_tokens=8)
    prompt = random_prompt(gen, hf.config.vocab_size, 30)
    want = hf_logprobs(hf, prompt)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - float(want[i - 1, prompt[i]])) < 1e-4
    # Requests asking for different top-N share a slice: each gets its own N, ranked by transformers' order.
    other = random_prompt(gen, hf.config.vocab_size, 12)
    outs = llm.generate([prompt, other], [SamplingParams(max_tokens=1, prompt_logprobs=n) for n in (1, 4)])
    for o, ids, n in zip(outs, (prompt, other), (1, 4)):
        ref = hf_logprobs(hf, ids)
        for i in range(1, len(ids)):
            entry = o.prompt_logprobs[i]
            values, top = torch.topk(ref[i - 1], n + 1)
            if (values[:-1] - values[1:]).min() < 1e-4:  # a near-tie: either order is right
                continue
            top = top[:n].tolist()
            assert set(entry) == {ids[i], *top} and all(entry[t].rank == r for r, t in enumerate(top, start=1))


def test_token_by_token_decode_matches_full_forward(checkpoints, gen):
    hf, path = checkpoints("deepseek_v3", "v3-qlora-groups", V3_CASES["v3-qlora-groups"])
    llm = LLM(str(path), backend="reference", dtype=torch.float32)
    ids = random_prompt(gen, hf.config.vocab_size, 70)  # crosses a 64-token block boundary
    want = full_logprobs(llm, ids)

    spec = ModelRunner.cache_spec(llm.model, 4, 64, llm.kv_cache_dtype)
    runner = ModelRunner(llm.model, llm.backend, spec)
    table = (2, 0)  # non-contiguous blocks
    prefix = 5
    rows = [runner.execute(AttentionBatch((prefix,), (prefix,), (table,)), ids[:prefix], list(range(prefix))).logits]
    for t in range(prefix, len(ids)):
        rows.append(runner.execute(AttentionBatch((1,), (t + 1,), (table,)), [ids[t]], [0]).logits)
    got = torch.cat(rows).log_softmax(-1).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_batched_prompts_match_each_alone(checkpoints, gen):
    hf, path = checkpoints("deepseek_v2", "v2-greedy", V2_CASES["v2-greedy"])
    llm = LLM(str(path), backend="reference", dtype=torch.float32)
    prompts = [random_prompt(gen, hf.config.vocab_size, n) for n in (3, 17, 66, 1)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=1)
    together = llm.generate(prompts, params)
    for prompt, joint in zip(prompts, together):
        alone = llm.generate([prompt], params)[0]
        assert joint.outputs[0].token_ids == alone.outputs[0].token_ids
        for a, b in zip(joint.prompt_logprobs[1:], alone.prompt_logprobs[1:]):
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
        for a, b in zip(joint.outputs[0].logprobs, alone.outputs[0].logprobs):
            for tok in a:
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-4


def test_mtp_layer_loads_and_drafts(checkpoints, gen):
    hf, path = checkpoints("deepseek_v3", "v3-qlora-groups", V3_CASES["v3-qlora-groups"], mtp=True)
    llm = LLM(str(path), backend="reference", dtype=torch.float32)
    assert len(llm.model.mtp) == 1
    # The main model is unaffected by the extra layer.
    prompt = random_prompt(gen, hf.config.vocab_size, 9)
    torch.testing.assert_close(full_logprobs(llm, prompt), hf_logprobs(hf, prompt), rtol=0, atol=1e-4)
    without = LLM(str(path), backend="reference", dtype=torch.float32, load_mtp=False)
    assert without.model.mtp == []
