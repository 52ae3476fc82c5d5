"""`deepinfer train-dspark` end to end at toy scale (a tiny target with a real tokenizer, a folder of text):
the drafter learns, is calibrated, loads in the engine, and greedy decoding with it is unchanged."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deepinfer.spec.data import encode_files, resolve_files, split_files
from deepinfer.spec.train import DSparkTrainSettings
from deepinfer.spec.train_pipeline import default_target_layers

from spec_helpers import engine, run
from tiny_checkpoints import build_hf_model

TEXTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
]


@pytest.fixture(scope="module")
def target_with_tokenizer(tmp_path_factory):
    from deepinfer.train.tokenizer_train import save_tokenizer, train_tokenizer

    folder = tmp_path_factory.mktemp("toy-target") / "model"
    tok = train_tokenizer(TEXTS * 8, 300)
    hf = build_hf_model("deepseek_v3", seed=2, vocab_size=tok.get_vocab_size(), max_position_embeddings=256)
    hf.save_pretrained(folder)
    save_tokenizer(tok, folder, 256)
    data = folder.parent / "data"
    for i in range(12):
        (data / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (data / f"pkg{i % 3}" / f"m{i}.py").write_text(TEXTS[i % 3] * (2 + i % 4), encoding="utf-8")
    return folder, data


def test_data_split_and_defaults(target_with_tokenizer):
    folder, data = target_with_tokenizer
    files = resolve_files([str(data)], folder)
    a, b = split_files(files, 0.25, seed=1), split_files(files, 0.25, seed=1)
    assert a == b and not set(a.train) & set(a.calibration) and len(a.calibration) == 3
    assert encode_files(folder / "tokenizer.json", a.calibration).numel() > 50
    assert default_target_layers(3) == (0, 1, 2) and default_target_layers(61) == (0, 30, 60)
    w = DSparkTrainSettings().position_weights(5)
    assert torch.allclose(w, torch.exp(-torch.arange(5.0) / 4))


def test_train_dspark_command(target_with_tokenizer, tmp_path):
    from deepinfer.cli import main
    from deepinfer.engine.sampling_params import SamplingParams

    folder, data = target_with_tokenizer
    out = tmp_path / "dspark"
    assert main(["train-dspark", "--target", str(folder), "--data", str(data), "--out", str(out), "--steps", "40",
                 "--batch-size", "4", "--seq-len", "64", "--anchors", "8", "--block-size", "3", "--layers", "1",
                 "--markov-rank", "16", "--window", "48", "--pool-windows", "16", "--lr", "3e-3",
                 "--calib-fraction", "0.25", "--calib-prompts", "6", "--calib-tokens", "12", "--backend", "reference",
                 "--dtype", "float32"]) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    first, last = summary["history"][0], summary["history"][-1]
    assert last["loss"] < 0.9 * first["loss"] and last["tv"] < first["tv"] - 0.05  # it learns the target
    assert summary["command"].startswith("deepinfer train-dspark") and "--steps 40" in summary["command"]
    calib = json.loads((out / "calibration.json").read_text())
    assert len(calib["temperatures"]) == 3 and calib["fitted_on"]["drafts"] > 0
    assert "DSpark drafter" in (out / "README.md").read_text()
    weights = (out / "model.safetensors").read_bytes()
    assert main(["train-dspark", "--target", str(folder), "--data", str(data), "--out", str(out), "--calibrate-only",
                 "--calib-fraction", "0.25", "--calib-prompts", "4", "--calib-tokens", "10", "--backend", "reference",
                 "--dtype", "float32"]) == 0
    again = json.loads((out / "train_summary.json").read_text())
    assert (out / "model.safetensors").read_bytes() == weights and "--calibrate-only" in again["calibration_command"]
    assert again["history"] == summary["history"] and again["calibration"]["drafts"] > 0

    prompts = [[0, 5 + i, 9, 14] for i in range(4)]
    reqs = [(f"p{i}", p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for i, p in enumerate(prompts)]
    plain = run(engine(folder), reqs)
    spec = engine(folder, speculative_engine="dspark", dspark_model=str(out), dspark_confidence_threshold=0.2)
    assert spec.speculator.drafter.calibration is not None
    fast = run(spec, reqs)
    assert {k: v.outputs[0].token_ids for k, v in fast.items()} == {k: v.outputs[0].token_ids for k, v in plain.items()}


def test_token_cache_replays_the_split(target_with_tokenizer, tmp_path):
    """--token-cache: the first run encodes and stores the split; a later run (another machine, other files on
    disk) reads exactly those streams and file lists back."""
    from deepinfer.spec.train_pipeline import TrainDSparkOptions, _token_streams

    folder, data = target_with_tokenizer
    copy = tmp_path / "data"
    for f in data.rglob("*.py"):
        (copy / f.relative_to(data)).parent.mkdir(parents=True, exist_ok=True)
        (copy / f.relative_to(data)).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    cache = tmp_path / "tokens.pt"
    opts = TrainDSparkOptions(folder, [str(copy)], tmp_path / "out", calib_fraction=0.25, token_cache=cache)
    split, train, calib = _token_streams(opts, folder)
    expect = split_files(resolve_files([str(copy)], folder), 0.25, 0)
    assert split == expect and cache.exists()
    assert torch.equal(train, encode_files(folder / "tokenizer.json", expect.train))
    assert torch.equal(calib, encode_files(folder / "tokenizer.json", expect.calibration))
    for f in copy.rglob("*.py"):  # the data is gone: the cache alone answers
        f.unlink()
    split2, train2, calib2 = _token_streams(opts, folder)
    assert split2 == expect and torch.equal(train2, train) and torch.equal(calib2, calib)


def test_evaluate_reads_windows_when_the_runner_batch_is_larger(target_with_tokenizer):
    """The teacher-forced figures over fewer windows than the training runner's batch (a GPU run's batch of
    128 against 32 evaluation windows read none before): figures come from real windows, equal to those of a
    runner of exactly that batch."""
    from deepinfer.config import ModelConfig
    from deepinfer.model.loader import load_model
    from deepinfer.registry import load_backend
    from deepinfer.spec.dspark_model import DSparkConfig, DSparkModel
    from deepinfer.spec.train import TargetRunner, evaluate

    folder, data = target_with_tokenizer
    config = ModelConfig.from_hf_dir(folder)
    model = load_model(folder, load_backend("reference"), config=config, dtype=torch.float32, load_mtp=False,
                       progress=False)
    h = config.hidden_size
    cfg = DSparkConfig(h, config.vocab_size, (0,), h, num_layers=1, num_heads=2, head_dim=h // 2, markov_rank=8,
                       block_size=3, window=32)
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    drafter = DSparkModel(cfg, model.embed_tokens, model.lm_head.dequantize())
    stream = encode_files(folder / "tokenizer.json", resolve_files([str(data)], folder))
    settings = DSparkTrainSettings(batch_size=8, seq_len=32, anchors=4)
    n = min(3, stream.numel() // 32)
    big = evaluate(drafter, TargetRunner(model, 8, 32, (0,)), stream, settings, max_windows=n)
    exact = evaluate(drafter, TargetRunner(model, n, 32, (0,)), stream, settings, max_windows=n)
    assert all(x > 0 for x in big["accept"]) and all(0 < x < 1 for x in big["conf"])
    for k in big:
        assert big[k] == pytest.approx(exact[k], rel=1e-5)
