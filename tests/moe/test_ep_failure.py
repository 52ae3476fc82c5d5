"""A rank that fails mid-step under expert parallelism (here: out of device memory in its forward) ends the
group promptly with a typed error instead of leaving the others waiting in collectives it will never join:
the failing follower exits, rank 0's front raises RankFailedError, and the async engine fails every request.

One rank cannot fail only its own requests, as a single engine does for an out-of-memory step
(test_step_failure.py): the other ranks are inside the same step's MoE collectives."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer.engine.sampling_params import SamplingParams

from tiny_checkpoints import build_hf_model, save_checkpoint

FAILING_FORWARD = 4  # the follower's forward that runs out of memory (after prefill, mid-decode)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_checkpoint(build_hf_model("deepseek_v3", seed=5), tmp_path_factory.mktemp("ep-failure-model")))


def _rank(rank: int, world: int, port: int, path: str, out: str, failing: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from deepinfer.config import EngineConfig
    from deepinfer.engine.ep_serving import launch
    from deepinfer.engine.expert_parallel import RankFailedError
    from deepinfer.engine.runner import ModelRunner

    if rank == failing:  # fault injection in this process only: its fourth forward runs out of device memory
        execute, calls = ModelRunner.execute, [0]

        def out_of_memory(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == FAILING_FORWARD:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return execute(self, *args, **kwargs)

        ModelRunner.execute = out_of_memory
    config = EngineConfig(model=path, backend="reference", dtype="float32", progress=False, kv_cache_memory=1 << 22,
                          expert_parallel_size=world)
    run = launch(config)  # rank 1 follows until it (or rank 0) fails, and then exits the process
    front = run.front
    for i in range(4):
        front.add_request(f"r{i}", [3 + i, 9, 11, 30], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    steps, error = 0, None
    started = time.monotonic()
    try:
        while front.has_unfinished():
            front.step()
            steps += 1
    except RankFailedError as err:
        error = str(err)
    waited = time.monotonic() - started
    failure = front.failure()
    run.close()
    torch.save({"error": error, "steps": steps, "waited": waited, "failure": failure}, out)
    os._exit(0)


@pytest.mark.parametrize("failing", [1, 0], ids=["follower", "front"])
def test_a_failing_rank_ends_the_group_promptly(checkpoint, tmp_path, failing):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = mp.get_context("spawn")
    ranks = [spawn.Process(target=_rank, args=(r, 2, port, checkpoint, str(tmp_path / f"out{r}.pt"), failing))
             for r in range(2)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + 150
    try:
        for p in ranks:
            p.join(max(0.1, deadline - time.monotonic()))
        assert not any(p.is_alive() for p in ranks), "the ranks did not finish: a failure left the group waiting"
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
    assert ranks[1].exitcode == 1  # the follower exited: its own step failed, or rank 0 left the group
    lead = torch.load(tmp_path / "out0.pt", weights_only=False)
    assert ranks[0].exitcode == 0, lead
    assert lead["error"] is not None and lead["failure"] is not None, lead
    if failing == 0:  # the front's own step: the error says which rank and what
        assert "rank 0 failed" in lead["error"] and "out of memory" in lead["error"], lead
    assert lead["steps"] >= 2  # prefill and some decoding ran before the failure
    assert lead["waited"] < 120  # not the collective timeout (30 min)


class _BlockedEngine:
    """An engine whose step blocks, as rank 0's does on a GPU when a peer died inside a collective."""

    def __init__(self):
        self.release = threading.Event()
        self.lost: str | None = None
        self.requests: set[str] = set()

    def add_request(self, request_id, prompt, params):
        self.requests.add(request_id)

    def abort(self, request_id):
        self.requests.discard(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self):
        self.release.wait()
        return []

    def failure(self) -> str | None:
        return self.lost


def test_async_engine_fails_requests_when_a_peer_is_lost_mid_step():
    from deepinfer.engine.async_engine import AsyncLLMEngine, EngineDeadError

    engine = _BlockedEngine()

    async def scenario() -> tuple[str, float]:
        async_engine = AsyncLLMEngine(engine)
        stream = await async_engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
        asyncio.get_running_loop().call_later(0.3, setattr, engine, "lost", "expert-parallel rank 1 exited (code 1)")
        started = time.monotonic()

        async def consume() -> None:
            async for _ in stream:
                pass

        try:
            with pytest.raises(EngineDeadError) as err:  # within 10 s, or wait_for's TimeoutError fails the test
                await asyncio.wait_for(consume(), 10)
            waited = time.monotonic() - started
            assert not async_engine.is_healthy
            with pytest.raises(EngineDeadError):  # new requests are refused, not queued behind the blocked step
                await async_engine.add_request("b", [1], SamplingParams(max_tokens=1))
        finally:
            engine.release.set()  # the worker thread the engine left blocked (asyncio.run joins it at exit)
        return str(err.value), waited

    message, waited = asyncio.run(scenario())
    assert "rank 1 exited" in message
    assert waited < 5
