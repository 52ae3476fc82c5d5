"""FP8 checkpoints (kept FP8, or made FP8 at load) and the model's user-facing errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.errors import CheckpointError, ConfigError, InvalidInputError
from deepinfer.weights import WeightFormat

from test_parity import full_logprobs, random_prompt
from tiny_checkpoints import build_hf_model, save_checkpoint, write_dequantized_copy, write_fp8_copy

# Dimensions of 128 and up so the 128x128 blocks and per-128-channel activation groups are exercised whole.
FP8_SHAPE = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128,
                 num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 num_hidden_layers=2)


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    hf = build_hf_model("deepseek_v3", seed=7, gain=1.0, **FP8_SHAPE)
    bf = save_checkpoint(hf, root / "float")
    fp8 = write_fp8_copy(bf, root / "fp8")
    deq = write_dequantized_copy(fp8, root / "dequantized")
    return bf, fp8, deq


def _formats(llm: LLM) -> set[WeightFormat]:
    attn = llm.model.layers[1].self_attn
    return {attn.q_b_proj.format, attn.o_proj.format, llm.model.layers[1].mlp.experts.down.format}


def test_fp8_checkpoint_stays_fp8_and_matches_dequantized(fp8_checkpoints, gen):
    _, fp8, deq = fp8_checkpoints
    llm8 = LLM(str(fp8), backend="reference", dtype=torch.float32)
    assert _formats(llm8) == {WeightFormat.FP8_BLOCK}
    ref = LLM(str(deq), backend="reference", dtype=torch.float32)
    assert _formats(ref) == {WeightFormat.DENSE}
    prompt = random_prompt(gen, 96, 32)
    a, b = full_logprobs(llm8, prompt), full_logprobs(ref, prompt)
    # Only the per-token FP8 activation quantisation differs: ~2.5% relative error per projection here,
    # compounded over the layers. An expert choice that flips at a few positions moves those positions' rows
    # far, so the bound is on the median position (over 400 prompts: at most 0.022 of the spread) and the mean
    # only catches gross errors. The sharp check of where each block scale lands is the next test.
    spread = b.max(-1).values - b.min(-1).values
    per_position = (a - b).abs().mean(-1) / spread
    assert per_position.median() < 0.03
    assert per_position.mean() < 0.08


def test_precision_fp8_on_float_checkpoint_agrees_with_fp8_checkpoint(fp8_checkpoints, gen):
    bf, fp8, _ = fp8_checkpoints
    quantized_at_load = LLM(str(bf), backend="reference", dtype=torch.float32, precision="fp8")
    assert _formats(quantized_at_load) == {WeightFormat.FP8_BLOCK}
    stored = LLM(str(fp8), backend="reference", dtype=torch.float32)
    prompt = random_prompt(gen, 96, 16)
    torch.testing.assert_close(full_logprobs(quantized_at_load, prompt), full_logprobs(stored, prompt), rtol=0, atol=1e-4)


def test_fp8_checkpoint_dequantized_with_bf16_precision(fp8_checkpoints, gen):
    _, fp8, deq = fp8_checkpoints
    llm = LLM(str(fp8), backend="reference", dtype=torch.float32, precision="bf16")
    assert _formats(llm) == {WeightFormat.DENSE}
    ref = LLM(str(deq), backend="reference", dtype=torch.float32)
    prompt = random_prompt(gen, 96, 16)
    torch.testing.assert_close(full_logprobs(llm, prompt), full_logprobs(ref, prompt), rtol=0, atol=1e-4)


def test_fp4_precision_loads_and_generates(fp8_checkpoints, gen):
    bf, _, _ = fp8_checkpoints
    llm = LLM(str(bf), backend="reference", dtype=torch.float32, precision="fp4")
    assert _formats(llm) == {WeightFormat.NVFP4}
    out = llm.generate([random_prompt(gen, 96, 5)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=3)
    return save_checkpoint(hf, tmp_path_factory.mktemp("small"))


def _copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_missing_shard(small_checkpoint, tmp_path):
    path = _copy(small_checkpoint, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(str(path), backend="reference")


def test_truncated_shard(small_checkpoint, tmp_path):
    path = _copy(small_checkpoint, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(path), backend="reference")


def test_wrong_shape(small_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(small_checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.randn(64, 63)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight"):
        LLM(str(path), backend="reference")


def test_unsupported_model_type(small_checkpoint, tmp_path):
    path = _copy(small_checkpoint, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="llama"):
        LLM(str(path), backend="reference")


def test_prompt_errors(small_checkpoint):
    llm = LLM(str(small_checkpoint), backend="reference", dtype=torch.float32, max_model_len=32)
    with pytest.raises(InvalidInputError, match="max_model_len"):
        llm.generate([list(range(2, 40))], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidInputError, match="tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidInputError, match="vocabulary"):
        llm.generate([[5, 10_000]], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidInputError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    for bad in (None, 7, b"\x05\x06", torch.tensor([5, 6])):  # neither a string nor a list of ids
        with pytest.raises(InvalidInputError, match="a prompt must be a string or a list of token ids"):
            llm.generate([[5, 6], bad], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidInputError, match="list of integers"):
        llm.generate([[5, 6.0]], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidInputError, match="max_model_len"):
        LLM(str(small_checkpoint), backend="reference", max_model_len=10_000)
    # Generation stops at max_model_len.
    out = llm.generate([list(range(2, 30))], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
