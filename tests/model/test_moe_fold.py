"""Shared experts folded into the routed grouped GEMM (one process) against the separate shared MLP.

A shared MLP of intermediate size S * I is S experts of size I that every token takes with weight 1.0 (the
routed_scaling_factor scales routed experts only): the folded layer must give the separate layer's output up
to float rounding, in every weight format where the split is exact, and keep the separate MLP elsewhere.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer.model.deepseek import DecoderLayer
from deepinfer.model.mlp import GatedMLP, split_into_experts, stack_experts
from deepinfer.model.moe import MoE
from deepinfer.ops import RoutingSpec
from deepinfer.weights import LinearWeight

PROJ = ("gate_proj", "up_proj", "down_proj")
V3_GATE = RoutingSpec(num_experts=6, top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
V2_GATE = RoutingSpec(num_experts=6, top_k=3, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False,
                      routed_scaling_factor=1.7)


def _linear(gen, n: int, k: int, fmt: str, dtype: torch.dtype, dev) -> LinearWeight:
    t = torch.randn(n, k, generator=gen) / k**0.5
    w = LinearWeight.dense(t.to(dtype)) if fmt == "dense" else LinearWeight.quantize(t, fmt)
    return w.to(dev)


def _moe_weights(gen, spec: RoutingSpec, shared: int, h: int, inter: int, fmt: str, dtype, dev) -> dict:
    """One MoE layer's weights as DecoderLayer._build_moe takes them (HF names under `mlp.`, '.weight' dropped)."""
    w: dict[str, object] = {}
    for e in range(spec.num_experts):
        w[f"experts.{e}.gate_proj"] = _linear(gen, inter, h, fmt, dtype, dev)
        w[f"experts.{e}.up_proj"] = _linear(gen, inter, h, fmt, dtype, dev)
        w[f"experts.{e}.down_proj"] = _linear(gen, h, inter, fmt, dtype, dev)
    if shared:
        w["shared_experts.gate_proj"] = _linear(gen, shared * inter, h, fmt, dtype, dev)
        w["shared_experts.up_proj"] = _linear(gen, shared * inter, h, fmt, dtype, dev)
        w["shared_experts.down_proj"] = _linear(gen, h, shared * inter, fmt, dtype, dev)
    w["gate"] = (torch.randn(spec.num_experts, h, generator=gen) / h**0.5).to(dtype).to(dev)
    if spec.topk_method == "noaux_tc":
        w["gate.e_score_correction_bias"] = (torch.randn(spec.num_experts, generator=gen) * 0.1).to(dev)
    return w


def _config(spec: RoutingSpec, shared: int):
    return SimpleNamespace(n_routed_experts=spec.num_experts, n_shared_experts=shared, routing_spec=lambda: spec)


