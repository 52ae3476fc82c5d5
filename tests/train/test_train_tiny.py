"""The train-tiny pieces at toy scale: corpus split, tokenizer, gradients through the latent cache (against
transformers), aux-loss-free bias updates, export, and the whole command end to end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepinfer.config import ModelConfig
from deepinfer.model.checkpoint import Checkpoint, expected_tensors
from deepinfer.text import DEEPSEEK_V3_SPECIAL_TOKENS
from deepinfer.train.corpus import build_corpus, read_heldout_list, write_heldout_list
from deepinfer.train.export import write_checkpoint
from deepinfer.train.model_init import hf_config, trainable
from deepinfer.train.tokenizer_train import encode_documents, train_tokenizer
from deepinfer.train.trainer import Trainer, TrainSettings, forward_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=2, num_key_value_heads=2)


def toy_config(vocab: int = 256) -> tuple[dict, ModelConfig]:
    hf = hf_config(vocab, **TOY)
    return hf, ModelConfig.from_hf_dict(hf)


def fake_stdlib(root: Path) -> Path:
    for rel in ("a.py", "pkg/b.py", "pkg/c.py", "d.py", "e.py", "site-packages/x.py", "pkg/__pycache__/y.py"):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"def f_{rel.replace('/', '_').replace('.', '_')}():\n    return 1\n")
    (root / "latin1.py").write_bytes(b"# \xe9\n")  # not UTF-8: skipped
    return root


def test_corpus_split_is_deterministic_and_excludes_third_party(tmp_path):
    root = fake_stdlib(tmp_path / "lib")
    a = build_corpus(seed=3, heldout_fraction=0.4, root=root)
    b = build_corpus(seed=3, heldout_fraction=0.4, root=root)
    assert a == b
    assert set(a.train) | set(a.heldout) == {"a.py", "pkg/b.py", "pkg/c.py", "d.py", "e.py"}
    assert not set(a.train) & set(a.heldout) and len(a.heldout) == 2
    write_heldout_list(a, tmp_path)
    assert read_heldout_list(tmp_path) == list(a.heldout)


def test_tokenizer_has_deepseek_special_tokens_first():
    texts = ["def add(a, b):\n    return a + b\n"] * 50
    tok = train_tokenizer(texts, 300)
    for i, token in enumerate(DEEPSEEK_V3_SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i
    doc = encode_documents(tok, texts[:1])[0]
    assert doc[0] == 0 and doc[-1] == 1 and tok.decode(doc) == texts[0]


def _spread(trainer: Trainer, seed: int) -> None:
    """Decisive routing and non-trivial norms, so both implementations pick the same experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.params.items():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.mul_(5)


def test_gradients_through_the_latent_cache_match_transformers(tmp_path):
    """write_cache assigns into the cache and run_attention reads it back: autograd must carry gradients through
    both. Every main-model gradient must equal transformers' for the same weights and tokens."""
    from transformers import DeepseekV3ForCausalLM

    hf_cfg, config = toy_config()
    trainer = Trainer(config, TrainSettings(batch_size=2, seq_len=24), "cpu")
    _spread(trainer, seed=5)
    write_checkpoint(tmp_path, hf_cfg, trainer.params, fp8=False, dtype=torch.float32)
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(2, 256, (2, 26), generator=torch.Generator().manual_seed(6))
    t = 24
    logits, _ = forward_logits(trainer.model(), trainer.backend, trainer.plan, tokens)
    F.cross_entropy(logits, tokens[:, 1 : t + 1].reshape(-1)).backward()
    hf_logits = hf(tokens[:, :t]).logits.reshape(-1, 256)
    F.cross_entropy(hf_logits, tokens[:, 1 : t + 1].reshape(-1)).backward()

    hp = dict(hf.named_parameters())
    inter = config.moe_intermediate_size
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    checked = 0
    for name, p in trainable(trainer.params).items():
        if name.startswith(mtp_prefix):
            assert p.grad is None or torch.count_nonzero(p.grad) == 0  # main loss only: MTP untouched
            continue
        if ".experts." in name:  # transformers stacks experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            prefix, rest = name.split(".experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            if proj == "down_proj":
                want = hp[f"{prefix}.experts.down_proj"].grad[e]
            else:
                gate_up = hp[f"{prefix}.experts.gate_up_proj"].grad[e]
                want = gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]
        else:
            want = hp[name].grad
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-4 * want.abs().max().item() + 1e-8, msg=name)
        checked += 1
    assert checked > 30
    assert torch.count_nonzero(trainer.params["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].grad) > 0


def test_step_trains_main_and_mtp_and_balances_experts():
    _, config = toy_config()
    trainer = Trainer(config, TrainSettings(batch_size=2, seq_len=32, warmup_steps=1), "cpu")
    stream = torch.arange(5000) % 23
    first = trainer.step(stream)
    loads = [load.clone() for load in trainer.backend.ops.loads]
    biases = {n: b.clone() for n, b in trainer.correction_biases().items()}
    assert len(loads) == len(biases) == 3  # MoE layers 1, 2 and the MTP layer 3
    for load, (name, bias) in zip(loads, sorted(biases.items())):
        # One step from zero: overloaded experts moved down by gamma, underloaded up.
        expected = trainer.settings.bias_gamma * torch.sign(load.float().mean() - load.float())
        torch.testing.assert_close(bias, expected)
    for _ in range(15):
        last = trainer.step(stream)
    assert last["main"] < first["main"] - 0.5 and last["mtp"] < first["mtp"] - 0.5
    assert trainer.params["model.layers.3.eh_proj.weight"].grad is not None  # the MTP layer trains


def test_time_budget_calibration_times_real_steps():
    from deepinfer.train.trainer import seconds_per_step

    _, config = toy_config()
    per_step = seconds_per_step(config, TrainSettings(batch_size=1, seq_len=16), "cpu", torch.arange(2000) % 11, steps=5)
    assert 0 < per_step < 60


def test_export_writes_every_tensor_deepinfer_loads(tmp_path):
    hf_cfg, config = toy_config()
    trainer = Trainer(config, TrainSettings(batch_size=1, seq_len=16), "cpu")
    write_checkpoint(tmp_path, hf_cfg, trainer.params)
    loaded = ModelConfig.from_hf_dir(tmp_path)
    assert loaded.is_fp8_checkpoint and loaded.num_nextn_predict_layers == 1
    report = Checkpoint(tmp_path).validate(expected_tensors(loaded, include_mtp=True))
    assert report.has_mtp and report.is_fp8


def test_cli_parses_train_tiny():
    from deepinfer.cli import build_parser

    args = build_parser().parse_args(["train-tiny", "--out", "x", "--device", "cpu", "--steps", "5", "--seed", "2"])
    assert args.command == "train-tiny" and args.steps == 5 and args.seed == 2 and args.out == Path("x")


@pytest.mark.slow
def test_train_tiny_end_to_end_at_toy_scale(tmp_path):
    from deepinfer.text import Tokenizer
    from deepinfer.train.pipeline import TrainTinyOptions, run_train_tiny

    opts = TrainTinyOptions(out=tmp_path / "tiny", steps=4, batch_size=2, seq_len=32, vocab_size=512, max_files=12,
                            eval_tokens=256, model_overrides=TOY)
    summary = run_train_tiny(opts, log=lambda _: None)
    folder = tmp_path / "tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "heldout_files.txt"} <= {p.name for p in folder.iterdir()}
    assert summary["command"].startswith("deepinfer train-tiny --out tiny --device cpu --steps 4 --seed 0")
    assert len(summary["completions"]) == 4
    Tokenizer.from_folder(folder)
