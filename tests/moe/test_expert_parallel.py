"""Expert parallelism end to end on CPU gloo ranks: a tiny DeepSeek-V3 gives the single process's greedy tokens
and log-probs with 2 and 4 ranks, under EPLB placements with redundant experts, before and after live
rebalances that migrate expert weights mid-generation (and with ranks that sit idle)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sampling_params import SamplingParams

from spawned_ranks import COLLECTIVE_TIMEOUT_S, run_ranks
from tiny_checkpoints import build_hf_model, save_checkpoint

VOCAB = 96
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=5)  # 8 routed experts in 2 groups, top-2, 2 MoE layers
    return str(save_checkpoint(hf, tmp_path_factory.mktemp("ep-model")))


def _requests(count: int) -> list[tuple[str, list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(count):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(3, 20, (), generator=g)),), generator=g).tolist()
        # Every other request without prompt log-probs: steps of those alone overlap scheduling with the device.
        params = SamplingParams(max_tokens=int(torch.randint(3, 15, (), generator=g)), temperature=0.0, ignore_eos=True,
                                logprobs=0, prompt_logprobs=0 if i % 2 else None)
        out.append((f"r{i}", prompt, params))
    return out


def _engine_options(path: str) -> dict:
    return dict(model=path, backend="reference", dtype="float32", progress=False, kv_cache_memory=1 << 22,
                max_num_batched_tokens=24, max_num_seqs=4)


def _summary(out) -> dict:
    c = out.outputs[0]
    return {
        "tokens": list(c.token_ids),
        "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
        "prompt_logprobs": [next(iter(p.values())).logprob if p else None for p in out.prompt_logprobs or []],
    }


def _rank(rank: int, world: int, store: str, path: str, assigned: list, nodes: int, redundant: int) -> dict:
    """One rank: build its engine share, move to a skewed EPLB placement, then serve its requests while the
    balancer rebalances every 3 steps from the recorded load."""
    from deepinfer.engine.expert_parallel import build_engine, init_distributed, shutdown_distributed

    ctx = init_distributed("gloo", rank=rank, world_size=world, init_method=store, timeout_s=COLLECTIVE_TIMEOUT_S,
                           local_world_size=world // nodes)
    config = EngineConfig(**_engine_options(path), expert_parallel_size=world, enable_eplb=True,
                          num_redundant_experts=redundant, eplb_window_size=4, eplb_step_interval=3)
    ep = build_engine(config, ctx)
    placements = [ep.balancer.placement.phy2log.clone()]
    skew = torch.tensor([[1.0, 1, 1, 40, 1, 1, 9, 1], [30.0, 1, 1, 1, 1, 12, 1, 1]])  # hot experts 3, 6 / 0, 5
    first = ep.rebalance(skew)  # live: no request yet, but the weights move all the same
    placements.append(ep.balancer.placement.phy2log.clone())
    for request_id, prompt, params in assigned[rank]:
        ep.engine.add_request(request_id, prompt, params)
    final = ep.run_until_done()
    placements += [ep.balancer.placement.phy2log.clone()]
    held = {i: moe.placement.local_experts for i, moe in _moe_layers(ep)}
    ep.close()
    shutdown_distributed(ctx)
    return {"outputs": {rid: _summary(o) for rid, o in final.items()}, "events": ep.balancer.events,
            "first": first, "placements": placements, "held": held, "steps": ep.steps}


def _moe_layers(ep):
    from deepinfer.engine.expert_parallel import moe_layers

    return moe_layers(ep.engine.model).items()


@pytest.fixture(scope="module")
def single_process(checkpoint):
    engine = LLMEngine.from_config(EngineConfig(**_engine_options(checkpoint)))
    for request_id, prompt, params in _requests(7):
        engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = _summary(out)
    return final


def _assert_same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert abs(a - b) <= TOL, (a, b)
    for a, b in zip(got["prompt_logprobs"], want["prompt_logprobs"], strict=True):
        assert (a is None and b is None) or abs(a - b) <= TOL, (a, b)


# world, simulated nodes (4 ranks as 2 nodes of 2 exercise the hierarchical policy), redundant slots, and
# which requests each rank serves: uneven so ranks fall idle at different steps; the last 4-rank rank has none.
CASES = [(2, 1, 2, [[0, 1, 2, 3], [4, 5, 6]]), (4, 2, 4, [[0, 1], [2, 3, 4], [5, 6], []])]


@pytest.mark.parametrize("world,nodes,redundant,split", CASES, ids=["2-ranks", "4-ranks-2-nodes"])
def test_expert_parallel_matches_single_process(checkpoint, single_process, tmp_path, world, nodes, redundant, split):
    reqs = _requests(7)
    assigned = [[reqs[i] for i in idx] for idx in split]
    results = run_ranks(_rank, world, (checkpoint, assigned, nodes, redundant), tmp_path)

    for rank, result in enumerate(results):
        for i in split[rank]:
            _assert_same(result["outputs"][f"r{i}"], single_process[f"r{i}"])
    # All ranks stepped together and agree on every placement they went through.
    assert len({r["steps"] for r in results}) == 1
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["placements"], results[0]["placements"], strict=True))
    before, skewed, after = results[0]["placements"]
    assert skewed.shape == (2, 8 + redundant)
    assert not torch.equal(before, skewed) and results[0]["first"].transfers > 0
    # The skewed load's hot experts got replicas, on different ranks.
    per_rank = (8 + redundant) // world
    for row, hot in ((0, 3), (1, 0)):
        ranks = [s // per_rank for s in range(8 + redundant) if skewed[row, s] == hot]
        assert len(ranks) >= 2 and len(set(ranks)) == len(ranks)
    # Live rebalances happened during generation (checked every 3 steps; taken when the window's balance
    # improves), and the last one's layout is what each rank holds.
    live = [e for e in results[0]["events"] if e.step > 0]
    assert live and all(e.transfers > 0 and e.imbalance_after < e.imbalance_before for e in live)
    for rank, r in enumerate(results):
        for row, (layer_id, held) in enumerate(sorted(r["held"].items())):
            assert list(held) == after[row, rank * per_rank : (rank + 1) * per_rank].tolist()
