"""The pieces around the policy, in one process: routing onto replicas, the load recorder's window, the
rebalance trigger, migration plans, alignment, the MoE layer on a placement, and the engine's config checks."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError, InvalidInputError
from deepinfer.moe.migration import migrate_tensor, plan_migration
from deepinfer.moe.placement import ExpertPlacement, ModelPlacement, align_to, check_phy2log, imbalance
from deepinfer.moe.policy import EPLBConfig, RebalanceTrigger
from deepinfer.moe.recorder import ExpertLoadRecorder


def test_routing_splits_a_replicated_experts_tokens_evenly_and_deterministically():
    # 4 experts, 6 slots on 2 ranks: expert 1 has three replicas (slots 1, 3, 5), expert 2 one.
    phy2log = torch.tensor([0, 1, 2, 1, 3, 1])
    ids = torch.tensor([[1, 2], [1, 0], [1, 3], [2, 1], [1, 0], [1, 2], [3, 1]])
    for rank in range(2):
        p = ExpertPlacement.from_phy2log(phy2log, 4, 2, rank)
        phys = p.route(ids)
        assert torch.equal(phy2log[phys], ids)  # every choice lands on a replica of its expert
        counts = torch.bincount(phys[ids == 1], minlength=6)[[1, 3, 5]].tolist()
        assert sorted(counts) == [2, 2, 3]  # 7 choices of expert 1 over 3 replicas
        assert torch.equal(p.route(ids), phys)
    # Ranks start the round robin at different replicas, so the extra choice does not always hit slot 1.
    r0 = ExpertPlacement.from_phy2log(phy2log, 4, 2, 0).route(ids[:1])
    r1 = ExpertPlacement.from_phy2log(phy2log, 4, 2, 1).route(ids[:1])
    assert r0[0, 0] != r1[0, 0]
    assert ExpertPlacement.from_phy2log(torch.arange(4), 4, 2, 1).route(ids) is ids  # static: no remapping
    assert ExpertPlacement.from_phy2log(phy2log, 4, 2, 0).route(ids[:0]).shape == (0, 2)
    p = ExpertPlacement.from_phy2log(phy2log, 4, 2, 1)
    assert p.local_experts == (1, 3, 1) and p.first_slot == 3


def test_invalid_placements_are_refused():
    with pytest.raises(InvalidInputError):
        check_phy2log(torch.tensor([[0, 1, 1, 1]]), 3, 2)  # expert 2 has no slot
    with pytest.raises(InvalidInputError):
        check_phy2log(torch.tensor([[0, 1, 2]]), 3, 2)  # 3 slots on 2 ranks
    with pytest.raises(InvalidInputError):
        ExpertPlacement.from_phy2log(torch.tensor([0, 1]), 2, 2, 2)  # rank outside the group


def test_recorder_keeps_a_sliding_window():
    rec = ExpertLoadRecorder(num_layers=2, num_experts=4, window_size=3)
    for step in range(5):
        rec.record(0, torch.tensor([[step % 4, 0]]))
        rec.record(1, torch.empty(0, 2, dtype=torch.int64))
        rec.advance()
    # Steps 2, 3, 4 remain: experts 2, 3, 0 once each, plus expert 0 three times.
    assert rec.window_load()[0].tolist() == [4, 0, 1, 1]
    assert rec.window_load()[1].tolist() == [0, 0, 0, 0] and rec.steps == 5
    hook = rec.hook(1)
    hook(torch.tensor([[3, 3]]))
    assert rec.window_load()[1].tolist() == [0, 0, 0, 2]


def test_recorder_skips_padding_rows_and_dummy_forwards():
    rec = ExpertLoadRecorder(num_layers=1, num_experts=4, window_size=2)
    ids = torch.tensor([[1, 2], [3, 0], [3, 3]])
    rec.set_rows(1)  # a graph padded to 3 rows with 1 real one: only row 0 counts
    rec.record(0, ids)
    assert rec.window_load()[0].tolist() == [0, 1, 1, 0]
    rec.set_rows(3)
    rec.record(0, ids)
    assert rec.window_load()[0].tolist() == [1, 2, 2, 3]
    rec.discard_current()  # e.g. a capture's warm-up forward
    assert rec.window_load()[0].tolist() == [0, 0, 0, 0]
    rec.record(0, ids[:1])
    rec.advance()
    assert rec.window_load()[0].tolist() == [0, 1, 1, 0] and rec.steps == 1


def test_trigger_interval_and_threshold():
    trig = RebalanceTrigger(EPLBConfig(step_interval=4, imbalance_threshold=1.5, check_interval=2))
    assert [trig.tick() for _ in range(4)] == [None, "check", None, "interval"]
    static = torch.arange(4).repeat(1, 1)
    skewed = torch.tensor([[100.0, 1, 1, 1]])
    assert trig.worth_checking("check", static, skewed, 2)  # GPU 0 holds 101 of 103
    assert not trig.worth_checking("check", static, torch.tensor([[1.0, 1, 1, 1]]), 2)
    assert not trig.worth_checking("interval", static, torch.zeros(1, 4), 2)  # no load: no evidence
    better = torch.tensor([[0, 1, 0, 2, 0, 3]])  # hot expert 0 on both ranks... and twice on rank 0
    assert imbalance(better, skewed, 2) < imbalance(static, skewed, 2)
    assert trig.decide("check", static, better, skewed, 2) is not None
    assert trig.decide("interval", static, static, skewed, 2) is None  # never move to no better
    with pytest.raises(ConfigError):
        EPLBConfig(step_interval=0, imbalance_threshold=None)
    with pytest.raises(ConfigError):
        EPLBConfig(imbalance_threshold=0.5)


def test_migration_plan_prefers_local_copies_and_spreads_senders():
    old = [0, 1, 2, 3]  # rank 0: 0, 1; rank 1: 2, 3
    new = [0, 0, 0, 1]  # (not a valid placement, a plan test): rank 1 needs 0 and 1 from rank 0
    plan = plan_migration(old, new, 2)
    assert plan.sources == (((0, 0), (0, 0)), ((0, 0), (0, 1)))
    assert plan.transfers == 2 and plan.sends(0) == [[], [0, 1]]
    with pytest.raises(InvalidInputError):
        plan_migration([0, 1], [0, 2], 2)  # expert 2 is nowhere
    # One rank: a local permutation, bytes unchanged (any dtype).
    t = torch.randn(4, 3, 2).to(torch.float8_e4m3fn)
    moved = migrate_tensor(t, plan_migration([0, 1, 2, 3], [3, 2, 1, 0], 1), rank=0)
    assert torch.equal(moved.view(torch.uint8), t.flip(0).view(torch.uint8))


def test_align_keeps_experts_where_they_are():
    old = torch.tensor([[0, 1, 2, 3, 4, 5]])
    new = torch.tensor([[4, 5, 0, 1, 3, 2]])  # the same sets on other GPUs, in another order
    aligned = align_to(old, new, num_gpus=3)
    assert torch.equal(aligned, old)
    assert plan_migration(old[0].tolist(), aligned[0].tolist(), 3).transfers == 0
    # Nodes first: GPUs only trade places within a node.
    two_nodes = align_to(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[3, 2, 1, 0]]), num_gpus=4, num_nodes=2)
    assert torch.equal(two_nodes, torch.tensor([[0, 1, 2, 3]]))


def test_initial_placements():
    p = ModelPlacement.initial([1, 2], num_logical=8, num_physical=8, num_groups=2, num_nodes=1, num_ranks=4)
    assert torch.equal(p.phy2log, torch.arange(8).repeat(2, 1))  # plain EP split: experts in order
    p = ModelPlacement.initial([1, 2], num_logical=8, num_physical=12, num_groups=2, num_nodes=1, num_ranks=4)
    assert p.phy2log.shape == (2, 12) and p.slots_per_rank == 3
    assert p.layer(2, rank=3).num_physical == 12


def test_moe_layer_on_a_placement_matches_all_experts(backend, gen):
    """One process, redundant slots: routing onto replicas and stacking copies leaves the layer's output alone."""
    from deepinfer.model.mlp import GatedMLP, stack_experts
    from deepinfer.model.moe import MoE
    from deepinfer.ops import RoutingSpec
    from deepinfer.weights import LinearWeight

    e, h, i = 6, 16, 8
    dev = backend.device
    w = {(x, p): LinearWeight.dense((torch.randn(o, k, generator=gen) / k**0.5).to(dev))
         for x in range(e) for p, (o, k) in (("g", (i, h)), ("u", (i, h)), ("d", (h, i)))}
    def experts(held):
        return GatedMLP(backend, *(stack_experts([w[(x, p)] for x in held]) for p in "gud"))
    gate = torch.randn(e, h, generator=gen).to(dev)
    spec = RoutingSpec(num_experts=e, top_k=2, n_group=2, topk_group=1)
    plain = MoE(backend, spec, gate, None, experts(range(e)), None)
    placed_map = torch.tensor([0, 3, 1, 3, 2, 3, 4, 5])
    placement = ExpertPlacement.from_phy2log(placed_map, e, 1, 0, dev)
    placed = MoE(backend, spec, gate, None, experts(placement.local_experts), None, placement)
    x = torch.randn(11, h, generator=gen).to(dev)
    assert torch.allclose(placed.forward(x), plain.forward(x), atol=1e-5)
    assert placed.forward(x[:0]).shape == (0, h)  # an idle rank's empty batch

    # EPLB moves the experts in place: same tensors (captured decode graphs read their addresses), new values.
    from deepinfer.moe.migration import migrate_experts_in_place

    def addresses(layer):
        weights = [layer.experts.gate_up or layer.experts.gate, layer.experts.down]
        return [t.data_ptr() for wt in weights for t in (wt.data, wt.scale) if t is not None] + [
            t.data_ptr() for t in (layer.placement.phy2log, layer.placement.log2phy, layer.placement.logcnt)]

    before = addresses(placed)
    for new_map in (torch.tensor([5, 3, 3, 0, 1, 2, 4, 3]), torch.tensor([0, 1, 2, 3, 4, 5, 0, 0])):
        new = ExpertPlacement.from_phy2log(new_map, e, 1, 0, dev)  # 3 copies of expert 3, then of expert 0
        migrate_experts_in_place(placed.experts, plan_migration(placed.placement.phy2log.tolist(), new_map.tolist(), 1), 0)
        assert placed.set_placement(new)
        assert addresses(placed) == before and placed.placement.local_experts == tuple(new_map.tolist())
        assert torch.allclose(placed.forward(x), plain.forward(x), atol=1e-5)
    # From the identity map (routing skips the tables) a switch cannot be in place: the caller captures again.
    identity = MoE(backend, spec, gate, None, experts(range(e)), None, ExpertPlacement.from_phy2log(torch.arange(e), e, 1, 0, dev))
    shuffled = torch.tensor([5, 4, 3, 2, 1, 0])
    migrate_experts_in_place(identity.experts, plan_migration(list(range(e)), shuffled.tolist(), 1), 0)
    assert not identity.set_placement(ExpertPlacement.from_phy2log(shuffled, e, 1, 0, dev))
    assert torch.allclose(identity.forward(x), plain.forward(x), atol=1e-5)


def test_engine_config_eplb_checks():
    with pytest.raises(ConfigError, match="needs enable_eplb"):
        EngineConfig(model="m", num_redundant_experts=2, expert_parallel_size=2)
    with pytest.raises(ConfigError, match="expert_parallel_size >= 2"):
        EngineConfig(model="m", enable_eplb=True)
    with pytest.raises(ConfigError, match="needs a trigger"):
        EngineConfig(model="m", enable_eplb=True, expert_parallel_size=2, eplb_step_interval=0)
    ok = EngineConfig(model="m", enable_eplb=True, expert_parallel_size=4, num_redundant_experts=4,
                      eplb_imbalance_threshold=1.2, eplb_step_interval=0)
    assert ok.num_redundant_experts == 4


def test_single_process_engine_refuses_expert_parallel_size(tmp_path):
    from deepinfer.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="one engine per rank"):
        LLMEngine.from_config(EngineConfig(model=str(tmp_path), expert_parallel_size=2))
