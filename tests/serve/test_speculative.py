"""The server with speculative decoding: --speculative-engine mtp / dspark, per-request controls, the
x-deepinfer-speculation header, and vLLM-like spec_decode series on /metrics."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from conftest import start_server


@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoint, tmp_path_factory):
    from tiny_checkpoints import add_mtp_layer

    folder = tmp_path_factory.mktemp("scripted-mtp") / "model"
    shutil.copytree(checkpoint, folder)
    add_mtp_layer(folder, seed=4)
    return folder


@pytest.fixture(scope="module")
def dspark_folder(mtp_checkpoint, tmp_path_factory):
    from deepinfer.config import ModelConfig
    from deepinfer.spec.dspark_model import DSparkConfig, DSparkModel, save_dspark

    cfg = ModelConfig.from_hf_dir(mtp_checkpoint)
    dcfg = DSparkConfig(target_hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, target_layers=(1,),
                        hidden_size=cfg.hidden_size, num_layers=1, num_heads=2, head_dim=cfg.hidden_size // 2,
                        intermediate_size=64, markov_rank=8, block_size=3, window=32)
    torch.manual_seed(0)
    model = DSparkModel(dcfg, torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size))
    folder = tmp_path_factory.mktemp("drafter") / "dspark"
    save_dspark(folder, model)
    return folder


def completion(url: str, **body) -> httpx.Response:
    body = {"model": "tiny-v3", "prompt": "Hello world", "max_tokens": 12, "temperature": 0, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_speculative_servers_match_the_plain_one(server, mtp_checkpoint, dspark_folder):
    plain = completion(server.url).json()["choices"][0]["text"]
    runs = [("mtp", dict(speculative_engine="mtp", num_speculative_tokens=2)),
            ("dspark", dict(speculative_engine="dspark", dspark_model=str(dspark_folder),
                            dspark_confidence_threshold=0.0))]
    for name, options in runs:
        running = start_server(mtp_checkpoint, **options)
        try:
            r = completion(running.url, max_draft_tokens=2)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
            assert r.headers["x-deepinfer-speculation"] == name
            off = completion(running.url, dspark_speculation=False)
            assert off.headers["x-deepinfer-speculation"] == "off" and off.json()["choices"][0]["text"] == plain
            assert "x-deepinfer-speculation" not in completion(running.url).headers
            metrics = httpx.get(running.url + "/metrics", timeout=30).text
            assert "deepinfer_spec_decode_num_drafts_total" in metrics
            assert "deepinfer_spec_decode_draft_seconds_total" in metrics
            assert 'deepinfer_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics
            assert running.engine.stats().spec_decode.num_drafts > 0
        finally:
            running.stop()
