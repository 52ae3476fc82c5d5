"""Expert parallelism on each non-reference backend: 2 ranks (one device each over the backend's collective
library, or CPU gloo ranks where the backend runs on the host, as cuda_sm100 does under the Triton interpreter)
give what one process of the same backend gives. The backend's own dispatch/combine carries the tokens here
(test_expert_parallel.py covers the reference backend, EPLB and idle ranks).

The comparison is teacher-forced, so a near-tie that one side breaks differently cannot derail it: the one
process scores each rank's prompt + generated tokens, and every prompt log-prob, every generated token's
log-prob, and the greedy choice itself (the chosen token is the one process's best up to TOL) must agree."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

from spawned_ranks import COLLECTIVE_TIMEOUT_S, run_ranks
from tiny_checkpoints import build_hf_model, save_checkpoint

WORLD = 2
VOCAB = 96
TOL = 2e-3  # fp32 model and activations; kernels round MMA inputs to bf16 alike on both sides
SKEW = torch.tensor([[1.0, 1, 1, 40, 1, 1, 9, 1], [30.0, 1, 1, 1, 1, 12, 1, 1]])  # a load EPLB must answer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_hf_model("deepseek_v3", seed=31, gain=0.5)  # 8 routed experts top-2, 2 MoE layers
    return str(save_checkpoint(hf, tmp_path_factory.mktemp("ep-backends")))


def _options(path: str, backend_name: str) -> dict:
    return dict(model=path, backend=backend_name, dtype="float32", kv_cache_dtype="bf16", progress=False,
                kv_cache_memory=1 << 22, max_num_batched_tokens=32, max_num_seqs=4)


def _rank(rank: int, world: int, store: str, path: str, backend_name: str, assigned: list, eager: bool) -> dict:
    from deepinfer.config import EngineConfig
    from deepinfer.engine.expert_parallel import build_engine, dist_backend_for, init_distributed, shutdown_distributed

    # The default variant also balances experts: replicas, and a rebalance mid-run (graphs captured again).
    mode = (dict(enforce_eager=True, overlap_scheduling=False) if eager else
            dict(enable_eplb=True, num_redundant_experts=2, eplb_window_size=4, eplb_step_interval=10**6))
    config = EngineConfig(**_options(path, backend_name), expert_parallel_size=world, **mode)
    ctx = init_distributed(dist_backend_for(config, rank), rank=rank, world_size=world, init_method=store,
                           timeout_s=COLLECTIVE_TIMEOUT_S)
    ep = build_engine(config, ctx)
    for request_id, prompt, params in assigned[rank]:
        ep.engine.add_request(request_id, prompt, params)
    final, moved = {}, 0
    step = 0
    while (outputs := ep.step()) is not None:
        final.update((o.request_id, o) for o in outputs if o.finished)
        step += 1
        if not eager and step == 3:  # experts move mid-generation (collective: every rank at its third step)
            moved = ep.rebalance(SKEW).transfers
    ep.close()
    shutdown_distributed(ctx)
    out = {}
    for rid, o in final.items():
        c = o.outputs[0]
        out[rid] = {"tokens": list(c.token_ids), "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                    "prompt_logprobs": [next(iter(p.values())).logprob if p else None for p in o.prompt_logprobs or []]}
    return {"outputs": out, "moved": moved}


@pytest.mark.parametrize("eager", [False, True], ids=["graphs-overlap-eplb", "eager"])
def test_two_ranks_match_one_process(backend_name, checkpoint, gen, tmp_path, eager):
    """The default: overlapped scheduling, and decode graphs on a GPU (the ranks agree on each step's graph
    size; an idle rank replays it on dummy rows), with EPLB moving experts mid-run. eager: enforce_eager without
    overlap, whose dispatch exchanges counts where a step is too large for the fixed buffers."""
    from deepinfer.registry import load_backend

    if backend_name == "reference":
        pytest.skip("the reference backend's expert parallelism is covered by test_expert_parallel.py")
    dev = load_backend(backend_name).device
    if dev.type != "cpu" and getattr(torch, dev.type).device_count() < WORLD:
        pytest.skip(f"needs {WORLD} {dev.type} devices")
    requests = []
    for i in range(5):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(4, 30, (), generator=gen)),), generator=gen).tolist()
        # Requests without prompt log-probs let the engine overlap scheduling with the device.
        params = SamplingParams(max_tokens=int(torch.randint(4, 12, (), generator=gen)), temperature=0.0,
                                ignore_eos=True, logprobs=0, prompt_logprobs=0 if i < 2 else None)
        requests.append((f"r{i}", prompt, params))
    assigned = [requests[:3], requests[3:]]  # rank 1 runs out of work first and joins with idle forwards
    # (rank 1's requests have no prompt log-probs: all its steps overlap)
    # 240 s: a hang prints each rank's stack (spawned_ranks) before the deadline. Tearing the group down while
    # graphs holding NCCL kernels live hangs in torch (pytorch/pytorch#115388): ExpertParallelEngine.close first.
    results = run_ranks(_rank, WORLD, (checkpoint, backend_name, assigned, eager), tmp_path)
    if not eager:
        assert all(r["moved"] > 0 for r in results), "the mid-run rebalance moved no expert"
    results = [r["outputs"] for r in results]

    one = LLM(checkpoint, **{k: v for k, v in _options(checkpoint, backend_name).items() if k != "model"})
    for rank, mine in enumerate(assigned):
        for request_id, prompt, params in mine:
            got = results[rank][request_id]
            assert len(got["tokens"]) == params.max_tokens
            forced = one.generate([prompt + got["tokens"]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
            scored = forced.prompt_logprobs
            for pos, lp in enumerate(got["prompt_logprobs"][1:], start=1):
                assert abs(lp - scored[pos][prompt[pos]].logprob) <= TOL, (request_id, pos)
            for i, (token, lp) in enumerate(zip(got["tokens"], got["logprobs"], strict=True)):
                here = scored[len(prompt) + i]
                assert abs(lp - here[token].logprob) <= TOL, (request_id, i)
                best = max(v.logprob for v in here.values())
                assert here[token].logprob >= best - TOL, (request_id, i, "not the greedy choice")
