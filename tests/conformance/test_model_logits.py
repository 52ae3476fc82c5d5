"""Whole-model conformance: every backend's DeepSeek-V3 log-probs and greedy tokens against the reference
backend on the same tiny random checkpoint (bf16 latent cache where the backend has no fp32 one)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

from tiny_checkpoints import build_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=21, gain=0.5)
    return save_checkpoint(hf, tmp_path_factory.mktemp("conformance-model"))


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0))[0]
    lps = torch.tensor([lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], prompt[1:])])
    return lps, out.outputs[0].token_ids


@pytest.mark.parametrize("precision", [None, "fp8"])
def test_model_matches_reference(backend_name, checkpoint, gen, precision):
    kv = "bf16"
    ref = LLM(str(checkpoint), backend="reference", dtype=torch.float32, kv_cache_dtype=kv, precision=precision, progress=False)
    dut = LLM(str(checkpoint), backend=backend_name, dtype=torch.float32, kv_cache_dtype=kv, precision=precision, progress=False)
    prompt = torch.randint(2, 96, (19,), generator=gen).tolist()
    want, want_tokens = _prompt_logprobs(ref, prompt)
    got, got_tokens = _prompt_logprobs(dut, prompt)
    if backend_name == "reference":
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert got_tokens == want_tokens
    elif precision is None:
        # Kernels round queries and probabilities to bf16 for the tensor cores, as FlashMLA does: a few 1e-3
        # of a log-prob on this model. Now and then that flips a near-tied expert choice of the random router
        # and one position moves by ~0.1; a broken kernel moves every position, by more than 1.
        diff = (got - want).abs()
        assert int((diff > 5e-2).sum()) <= 2 and float(diff.max()) < 1.0, diff
    else:
        # FP8 activation rounding amplifies those small differences: require them to stay within the noise
        # FP8 itself adds to the model (reference FP8 vs reference unquantised). As above, up to two positions
        # may move by a flipped expert (seen on the H200: one position by 0.42 lifted the mean past the noise).
        unquantised, _ = _prompt_logprobs(
            LLM(str(checkpoint), backend="reference", dtype=torch.float32, kv_cache_dtype=kv, progress=False), prompt)
        diff = (got - want).abs().sort().values
        assert diff[:-2].mean() <= (want - unquantised).abs().mean() and float(diff[-1]) < 1.0, diff


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=23, gain=0.5, max_position_embeddings=512)
    return save_checkpoint(hf, tmp_path_factory.mktemp("conformance-long"))


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_long_chunked_prefill_matches_reference(backend_name, long_checkpoint, gen, kv):
    """A 300-token prompt in 128-token chunks: backends with decompressed prefill run the first two chunks
    that way (the second over a cached prefix) and the last one absorbed; prompt log-probs and greedy
    tokens must agree with the reference backend, which stays absorbed throughout."""
    from deepinfer.registry import backend_class

    if kv not in backend_class(backend_name).CAPABILITIES.kv_cache_dtypes:
        pytest.skip(f"{backend_name} has no {kv} cache")
    common = dict(dtype=torch.float32, kv_cache_dtype=kv, progress=False, max_num_batched_tokens=128,
                  enable_prefix_caching=False)
    ref = LLM(str(long_checkpoint), backend="reference", **common)
    dut = LLM(str(long_checkpoint), backend=backend_name, **common)
    prompt = torch.randint(2, 96, (300,), generator=gen).tolist()
    want, want_tokens = _prompt_logprobs(ref, prompt)
    got, got_tokens = _prompt_logprobs(dut, prompt)
    diff = (got - want).abs()
    # As in test_model_logits: bf16 rounding inside the kernels, and now and then a flipped near-tied expert.
    assert float(diff.mean()) < 1e-2 and int((diff > 5e-2).sum()) <= 6 and float(diff.max()) < 1.0, diff
