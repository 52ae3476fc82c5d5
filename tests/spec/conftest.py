"""Shared pieces of the speculative decoding tests: tiny random DeepSeek-V3 targets with an MTP layer."""

from __future__ import annotations

import pytest
import torch

from tiny_checkpoints import build_hf_model, save_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory):
    """A tiny random DeepSeek-V3 (vocab 96, 3 layers) with one MTP layer."""
    hf = build_hf_model("deepseek_v3", seed=11, max_position_embeddings=512)
    return save_checkpoint(hf, tmp_path_factory.mktemp("spec-target"), mtp=True)
