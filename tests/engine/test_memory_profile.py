"""Start-up memory profile: the largest step's allocation is measured on the GPU and left free beside the KV
cache, so a max_model_len prompt prefilled in max_num_batched_tokens chunks runs in what the engine sized."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.memory_profile import peak_step_bytes
from deepinfer.model.loader import load_model
from deepinfer.registry import list_backends, load_backend

from tiny_checkpoints import build_hf_model, save_checkpoint

CUDA_USABLE = torch.cuda.is_available() and any(b.name == "cuda_sm100" and b.usable for b in list_backends())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=11, gain=0.5, max_position_embeddings=512)
    return save_checkpoint(hf, tmp_path_factory.mktemp("profile-model"))


def test_nothing_to_measure_off_the_gpu(checkpoint):
    backend = load_backend("reference")
    model = load_model(checkpoint, backend, dtype=torch.float32, progress=False)
    assert peak_step_bytes(model, backend, tokens=64, context=256, logit_rows=4, block_size=16, kv_dtype="fp32",
                           free_bytes=1 << 30) == 0


@pytest.mark.skipif(not CUDA_USABLE, reason="needs a GPU with cuda_sm100")
def test_peak_grows_with_the_chunk_and_the_engine_leaves_it_free(checkpoint, gen):
    backend = load_backend("cuda_sm100")
    model = load_model(checkpoint, backend, dtype=torch.bfloat16, progress=False)
    free = torch.cuda.mem_get_info()[0]
    kw = dict(context=512, logit_rows=4, block_size=16, kv_dtype="bf16", free_bytes=free)
    # The first forward also allocates what stays (cuBLAS's 32 MiB workspace, kernel scratch): part of the
    # reserve the engine takes, but it would hide the per-token growth compared here.
    first = peak_step_bytes(model, backend, tokens=32, **kw)
    small, large = (peak_step_bytes(model, backend, tokens=t, **kw) for t in (32, 512))
    assert first >= small and 0 < small < large
    hidden = model.config.hidden_size
    assert large >= 512 * hidden * 2  # at least the chunk's hidden states
    del model

    llm = LLM(checkpoint, backend="cuda_sm100", dtype=torch.bfloat16, progress=False, block_size=16, max_model_len=512,
              max_num_batched_tokens=128, max_num_seqs=4, cuda_graph_max_batch_size=4)
    prompt = torch.randint(2, 96, (500,), generator=gen).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
