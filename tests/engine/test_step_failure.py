"""A step whose forward runs out of device memory fails only its own requests, with an error; the engine goes
on serving (on the GPU the forward raises torch.OutOfMemoryError: here the runner is made to raise it)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.async_engine import AsyncLLMEngine, RequestFailedError

from tiny_checkpoints import build_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=13, max_position_embeddings=512)
    return str(save_checkpoint(hf, tmp_path_factory.mktemp("oom-model")))


def _oom_above(monkeypatch, runner, max_tokens: int) -> list[int]:
    """Make runner.execute raise torch.OutOfMemoryError for batches of more than max_tokens tokens."""
    real, seen = runner.execute, []

    def execute(batch, *args, **kwargs):
        seen.append(batch.num_tokens)
        if batch.num_tokens > max_tokens:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.25 GiB")
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    return seen


def _prompt(gen, n):
    return torch.randint(2, 96, (n,), generator=gen).tolist()


@pytest.mark.parametrize("overlap", [True, False])
def test_oom_fails_the_step_and_the_engine_goes_on(checkpoint, gen, monkeypatch, overlap):
    llm = LLM(checkpoint, backend="reference", dtype=torch.float32, progress=False, overlap_scheduling=overlap)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    short = _prompt(gen, 5)
    want = llm.generate([short], params)[0].outputs[0].token_ids
    seen = _oom_above(monkeypatch, llm.engine.runner, max_tokens=100)

    failed = llm.generate([_prompt(gen, 300)], params)[0]
    assert failed.error is not None and "out of memory" in failed.error
    assert failed.finished and failed.outputs[0].finish_reason == "abort" and not failed.outputs[0].token_ids
    assert max(seen) > 100
    engine = llm.engine
    assert not engine.has_unfinished() and engine.scheduler.block_manager.num_free_blocks == engine.runner.num_usable_blocks

    again = llm.generate([short], params)[0]  # the engine serves on, with the same answers
    assert again.error is None and again.outputs[0].token_ids == want


def test_async_engine_fails_only_that_request(checkpoint, gen, monkeypatch):
    llm = LLM(checkpoint, backend="reference", dtype=torch.float32, progress=False)
    _oom_above(monkeypatch, llm.engine.runner, max_tokens=100)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run():
        engine = AsyncLLMEngine(llm.engine)
        try:
            stream = await engine.add_request("big", _prompt(gen, 300), params)
            with pytest.raises(RequestFailedError, match="out of memory"):
                async for _ in stream:
                    pass
            assert engine.is_healthy
            outs = [o async for o in await engine.add_request("small", _prompt(gen, 5), params)]
            return outs[-1]
        finally:
            await engine.shutdown()

    last = asyncio.run(run())
    assert last.finished and last.error is None and len(last.outputs[0].token_ids) == 4
