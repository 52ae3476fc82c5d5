"""The DSpark drafter shipped with the embedded model: it loads from the model's dspark/ folder, is calibrated,
drafts useful tokens, and greedy decoding with it equals plain decoding (batch-invariant backend)."""

from __future__ import annotations

import json

import pytest

from deepinfer.models import embedded_model_path

DRAFTER = embedded_model_path() / "dspark"
pytestmark = pytest.mark.skipif(not (DRAFTER / "config.json").exists(), reason="no DSpark drafter shipped yet")

PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n"]


def test_shipped_drafter_is_calibrated_and_lossless():
    from deepinfer import LLM, SamplingParams

    config = json.loads((DRAFTER / "config.json").read_text())
    calibration = json.loads((DRAFTER / "calibration.json").read_text())
    assert len(calibration["temperatures"]) == config["block_size"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(batch_invariant=True, kv_cache_memory=32 << 20, max_num_seqs=4, progress=False)
    plain = LLM(embedded_model_path(), **common).generate(PROMPTS, params)
    spec = LLM(embedded_model_path(), speculative_engine="dspark", dspark_confidence_threshold=0.0, **common)
    fast = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.stats().spec_decode.mean_accepted_length > 1.5
