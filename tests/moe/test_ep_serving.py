"""Serving under expert parallelism, launched the torchrun way (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT):
rank 0's front spreads requests over the ranks and gathers their outputs, the other rank follows, aborts and
duplicate ids behave as on one engine, and the results equal a single process's."""

from __future__ import annotations

import os
import socket

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidInputError

from spawned_ranks import run_ranks
from tiny_checkpoints import build_hf_model, save_checkpoint

PROMPTS = [[5, 9, 11, 30, 2], [40, 41, 42], [7] * 12, [60, 3, 3, 8, 19, 77, 21], [13, 14]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_checkpoint(build_hf_model("deepseek_v3", seed=3), tmp_path_factory.mktemp("ep-serve-model")))


def _options(path: str) -> dict:
    return dict(model=path, backend="reference", dtype="float32", progress=False, kv_cache_memory=1 << 22)


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True, logprobs=0)


def _rank(rank: int, world: int, store: str, path: str, port: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from deepinfer.engine.ep_serving import launch

    config = EngineConfig(**_options(path), expert_parallel_size=world, enable_eplb=True, num_redundant_experts=2,
                          eplb_window_size=4, eplb_step_interval=2)
    run = launch(config)  # a follower returns only after rank 0 shuts down
    if run.front is None:
        return {"follower": True}
    front = run.front
    for i, prompt in enumerate(PROMPTS):
        front.add_request(f"r{i}", prompt, _params(i))
    front.add_request("gone", [9, 9, 9], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    errors = []
    for bad in (lambda: front.add_request("r0", [1, 2], _params(0)), lambda: front.add_request("x", [], _params(0))):
        try:
            bad()
        except InvalidInputError as err:
            errors.append(str(err))
    owners = {rid: rank for rid, (rank, _) in front._owner.items()}
    final, aborted, steps = {}, None, 0
    while front.has_unfinished():
        for out in front.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == 3:
            aborted = front.abort("gone")
    stats = front.stats()
    events = len(run.front.ep.balancer.events)
    run.close()
    return {"final": {rid: (o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                      for rid, o in final.items()},
            "aborted": aborted, "errors": errors, "owners": owners, "generated": stats.generated_tokens, "events": events}


def test_front_and_follower_match_one_engine(checkpoint, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lead, follower = run_ranks(_rank, 2, (checkpoint, port), tmp_path)
    assert follower == {"follower": True}
    assert len(lead["errors"]) == 2 and "already in use" in lead["errors"][0]
    assert set(lead["owners"].values()) == {0, 1}  # requests went to both ranks
    assert lead["aborted"].finished and lead["aborted"].outputs[0].finish_reason == "abort"
    assert "gone" not in lead["final"] and lead["events"] >= 1

    engine = LLMEngine.from_config(EngineConfig(**_options(checkpoint)))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, _params(i))
    want = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                want[out.request_id] = (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
    assert set(lead["final"]) == set(want)
    for rid, (tokens, logprobs) in want.items():
        assert lead["final"][rid][0] == tokens
        assert all(abs(a - b) <= 1e-5 for a, b in zip(lead["final"][rid][1], logprobs, strict=True))
    assert lead["generated"] >= sum(len(t) for t, _ in want.values())  # stats summed over both ranks


def test_requests_go_to_the_rank_with_the_fewest_sequences():
    from deepinfer.engine.ep_serving import least_loaded_rank

    assert least_loaded_rank([], 3) == 0
    assert least_loaded_rank([(0, 1), (1, 1)], 3) == 2
    # A request of 4 completions weighs 4 sequences: rank 1's two single requests are the lighter load.
    assert least_loaded_rank([(0, 4), (1, 1), (1, 1)], 2) == 1
    assert least_loaded_rank([(0, 2), (1, 1), (1, 1)], 2) == 0  # a tie: the lowest rank
