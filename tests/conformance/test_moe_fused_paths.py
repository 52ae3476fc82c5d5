"""The MoE layer's few-token paths against the general ones they replace, on every backend.

- ops.route (the gate from hidden states; cuda_sm100 fuses the float32 GEMV and the selection in one launch
  for few tokens) against select_experts(linear(x.float(), gate)), with and without folded shared experts.
- cuda_sm100's one-launch dispatch (sort + gather) against its three-launch counting sort + index_select:
  the same rows in the same order, the same group sizes and the same combine.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import RoutingSpec
from deepinfer.weights import LinearWeight

ROUTINGS = [
    RoutingSpec(num_experts=64, top_k=6, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False),  # V2-Lite
    RoutingSpec(num_experts=160, top_k=6, scoring_func="softmax", topk_method="group_limited_greedy",
                n_group=8, topk_group=3, routed_scaling_factor=16.0, norm_topk_prob=False),  # V2
    RoutingSpec(num_experts=8, top_k=4, scoring_func="softmax", topk_method="greedy", norm_topk_prob=True),
    RoutingSpec(num_experts=256, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5),  # V3
    RoutingSpec(num_experts=12, top_k=2, n_group=1, topk_group=1),
]


def _dyadic(gen, *shape, scale: int) -> torch.Tensor:
    """Small multiples of 1/scale: products and sums of a few thousand are exact in float32, in any order, so
    a fused GEMV yields bit-identical logits and the routes must agree exactly."""
    return torch.randint(-8, 9, shape, generator=gen).float() / scale


def _no_gemm(x, weight):
    raise AssertionError("the fused gate called the backend's GEMM")


@pytest.mark.parametrize("spec", ROUTINGS, ids=lambda s: f"{s.scoring_func}-{s.topk_method}-E{s.num_experts}")
@pytest.mark.parametrize("tokens", [1, 7, 32, 45])
@pytest.mark.parametrize("shared", [0, 2])
def test_route_is_linear_then_select(backend, gen, spec, tokens, shared):
    dev = backend.device
    h = 200  # not a power of two: masked tail of the GEMV
    x = _dyadic(gen, tokens, h, scale=8).bfloat16().to(dev)
    gate = LinearWeight.dense(_dyadic(gen, spec.num_experts, h, scale=64).to(dev))
    bias = (torch.randn(spec.num_experts, generator=gen) * 0.1).to(dev) if spec.topk_method == "noaux_tc" else None
    want_w, want_ids = backend.ops.select_experts(backend.linear(x.float(), gate), spec, bias)
    fused = backend.name == "cuda_sm100" and tokens <= 32
    weights, ids = backend.ops.route(x, gate, spec, bias, linear=_no_gemm if fused else backend.linear, shared=shared)
    k = spec.top_k
    assert weights.shape == ids.shape == (tokens, k + shared)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids[:, :k].cpu(), want_ids.cpu())
    assert torch.equal(weights[:, :k].cpu(), want_w.cpu())
    # Folded shared experts: every token takes experts E.. with weight 1 (no routed_scaling_factor).
    assert torch.equal(ids[:, k:].cpu(), torch.arange(spec.num_experts, spec.num_experts + shared).expand(tokens, shared))
    assert torch.equal(weights[:, k:].cpu(), torch.ones(tokens, shared))


@pytest.mark.parametrize("spec", ROUTINGS[:3], ids=lambda s: f"{s.scoring_func}-{s.topk_method}-E{s.num_experts}")
def test_route_on_continuous_inputs(backend, gen, spec):
    """Gaussian inputs: the GEMV's summation order may differ, so weights agree to float32 rounding and the
    experts agree wherever the reference's k-th and (k+1)-th choices are not within rounding of each other."""
    dev = backend.device
    t, h = 16, 256
    x = torch.randn(t, h, generator=gen).bfloat16().to(dev)
    gate = LinearWeight.dense((torch.randn(spec.num_experts, h, generator=gen) / h**0.5).to(dev))
    logits = backend.linear(x.float(), gate)
    want_w, want_ids = backend.ops.select_experts(logits, spec, None)
    weights, ids = backend.ops.route(x, gate, spec, None, linear=backend.linear)
    probs = logits.float().softmax(-1) if spec.scoring_func == "softmax" else logits.float().sigmoid()
    top = probs.topk(spec.top_k + 1, dim=-1).values
    clear = (top[:, -2] - top[:, -1]).cpu() > 1e-5
    if spec.grouped:  # a group's rank can hinge on a near tie too: judge only ungrouped specs' ties
        clear[:] = True
    assert torch.equal(ids[clear].sort(-1).values.cpu(), want_ids[clear].sort(-1).values.cpu())
    same = (ids == want_ids).all(-1)
    torch.testing.assert_close(weights[same].cpu(), want_w[same].cpu(), rtol=1e-5, atol=1e-7)