def _separate(backend, spec: RoutingSpec, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The routed-only layer plus the shared MLP on its own, summed in float32 (no fold, no combine add)."""
    stacked = {p: stack_experts([w[f"experts.{e}.{p}"] for e in range(spec.num_experts)]) for p in PROJ}
    routed = MoE(backend, spec, w["gate"], w.get("gate.e_score_correction_bias"),
                 GatedMLP(backend, *(stacked[p] for p in PROJ)), None)
    shared = GatedMLP(backend, *(w[f"shared_experts.{p}"] for p in PROJ))
    return routed.forward(x).float() + shared.forward(x).float()


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    got, want = got.double().cpu(), want.double().cpu()
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= rtol * float(want.abs().max()), float((got - want).abs().max())


# (format, activation dtype, intermediate size, tolerance relative to the output's largest value). FP8 needs
# I % 128 == 0 for the cut; its quantised activations are the same values either way (the per-token 128-wide
# groups of the shared intermediate fall inside one slice each). bf16: the separate layer rounds the routed
# sum, each shared output and their sums to bf16, the folded one rounds once: two bf16 ulps apart happen near
# the largest value (2 x 2^-7 of it at the top of a binade, over 1%: seen in CI with two shared slices), so 2%.
CASES = [("dense", torch.float32, 16, 1e-5), ("dense", torch.bfloat16, 24, 2e-2), ("fp8_block", torch.bfloat16, 128, 2e-2),
         ("nvfp4", torch.float32, 32, 1e-5)]


@pytest.mark.parametrize("fmt,dtype,inter,rtol", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("spec,shared", [(V3_GATE, 1), (V2_GATE, 2)], ids=["v3-1shared", "v2-2shared"])
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("apart", [False, True], ids=["in-grouped-gemm", "past-fold-max-tokens"])
def test_folded_shared_experts_match_separate(backend, gen, fmt, dtype, inter, rtol, spec, shared, tokens, apart):
    dev = backend.device
    h = 256 if fmt == "fp8_block" else 48
    w = _moe_weights(gen, spec, shared, h, inter, fmt, dtype, dev)
    folded = DecoderLayer._build_moe(backend, _config(spec, shared), w)
    assert folded.folded_shared == shared and folded.shared_experts is None
    assert folded.experts.down.num_groups == spec.num_experts + shared
    if apart:  # large batches: the slices run as plain GEMMs over views of the stacked weights
        folded.fold_max_tokens = tokens - 1
        assert folded._shared_slices[-1].down.data.data_ptr() == folded.experts.down.data[-1].data_ptr()
    x = torch.randn(tokens, h, generator=gen).to(dtype).to(dev)
    _close(folded.forward(x), _separate(backend, spec, w, x), rtol)


def test_folded_routes_and_load_hook(backend, gen):
    """Every token reaches each shared slice with weight 1.0; EPLB's hook sees only the routed choices."""
    dev = backend.device
    spec, shared = V3_GATE, 2
    w = _moe_weights(gen, spec, shared, 32, 16, "dense", torch.float32, dev)
    moe = DecoderLayer._build_moe(backend, _config(spec, shared), w)
    seen = []
    moe.load_hook = seen.append
    x = torch.randn(5, 32, generator=gen).to(dev)
    weights, ids, layout = moe._route(x, moe.folded_shared)
    assert ids.shape == (5, spec.top_k + shared) and layout is None  # (asked for none)
    # One token, sorted: cuda_sm100's one-launch gate lays the choices out over the routed and shared slices.
    _, one_ids, layout = moe._route(x[:1], moe.folded_shared, sort=True)
    assert (layout is not None) == (backend.name == "cuda_sm100")
    if layout is not None:
        assert layout.group_sizes.cpu().tolist() == [int((one_ids == e).sum()) for e in range(spec.num_experts + shared)]
    assert ids[:, spec.top_k:].cpu().tolist() == [[6, 7]] * 5 and bool((weights[:, spec.top_k:] == 1).all())
    moe.forward(x)
    moe.fold_max_tokens = 4
    moe.forward(x)
    assert [s.shape for s in seen] == [(5, spec.top_k)] * 2 and max(int(s.max()) for s in seen) < spec.num_experts
    assert moe.forward(x[:0]).shape == (0, 32)


def test_fold_only_where_the_cut_is_exact(gen):
    def mlp(fmt, inter, h, dtype=torch.float32):  # (gate, up, down) of intermediate size `inter`
        return [_linear(gen, inter, h, fmt, dtype, "cpu") for _ in range(2)] + [_linear(gen, h, inter, fmt, dtype, "cpu")]

    like = lambda fmt, inter, h, dtype=torch.float32: _linear(gen, inter, h, fmt, dtype, "cpu")  # noqa: E731
    assert split_into_experts(*mlp("fp8_block", 128, 256), like=like("fp8_block", 64, 256)) is None  # cuts a scale block
    pieces = split_into_experts(*mlp("fp8_block", 256, 256), like=like("fp8_block", 128, 256))
    assert pieces is not None and len(pieces) == 2 and pieces[1][2].in_features == 128
    assert split_into_experts(*mlp("dense", 32, 16), like=like("dense", 16, 16, torch.bfloat16)) is None  # dtypes differ
    assert split_into_experts(*mlp("dense", 32, 16), like=like("dense", 12, 16)) is None  # 32 % 12
    assert len(split_into_experts(*mlp("dense", 32, 16), like=like("dense", 8, 16))) == 4
    assert split_into_experts(*mlp("nvfp4", 16, 32), like=like("nvfp4", 8, 32)) is None  # an 8-column nvfp4 cut
    assert split_into_experts(*mlp("dense", 32, 16), like=like("fp8_block", 16, 16)) is None  # formats differ


def test_inexact_fold_keeps_the_shared_mlp(backend, gen):
    spec = V2_GATE
    w = _moe_weights(gen, spec, 2, 128, 64, "fp8_block", torch.bfloat16, backend.device)  # I = 64: no FP8 cut
    moe = DecoderLayer._build_moe(backend, _config(spec, 2), w)
    assert moe.folded_shared == 0 and moe.shared_experts is not None
    assert moe.experts.down.num_groups == spec.num_experts


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_loaded_model_folds_its_shared_experts(tiny_checkpoint, model_type):
    from deepinfer import LLM

    path, cfg = tiny_checkpoint(model_type)
    llm = LLM(str(path), backend="reference", dtype=torch.float32, progress=False)
    moe = llm.model.layers[1].mlp
    assert isinstance(moe, MoE) and moe.shared_experts is None and moe.folded_shared == cfg.n_shared_experts
