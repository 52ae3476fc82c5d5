"""dispatch / combine / all_reduce: in one process, and across 2 spawned ranks (CPU gloo, or one device each)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer.backend import Dispatched
from deepinfer.errors import InvalidInputError
from deepinfer.weights import LinearWeight

from spawned_ranks import COLLECTIVE_TIMEOUT_S, RANKS_DEADLINE_S


def _routing(gen: torch.Generator, t: int, k: int, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token drawn from `experts`, with random positive weights."""
    scores = torch.rand(t, len(experts), generator=gen)
    ids = scores.topk(k, dim=-1).indices + experts.start
    return ids, torch.rand(t, k, generator=gen) + 0.1


def _expected(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_w: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * (x[t] @ W[ids[t, k]]^T), float64 on the CPU."""
    x, w = x.double().cpu(), expert_w.double().cpu()
    per_choice = torch.einsum("tkod,td->tko", w[ids.cpu().long()], x)  # each chosen expert's map of its token
    return (weights.cpu().double()[..., None] * per_choice).sum(1)


def _run_moe(backend, x, ids, weights, expert_w, num_experts, first, local, capacity=None, add=None):
    """dispatch -> each local expert's linear map via grouped_linear -> combine (plus `add`, as the shared
    experts' output is). With a capacity the dispatched rows may end in padding past the group sizes
    (fixed-size buffers), which the GEMM skips."""
    d = backend.dispatch(x, ids, weights, num_experts, capacity=capacity).wait()
    assert isinstance(d, Dispatched) and d.first_expert == first and d.group_sizes.shape == (local,)
    lw = LinearWeight.dense(expert_w[first : first + local].to(x.dtype))
    if capacity is not None and d.hidden.shape[0] > int(d.group_sizes.sum()):
        y = backend.grouped_linear(d.hidden, lw, d.group_sizes, validate=False)
    else:
        y = backend.grouped_linear(d.hidden, lw, d.group_sizes)
    return d, backend.combine(d, y, add=add).wait()


def _close(out: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """|out - ref| <= rtol * (|ref| + max|ref|): sums that cancel are judged against the output's scale."""
    out, ref = out.cpu().double(), ref.cpu().double()
    assert out.shape == ref.shape
    if ref.numel():
        assert ((out - ref).abs() <= rtol * (ref.abs() + ref.abs().max())).all()


@pytest.mark.parametrize("t,h,k,e", [(1, 8, 1, 4), (33, 40, 6, 16), (7, 200, 2, 3), (20, 24, 4, 4), (0, 8, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_process_dispatch_combine(backend, gen, t, h, k, e, dtype):
    dev = backend.device
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids, weights = _routing(gen, t, k, range(e))
    expert_w = torch.randn(e, h, h, generator=gen) / h**0.5  # a different linear map per expert
    add = torch.randn(t, h, generator=gen).to(dtype) if t % 2 else None  # a shared experts' output, some cases
    d, out = _run_moe(backend, x.to(dev), ids.to(dev), weights.to(dev), expert_w.to(dev), e, 0, e,
                      add=None if add is None else add.to(dev))
    expected = _expected(x, ids, weights, expert_w) + (0 if add is None else add.double())
    assert d.hidden.shape == (t * k, h) and d.hidden.dtype == dtype
    assert d.group_sizes.dtype == torch.int64
    assert d.group_sizes.cpu().tolist() == torch.bincount(ids.flatten(), minlength=e).tolist()
    # Group g holds exactly the rows of the tokens that chose expert g.
    start = 0
    for g, size in enumerate(d.group_sizes.tolist()):
        got = d.hidden[start : start + size].cpu()
        want = x[(ids == g).any(-1)]
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))
        start += size
    assert out.dtype == dtype and out.device.type == dev.type
    if dtype == torch.float32:
        _close(out, expected, 1e-5)
    else:  # expert outputs are rounded to bf16 before the weighted sum, which may cancel
        _close(out, expected, 2e-2)


def test_single_process_int32_ids_and_all_reduce(backend, gen):
    dev = backend.device
    x = torch.randn(9, 16, generator=gen).to(dev)
    ids, weights = _routing(gen, 9, 3, range(8))
    expert_w = torch.randn(8, 16, 16, generator=gen)
    _, out = _run_moe(backend, x, ids.int().to(dev), weights.to(dev), expert_w.to(dev), 8, 0, 8)
    _close(out, _expected(x, ids, weights, expert_w), 1e-5)
    before = x.clone()
    assert torch.equal(backend.all_reduce(x), before)


def test_comm_rejects_bad_inputs(backend, gen):
    dev = backend.device
    x = torch.randn(5, 8, generator=gen).to(dev)
    ids, weights = (t.to(dev) for t in _routing(gen, 5, 2, range(4)))
    bad = [
        lambda: backend.dispatch(x, ids.float(), weights, 4),  # float ids
        lambda: backend.dispatch(x, ids, weights[:, :1], 4),  # weights shape
        lambda: backend.dispatch(x, ids, weights.long(), 4),
        lambda: backend.dispatch(x[:4], ids, weights, 4),  # token counts disagree
        lambda: backend.dispatch(x[0], ids, weights, 4),  # 1-D x
        lambda: backend.dispatch(x.long(), ids, weights, 4),
        lambda: backend.dispatch(x, ids, weights, int(ids.max())),  # the largest id is out of range
        lambda: backend.dispatch(x, ids - 4, weights, 4),  # negative ids
        lambda: backend.dispatch(x, ids, weights, 0),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(InvalidInputError):
            call()
            pytest.fail(f"bad input #{i} was accepted")
    d = backend.dispatch(x, ids, weights, 4).wait()
    with pytest.raises(InvalidInputError):
        backend.combine(d, torch.randn(d.hidden.shape[0] + 1, 8).to(dev))
    with pytest.raises(InvalidInputError):
        backend.combine(d, d.hidden.long())
    y = torch.randn(d.hidden.shape[0], 8).to(dev)
    for add in (torch.randn(4, 8), torch.randn(5, 7), torch.randn(5, 8).long(), torch.randn(5)):  # 5 tokens, 8 wide
        with pytest.raises(InvalidInputError):
            backend.combine(d, y, add=add.to(dev))


# --- two ranks ---------------------------------------------------------------------------------------
WORLD = 2
E, H, K = 8, 24, 3  # rank r owns experts [4r, 4r + 4)
# (tokens on rank 0, tokens on rank 1, experts rank 1 routes to, dtype): rank 1's tokens go only to rank 0's
# experts, then a rank with no tokens at all, then everything routed everywhere (fp32 and bf16).
CASES = [(5, 3, range(0, 4), torch.float32), (0, 4, range(0, 8), torch.float32), (6, 11, range(0, 8), torch.float32),
         (9, 2, range(0, 8), torch.bfloat16), (800, 800, range(0, 8), torch.float32)]
# The last case gives a rank more than 4096 received (row, choice) pairs: cuda_sm100 then groups them with the
# multi-launch sort instead of one launch (ep_comm.EP_SMALL_MAX_PAIRS).


def _worker(rank: int, name: str, tmp: str) -> None:
    import torch.distributed as dist

    from deepinfer.registry import load_backend

    backend = load_backend(name)
    dev = backend.device
    if dev.type != "cpu":  # one device per rank
        dev = torch.device(dev.type, rank)
        backend = load_backend(name, device=str(dev))
        getattr(torch, dev.type).set_device(dev)
    dist_backend = "gloo" if dev.type == "cpu" else backend.capabilities.dist_backend
    dist.init_process_group(dist_backend, init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        inputs = torch.load(f"{tmp}/inputs.pt")
        results = []
        for case in inputs["cases"]:
            x, ids, weights = (t.to(dev) for t in case[rank])
            # Buffers sized from exchanged counts, then fixed ones of a capacity both ranks pass alike.
            capacity = max(len(c[0]) for c in case) + 1
            for cap in (None, capacity):  # the fixed-capacity run also adds x, as a shared expert's output
                d, out = _run_moe(backend, x, ids, weights, inputs["expert_w"].to(dev), E, rank * E // WORLD,
                                  E // WORLD, cap, add=None if cap is None else x)
                results.append((d.group_sizes.cpu(), out.cpu()))
        # Every rank raises before communicating, so a bad expert count cannot hang the group.
        try:
            backend.dispatch(x, ids, weights, E + 1).wait()
            bad_count = "accepted"
        except InvalidInputError:
            bad_count = "rejected"
        reduced = backend.all_reduce(torch.full((3, 5), float(rank + 1), device=dev))
        torch.save({"results": results, "bad_count": bad_count, "reduced": reduced.cpu()}, f"{tmp}/out{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_single_process(backend, gen, tmp_path):
    dev = backend.device
    if dev.type != "cpu" and getattr(torch, dev.type).device_count() < WORLD:
        pytest.skip(f"needs {WORLD} {dev.type} devices for a {backend.capabilities.dist_backend} run")
    expert_w = torch.randn(E, H, H, generator=gen) / H**0.5
    cases = []
    for t0, t1, experts1, dtype in CASES:
        per_rank = []
        for t, experts in ((t0, range(E)), (t1, experts1)):
            x = torch.randn(t, H, generator=gen).to(dtype)
            per_rank.append((x, *_routing(gen, t, K, experts)))
        cases.append(per_rank)
    torch.save({"cases": cases, "expert_w": expert_w}, tmp_path / "inputs.pt")

    ctx = mp.start_processes(_worker, args=(backend.name, str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + RANKS_DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the 2-rank run did not finish within {RANKS_DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(WORLD)]

    for i in range(2 * len(cases)):  # each case with exchanged counts, then with a fixed capacity
        c = i // 2
        case = cases[c]
        all_ids = torch.cat([ids for _, ids, _ in case]).flatten()
        counts = torch.bincount(all_ids, minlength=E)
        for r in range(WORLD):
            sizes, out = outs[r]["results"][i]
            assert sizes.tolist() == counts[r * E // WORLD : (r + 1) * E // WORLD].tolist(), (c, r)
            rtol = 1e-5 if CASES[c][3] == torch.float32 else 2e-2
            add = case[r][0] if i % 2 else None
            _close(out, _expected(*case[r], expert_w) + (0 if add is None else add.double()), rtol)
            # And the same as this backend in a single process with all experts.
            x, ids, weights = (t.to(dev) for t in case[r])
            _, single = _run_moe(backend, x, ids, weights, expert_w.to(dev), E, 0, E,
                                 add=None if add is None else add.to(dev))
            _close(out, single, rtol)
    for r in range(WORLD):
        assert outs[r]["bad_count"] == "rejected"
        assert torch.equal(outs[r]["reduced"], torch.full((3, 5), 3.0))
