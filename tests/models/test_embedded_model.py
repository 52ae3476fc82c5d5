"""The embedded model shipped in deepinfer.models: its format (transformers loads it and agrees with DeepInfer),
its tokenizer and chat template, its held-out file list and its size."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from deepinfer.attention import AttentionBatch
from deepinfer.backends.reference import ReferenceBackend
from deepinfer.config import ModelConfig
from deepinfer.engine.runner import ModelRunner
from deepinfer.model.checkpoint import Checkpoint, expected_tensors
from deepinfer.model.loader import load_model
from deepinfer.models import EMBEDDED_MODEL_PATH, embedded_model_path
from deepinfer.quant import cdiv
from deepinfer.text import DEEPSEEK_V3_CHAT_TEMPLATE, DEEPSEEK_V3_SPECIAL_TOKENS, Tokenizer
from deepinfer.train.corpus import read_heldout_list

from tiny_checkpoints import write_dequantized_copy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL = embedded_model_path()
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
MAX_BYTES = 20 * 1000 * 1000


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_hf_dir(MODEL)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(MODEL)


@pytest.fixture(scope="module")
def float_copy(tmp_path_factory) -> Path:
    """The shipped FP8 checkpoint dequantised to float32 (transformers loads DeepSeek FP8 only on GPUs)."""
    return write_dequantized_copy(MODEL, tmp_path_factory.mktemp("embedded_float"))


def deepinfer_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    """Log-softmax of DeepInfer's logits at every position, float32 activations, one prefill."""
    backend = ReferenceBackend()
    model = load_model(path, backend, dtype=torch.float32, progress=False)
    spec = ModelRunner.cache_spec(model, cdiv(len(ids), 64), 64, "fp32")
    runner = ModelRunner(model, backend, spec)
    batch = AttentionBatch((len(ids),), (len(ids),), (tuple(range(spec.num_blocks)),))
    return runner.execute(batch, ids, list(range(len(ids)))).logits.log_softmax(-1)


def test_embedded_path_is_the_package_folder():
    assert EMBEDDED_MODEL_PATH == MODEL
    assert MODEL.is_dir() and MODEL.parent.name == "models"


def test_folder_holds_the_hf_layout_within_20_mb():
    names = {p.name for p in MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "heldout_files.txt"} <= names
    total = sum(p.stat().st_size for p in MODEL.iterdir() if p.is_file())
    assert total <= MAX_BYTES, f"{total} bytes on disk"


def test_config_is_deepseek_v3_with_mtp(config):
    c = config
    assert c.model_type == "deepseek_v3" and c.num_nextn_predict_layers == 1
    assert c.q_lora_rank is not None
    assert c.first_k_dense_replace == 1 and c.num_hidden_layers >= 2 and c.n_routed_experts
    assert c.topk_method == "noaux_tc" and c.scoring_func == "sigmoid"
    assert c.n_group > 1 and c.topk_group < c.n_group
    assert c.n_shared_experts == 1
    assert 4000 <= c.vocab_size <= 8192
    assert c.is_fp8_checkpoint


def test_checkpoint_has_every_tensor_with_mtp_and_fp8(config):
    report = Checkpoint(MODEL).validate(expected_tensors(config, include_mtp=True))
    assert report.has_mtp and report.is_fp8
    mtp = f"model.layers.{config.num_hidden_layers}"
    ckpt = Checkpoint(MODEL)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                 "self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"{mtp}.{name}" in ckpt
    # DeepSeek keeps embeddings, heads and norms in high precision and the router in fp32.
    assert ckpt.dtype("model.embed_tokens.weight") == torch.bfloat16
    assert ckpt.dtype("lm_head.weight") == torch.bfloat16
    assert ckpt.dtype("model.layers.1.mlp.gate.weight") == torch.float32
    assert ckpt.dtype("model.layers.1.self_attn.o_proj.weight") == torch.float8_e4m3fn
    assert torch.count_nonzero(ckpt.get("model.layers.1.mlp.gate.e_score_correction_bias")) > 0  # bias was trained


def test_transformers_loads_it_and_logits_agree(float_copy, tokenizer):
    from transformers import DeepseekV3ForCausalLM

    ids = tokenizer.encode(PROMPT)
    hf = DeepseekV3ForCausalLM.from_pretrained(float_copy, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    got = deepinfer_logprobs(float_copy, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    # The prompt's own tokens: what prompt_logprobs would report.
    positions = torch.arange(len(ids) - 1)
    target = torch.tensor(ids[1:])
    torch.testing.assert_close(got[positions, target], want[positions, target], rtol=0, atol=1e-3)


def test_fp8_model_stays_close_to_its_dequantised_weights(float_copy, tokenizer):
    """DeepInfer on the FP8 folder (weights kept FP8, activations quantised per 128 channels) vs the float copy."""
    ids = tokenizer.encode(PROMPT)
    exact = deepinfer_logprobs(float_copy, ids)
    fp8 = deepinfer_logprobs(MODEL, ids)
    target = torch.tensor(ids[1:])
    rows = torch.arange(len(ids) - 1)
    assert (fp8[rows, target] - exact[rows, target]).abs().mean() < 0.1  # 0.037 when shipped
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


TYPICAL = '''import os
import sys


def main(argv=None):
    """Run the command line interface."""
    if argv is None:
        argv = sys.argv[1:]
    for name in argv:
        if os.path.isdir(name):
            print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def test_model_learned_python(tokenizer):
    """A trained model, not a random one: stdlib-style code costs far less than uniform guessing (log V ~ 8.7
    nats per token; the shipped model scores about 2 on this snippet and 2.9 on the held-out files)."""
    ids = tokenizer.encode(TYPICAL)
    got = deepinfer_logprobs(MODEL, ids)
    target = torch.tensor(ids[1:])
    mean_nll = -got[torch.arange(len(ids) - 1), target].mean().item()
    assert mean_nll < 0.4 * math.log(tokenizer.vocab_size)
    assert (got[:-1].argmax(-1) == target).float().mean() > 0.3


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    for i, token in enumerate(DEEPSEEK_V3_SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i
        assert tokenizer.encode(token, add_special_tokens=False) == [i]
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1
    ids = tokenizer.encode(PROMPT)
    assert ids[0] == 0 and tokenizer.decode(ids[1:]) == PROMPT
    config = json.loads((MODEL / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == DEEPSEEK_V3_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "fibonacci?"}],
        add_generation_prompt=True,
    )
    assert text == "<｜begin▁of▁sentence｜>Write Python.<｜User｜>fibonacci?<｜Assistant｜>"


def test_heldout_files_are_listed_and_figures_recorded():
    heldout = read_heldout_list(MODEL)
    assert heldout and len(set(heldout)) == len(heldout) == len(sorted(heldout))
    assert all(p.endswith(".py") and not p.startswith("/") for p in heldout)
    readme = (MODEL / "README.md").read_text(encoding="utf-8")
    assert "## Held-out figures" in readme and "perplexity" in readme and "MTP" in readme
    assert "def fibonacci(n):" in readme
    summary = json.loads((MODEL / "train_summary.json").read_text(encoding="utf-8"))
    assert summary["heldout_files"] == len(heldout)
    assert summary["eval_exported"]["perplexity"] > 1


def test_deepinfer_loads_the_mtp_layer(config, tokenizer):
    model = load_model(MODEL, ReferenceBackend(), dtype=torch.float32, progress=False)
    assert len(model.mtp) == 1 and len(model.layers) == config.num_hidden_layers
