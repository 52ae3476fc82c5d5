"""benchmarks/eplb.py on DeepSeek-V3-shaped traces (256 experts, 8 groups, 32 GPUs on 4 nodes, 32 redundant
slots), shortened: on bursty traces EPLB with redundant experts cuts the busiest GPU's load by at least 60%
against static placement, and with redundant experts DeepInfer's placements are more balanced than the
published algorithm's under the same trigger on the same traces (without them the two tie)."""

from __future__ import annotations

import pytest

from deepinfer.moe.policy import EPLBConfig

from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def sim():
    return load_benchmark("eplb")


@pytest.mark.parametrize("trace", ["bursty", "zipf"])
def test_simulator_eplb_beats_static_and_the_published_policy(sim, trace, capsys):
    config = EPLBConfig(window_size=50, step_interval=500, imbalance_threshold=1.3, check_interval=10)
    rows = sim.run(trace, sim.Shape(layers=2), steps=500, config=config, seed=0, link_gbps=50.0)
    sim.print_table(trace, rows)
    print(capsys.readouterr().out)  # shown with -s
    static = rows["static"]
    ours = rows["EPLB +32 redundant (DeepInfer)"]
    theirs = rows["EPLB +32 redundant (published)"]
    assert static["max_load_cut"] == 0.0 and static["rebalances"] == 0
    if trace == "bursty":
        assert ours["max_load_cut"] >= 0.60
    assert ours["balancedness"] >= theirs["balancedness"]
    # Without spare slots both are pinned by the hottest expert's GPU (one expert cannot be split): they tie,
    # up to which light experts keep it company when the load moves (about 1e-3 either way across seeds).
    assert rows["EPLB (DeepInfer)"]["balancedness"] >= rows["EPLB (published)"]["balancedness"] - 2e-3
    # Rebalances were triggered by the threshold and each moved some experts, at a modelled cost.
    assert ours["rebalances"] >= 2 and ours["moved"] > 0 and ours["migration_ms"] > 0
    assert 0 < ours["step_time"] < 1.0