def test_route_empty_batch_and_repeat_launches(backend, gen):
    """No tokens; and the fused gate's tickets are back at zero after each launch (many launches in a row)."""
    dev = backend.device
    spec = ROUTINGS[0]
    gate = LinearWeight.dense(_dyadic(gen, spec.num_experts, 64, scale=64).to(dev))
    weights, ids = backend.ops.route(torch.zeros(0, 64, device=dev), gate, spec, linear=backend.linear, shared=1)
    assert weights.shape == ids.shape == (0, spec.top_k + 1)
    for tokens in (1, 3, 1, 9, 2):
        x = _dyadic(gen, tokens, 64, scale=8).to(dev)
        want = backend.ops.select_experts(backend.linear(x.float(), gate), spec)
        got = backend.ops.route(x, gate, spec, linear=backend.linear)
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))


# --- cuda_sm100's one-launch dispatch ------------------------------------------------------------------
@pytest.fixture
def moe_comm(backend):
    if backend.name != "cuda_sm100":
        pytest.skip("cuda_sm100's local dispatch")
    from deepinfer.backends.cuda_sm100 import moe_comm

    return moe_comm


def _ids_with_ties_and_gaps(gen, t: int, k: int, e: int) -> torch.Tensor:
    """Random ids drawn from a few experts only (many repeats, empty experts), a token may repeat one."""
    used = torch.randperm(e, generator=gen)[: max(1, e // 3)]
    return used[torch.randint(0, used.numel(), (t, k), generator=gen)]


@pytest.mark.parametrize("t,k,e,h", [(1, 8, 66, 2048), (1, 1, 1, 8), (5, 3, 7, 40), (33, 6, 16, 520), (0, 8, 66, 16),
                                     (64, 8, 66, 96), (256, 8, 257, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_dispatch_matches_sorted_path(backend, moe_comm, gen, t, k, e, h, dtype):
    dev = backend.device
    x = torch.randn(t, h + 3, generator=gen).to(dtype)[:, :h].to(dev)  # a row slice: row stride != h
    ids = _ids_with_ties_and_gaps(gen, t, k, e).to(dev)
    weights = torch.rand(t, k, generator=gen).to(dev)
    small = moe_comm.dispatch(backend.ops, x, ids, weights, e, small_max_pairs=t * k).wait()
    general = moe_comm.dispatch(backend.ops, x, ids, weights, e, small_max_pairs=-1).wait()
    assert torch.equal(small.group_sizes.cpu(), general.group_sizes.cpu())
    assert small.group_sizes.cpu().tolist() == torch.bincount(ids.flatten().cpu(), minlength=e).tolist()
    assert torch.equal(small.state.row_of_pair.cpu(), general.state.row_of_pair.cpu())
    assert torch.equal(small.hidden.cpu(), general.hidden.cpu())
    y = torch.randn(t * k, 24, generator=gen).to(dtype).to(dev)
    assert torch.equal(backend.combine(small, y).wait().cpu(), backend.combine(general, y).wait().cpu())


def test_dispatch_takes_the_small_path_up_to_its_limit(backend, moe_comm, gen, monkeypatch):
    dev = backend.device
    e = 12
    limit = moe_comm.SMALL_DISPATCH_MAX_PAIRS
    k = 8
    x = torch.randn(limit // k + 1, 8, generator=gen).to(dev)
    ids = _ids_with_ties_and_gaps(gen, x.shape[0], k, e).int().to(dev)
    weights = torch.rand(x.shape[0], k, generator=gen).to(dev)
    calls = []
    real = moe_comm._dispatch_small
    monkeypatch.setattr(moe_comm, "_dispatch_small", lambda *a: calls.append(1) or real(*a))
    at_limit = backend.dispatch(x[:-1], ids[:-1], weights[:-1], e).wait()
    assert calls == [1]
    over = backend.dispatch(x, ids, weights, e).wait()
    assert calls == [1]  # the general path
    assert at_limit.group_sizes.sum().item() == (x.shape[0] - 1) * k and over.group_sizes.sum().item() == x.shape[0] * k


def _stable_layout(ids: torch.Tensor, num_experts: int) -> tuple[list[int], list[list[int]]]:
    """Plain Python: group sizes, and each pair's row when pairs are sorted by (expert, pair index)."""
    flat = ids.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda p: (flat[p], p))
    rows = [0] * len(flat)
    for r, p in enumerate(order):
        rows[p] = r
    k = ids.shape[1]
    return [flat.count(e) for e in range(num_experts)], [rows[i : i + k] for i in range(0, len(flat), k)]


@pytest.mark.parametrize("spec", ROUTINGS, ids=lambda s: f"{s.scoring_func}-{s.topk_method}-E{s.num_experts}")
@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("tokens", [1, 3])
def test_route_sorted_lays_out_as_the_dispatch_sorts(backend, gen, spec, shared, tokens):
    """route_sorted: route's choices, and where the router lays them out (cuda_sm100 at one token) the stable
    sort's group sizes and rows; a dispatch handed that layout delivers what one without it does."""
    dev = backend.device
    x = torch.randn(tokens, 200, generator=gen).bfloat16().to(dev)
    gate = LinearWeight.dense(torch.randn(spec.num_experts, 200, generator=gen).to(dev))
    bias = (torch.randn(spec.num_experts, generator=gen) * 0.1).to(dev) if spec.topk_method == "noaux_tc" else None
    weights, ids, layout = backend.ops.route_sorted(x, gate, spec, bias, linear=backend.linear, shared=shared)
    want_w, want_ids = backend.ops.route(x, gate, spec, bias, linear=backend.linear, shared=shared)
    assert torch.equal(ids.cpu(), want_ids.cpu()) and torch.equal(weights.cpu(), want_w.cpu())
    e = spec.num_experts + shared
    if backend.name == "cuda_sm100" and tokens == 1:
        assert layout is not None  # the one-launch gate writes it
    if layout is None:
        return
    sizes, rows = _stable_layout(ids.cpu(), e)
    assert layout.group_sizes.dtype == torch.int64 and layout.group_sizes.cpu().tolist() == sizes
    assert layout.row_of_pair.dtype == torch.int32 and layout.row_of_pair.cpu().tolist() == rows
    plain = backend.dispatch(x, ids, weights, e, validate=False).wait()
    laid = backend.dispatch(x, ids, weights, e, validate=False, layout=layout).wait()
    assert torch.equal(laid.group_sizes.cpu(), plain.group_sizes.cpu())
    assert torch.equal(laid.hidden.cpu(), plain.hidden.cpu())  # one token: every row is it, in any order
    assert laid.hidden_is_input and not plain.hidden_is_input  # its rows are x's own (MoE's settled_tail)
    y = torch.randn(plain.hidden.shape[0], 200, generator=gen).to(dev)
    assert torch.equal(backend.combine(laid, y).wait().cpu(), backend.combine(plain, y).wait().cpu())


def test_dispatch_rejects_a_layout_that_does_not_fit(backend, gen):
    from deepinfer.errors import InvalidInputError
    from deepinfer.ops import ExpertLayout

    dev = backend.device
    x = torch.randn(1, 16, generator=gen).to(dev)
    ids = torch.tensor([[3, 1]], device=dev)
    w = torch.rand(1, 2, generator=gen).to(dev)
    good_rows = torch.tensor([[1, 0]], dtype=torch.int32, device=dev)
    for bad in (ExpertLayout(torch.zeros(4, dtype=torch.int64, device=dev), good_rows),  # 4 sizes for 5 experts
                ExpertLayout(torch.zeros(5, dtype=torch.int64, device=dev), good_rows.long()),  # int64 rows
                ExpertLayout(torch.zeros(5, dtype=torch.int64, device=dev), good_rows[:, :1]),
                (torch.zeros(5, dtype=torch.int64, device=dev), good_rows)):
        with pytest.raises(InvalidInputError, match="layout"):
            backend.dispatch(x, ids, w, 5, validate=False, layout=bad)
