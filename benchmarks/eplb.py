"""EPLB trace simulator: how evenly expert placements spread MoE load over GPUs on synthetic routing traces.

    python benchmarks/eplb.py                      # DeepSeek-V3 shape: 256 experts, 8 groups, 32 GPUs on 4 nodes
    python benchmarks/eplb.py --steps 600 --layers 2 --trace bursty

Traces are per-step, per-layer token counts per expert (tokens * top_k choices, Poisson noise):
- zipf: popularity ~ 1 / rank^skew over a random expert order; every `drift` steps the 16 hottest ranks move
  to other experts (hot experts wander);
- bursty: a mildly skewed base (Zipf 0.6) plus a few bursts per layer, each sending a 5-20% share of all
  choices to one expert for 150-600 steps, then moving to another expert.

Placements, all re-planned every `interval` steps from the last `window` steps of load (as the engine's
recorder and trigger do) and scored on the steps that follow (they never see the future):
static (experts in order, E/G per GPU), EPLB and EPLB + redundant experts, each both as DeepInfer's
`deepinfer.moe.eplb.rebalance_experts` and as the published algorithm (benchmarks/eplb_published.py).
A replicated expert's tokens split evenly over its replicas (what the engine's routing does).

Reported per placement: balancedness = mean over max per-GPU load (1.0 is perfect), modelled MoE step time
= sum over layers of the busiest GPU's load (relative to static), the reduction of the max per-GPU load
against static, and migration cost per rebalance: expert copies moved between GPUs and the modelled time to
move them (DeepSeek-V3 FP8 expert: 3 x 7168 x 2048 bytes + scales, at --link-gbps per GPU). Scores count
from the first rebalance on, so every placement is judged on the same steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.moe.eplb import rebalance_experts
from deepinfer.moe.migration import plan_migration
from deepinfer.moe.placement import align_to, gpu_loads
from deepinfer.moe.policy import EPLBConfig, RebalanceTrigger


def _load_published():
    """The published baseline from the file beside this one (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parent / "eplb_published.py"
    spec = importlib.util.spec_from_file_location("eplb_published", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.published_rebalance


published_rebalance = _load_published()

EXPERT_BYTES = 3 * 7168 * 2048 * (1 + 4 / 128**2)  # FP8 gate/up/down of one DeepSeek-V3 expert + block scales


@dataclass(frozen=True)
class Shape:
    experts: int = 256
    groups: int = 8
    top_k: int = 8
    layers: int = 4
    gpus: int = 32
    nodes: int = 4
    redundant: int = 32
    tokens: int = 8192  # tokens per step over all GPUs


def zipf_trace(shape: Shape, steps: int, seed: int, skew: float = 1.0, drift: int = 200) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = shape.experts
    base = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** skew
    base /= base.sum()
    out = torch.empty(steps, shape.layers, e)
    for layer in range(shape.layers):
        order = torch.randperm(e, generator=g)
        for t in range(steps):
            if t and t % drift == 0:  # the hottest ranks move to other experts
                for k, j in enumerate(torch.randperm(e, generator=g)[:16].tolist()):
                    order[[k, j]] = order[[j, k]]
            p = torch.empty(e, dtype=torch.float64)
            p[order] = base
            out[t, layer] = torch.poisson((p * shape.tokens * shape.top_k).float(), generator=g)
    return out


def bursty_trace(shape: Shape, steps: int, seed: int, bursts: int = 3, share: tuple[float, float] = (0.05, 0.2),
                 duration: tuple[int, int] = (150, 600)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = shape.experts
    rand = lambda lo, hi: lo + (hi - lo) * float(torch.rand((), generator=g))  # noqa: E731
    base = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 0.6
    base /= base.sum()
    out = torch.empty(steps, shape.layers, e)
    for layer in range(shape.layers):
        p_base = torch.empty(e, dtype=torch.float64)
        p_base[torch.randperm(e, generator=g)] = base
        live = []  # [expert, share, end step]
        for t in range(steps):
            live = [b for b in live if b[2] > t]
            while len(live) < bursts:
                live.append([int(torch.randint(e, (), generator=g)), rand(*share), t + int(rand(*duration))])
            p = p_base * (1.0 - sum(b[1] for b in live))
            for expert, s, _ in live:
                p[expert] += s
            out[t, layer] = torch.poisson((p * shape.tokens * shape.top_k).float(), generator=g)
    return out


@dataclass
class Score:
    balancedness: list[float]
    max_load: list[float]
    moved: list[int]  # expert copies moved between GPUs at each rebalance (all layers)
    max_received: list[int]  # the most copies any one GPU received at a rebalance (its transfer time)


def _moves(old: torch.Tensor, new: torch.Tensor, gpus: int) -> tuple[int, int]:
    total, received = 0, torch.zeros(gpus, dtype=torch.int64)
    for row in range(old.shape[0]):
        plan = plan_migration(old[row].tolist(), new[row].tolist(), gpus)
        total += plan.transfers
        for r, slots in enumerate(plan.sources):
            received[r] += sum(src != r for src, _ in slots)
    return total, int(received.max())


def simulate(trace: torch.Tensor, shape: Shape, policy: str, redundant: int, config: EPLBConfig) -> Score:
    """Score one placement policy ("static", "deepinfer", "published") on `trace` [steps, layers, E], re-planned
    by the engine's own trigger (deepinfer.moe.policy) on a window of the last `config.window_size` steps."""
    steps, layers, e = trace.shape
    slots = e + redundant
    phy2log = torch.arange(e).repeat(layers, 1) if redundant == 0 else None
    score = Score([], [], [], [])
    trigger = RebalanceTrigger(config)
    window = config.window_size
    for t in range(steps):
        reason = trigger.tick() if t >= window else None
        if policy != "static" and (reason is not None or (t == window and phy2log is None)):
            load = trace[t - window : t].sum(0)
            if reason == "interval":
                trigger.rebalanced()
            if phy2log is not None and not trigger.worth_checking(reason, phy2log, load, shape.gpus):
                new = None
            elif policy == "deepinfer":
                new, _, _ = rebalance_experts(load, slots, shape.groups, shape.nodes, shape.gpus)
                new = align_to(phy2log, new, shape.gpus, shape.nodes) if phy2log is not None else new
            else:
                new = published_rebalance(load, slots, shape.groups, shape.nodes, shape.gpus)
            if new is not None and phy2log is not None and not trigger.decide(reason, phy2log, new, load, shape.gpus):
                new = None
            if new is not None:
                if phy2log is not None:
                    moved, worst = _moves(phy2log, new, shape.gpus)
                    score.moved.append(moved)
                    score.max_received.append(worst)
                phy2log = new
                trigger.rebalanced()
        if t < window or phy2log is None:
            continue  # warm-up: scored from the first rebalance on
        per_gpu = gpu_loads(phy2log, trace[t], shape.gpus)
        score.balancedness += (per_gpu.mean(-1) / per_gpu.amax(-1).clamp(min=1e-9)).tolist()
        score.max_load.append(float(per_gpu.amax(-1).sum()))
    return score


def run(trace_name: str, shape: Shape, steps: int, config: EPLBConfig, seed: int, link_gbps: float) -> dict[str, dict[str, float]]:
    make = zipf_trace if trace_name == "zipf" else bursty_trace
    trace = make(shape, steps, seed)
    rows = {}
    plans = [("static", "static", 0), ("EPLB (published)", "published", 0), ("EPLB (DeepInfer)", "deepinfer", 0),
             (f"EPLB +{shape.redundant} redundant (published)", "published", shape.redundant),
             (f"EPLB +{shape.redundant} redundant (DeepInfer)", "deepinfer", shape.redundant)]
    static_max = None
    for name, policy, redundant in plans:
        s = simulate(trace, shape, policy, redundant, config)
        mean_max = sum(s.max_load) / len(s.max_load)
        static_max = static_max or mean_max
        rebalances = len(s.moved)
        moved = sum(s.moved) / len(s.moved) if s.moved else 0.0
        worst = sum(s.max_received) / len(s.max_received) if s.max_received else 0.0
        rows[name] = {
            "balancedness": sum(s.balancedness) / len(s.balancedness),
            "step_time": mean_max / static_max,
            "max_load_cut": 1.0 - mean_max / static_max,
            "rebalances": rebalances,
            "moved": moved,
            "migration_ms": worst * EXPERT_BYTES / (link_gbps * 1e9) * 1e3,
        }
    return rows


def print_table(trace_name: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\ntrace: {trace_name}")
    print(f"{'placement':<36} {'balancedness':>12} {'step time':>10} {'max load cut':>13} {'rebalances':>10} "
          f"{'moved/rebal':>12} {'migr. ms':>9}")
    for name, r in rows.items():
        print(f"{name:<36} {r['balancedness']:>12.3f} {r['step_time']:>10.3f} {r['max_load_cut']:>12.1%} "
              f"{r['rebalances']:>10d} {r['moved']:>12.1f} {r['migration_ms']:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", choices=["zipf", "bursty", "both"], default="both")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--window", type=int, default=50, help="steps of load each rebalance sees")
    p.add_argument("--interval", type=int, default=500, help="rebalance at least every this many steps")
    p.add_argument("--threshold", type=float, default=1.3, help="also rebalance when busiest/mean GPU load exceeds it (0: off)")
    p.add_argument("--check", type=int, default=10, help="steps between imbalance checks")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--redundant", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step over all GPUs")
    p.add_argument("--link-gbps", type=float, default=50.0, help="per-GPU bandwidth for migration, GB/s")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    shape = Shape(a.experts, a.groups, 8, a.layers, a.gpus, a.nodes, a.redundant, a.tokens)
    print(f"{a.experts} experts in {a.groups} groups, top-8, {a.layers} layers, {a.gpus} GPUs on {a.nodes} nodes, "
          f"{a.tokens} tokens/step, {a.steps} steps; rebalance on a {a.window}-step window every {a.interval} steps"
          + (f" or when imbalance > {a.threshold} (checked every {a.check})" if a.threshold else ""))
    config = EPLBConfig(window_size=a.window, step_interval=a.interval, imbalance_threshold=a.threshold or None,
                        check_interval=a.check)
    for name in (["zipf", "bursty"] if a.trace == "both" else [a.trace]):
        rows = run(name, shape, a.steps, config, a.seed, a.link_gbps)
        print_table(name, rows)
        ours = [r for n, r in rows.items() if "DeepInfer" in n]
        theirs = [r for n, r in rows.items() if "published" in n]
        for o, t, label in zip(ours, theirs, ("no redundancy", f"+{a.redundant} redundant")):
            print(f"  {label}: balancedness DeepInfer {o['balancedness']:.3f} vs published {t['balancedness']:.3f} "
                  f"({o['balancedness'] - t['balancedness']:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
