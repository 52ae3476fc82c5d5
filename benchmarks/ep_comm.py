"""Expert-parallel dispatch and combine across the GPUs of one host: latency and bandwidth, next to the raw
all-to-all that moves the same bytes and DeepEP's published figures.

  python3 benchmarks/ep_comm.py [--world N] [--tokens 128 4096] [--hidden 7168] [--experts 256] [--top-k 8]
                                [--backends cuda_sm100 reference] [--iters 20] [--json FILE]
  python3 benchmarks/ep_comm.py --v2-lite   # the e2e model's MoE: hidden 2048, 64 experts top-6, 256 tokens/rank
  python3 benchmarks/ep_comm.py --smoke     # 2 CPU ranks on gloo, tiny shapes: this script's flow only

Spawns N ranks, one GPU each, over NCCL (NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and the variables the
device README names are set before anything starts). Each rank routes T tokens (top_k of E experts drawn
uniformly, experts split evenly over the ranks) through `backend.dispatch` and `backend.combine`: the path the
MoE layer takes under expert parallelism, with identity experts. Each backend in --backends is measured in the
same run (cuda_sm100: one row per (token, destination rank) with its routing attached, buffers sized from
exchanged counts; "cuda_sm100 fixed": buffers of T rows per rank, no host sync; "cuda_sm100 graphed": the
fixed path captured in CUDA graphs, as the engine's decode graphs run it; reference: one row per (token, expert)
pair). Timed per iteration after a barrier, the slowest rank's time, median over --iters:
- dispatch alone, combine alone, and dispatch + combine;
- the peer: one `all_to_all_single` of the bytes cuda_sm100's dispatch sends (what the NCCL transport alone
  costs for them), eager, and captured in a CUDA graph for the graphed rows.
Bytes, as DeepEP counts them: one bf16 hidden row per token and remote rank it must reach; GB/s = the most
bytes any rank sends / time. DeepEP's published figures (issue 13): intranode dispatch 153 GB/s on H800;
low-latency dispatch 77 us at EP8 (128 tokens per rank, hidden 7168, top-8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value  # multicast off, here and in every spawned rank (they inherit the environment)


def _routing(gen: torch.Generator, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen)
    return ids, weights / weights.sum(-1, keepdim=True)


def _rank(rank: int, args: argparse.Namespace, store: str) -> None:
    import torch.distributed as dist

    from deepinfer.registry import load_backend

    dev = load_backend(args.backends[0]).device
    if dev.type == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    backends = {name: load_backend(name, device=str(dev)) for name in args.backends}
    nccl = dev.type == "cuda"
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    # A gloo group for the host-side timing reduction (NCCL would need a device tensor and a sync).
    host = dist.new_group(backend="gloo") if nccl else None
    results, graphs = [], []  # graphs hold captured NCCL kernels: reset before the group goes (pytorch#115388)
    try:
        for tokens in args.tokens:
            gen = torch.Generator().manual_seed(1000 * rank + tokens)
            x = torch.randn(tokens, args.hidden, generator=gen).to(torch.bfloat16).to(dev)
            ids, weights = (t.to(dev) for t in _routing(gen, tokens, args.experts, args.top_k))
            local = args.experts // args.world
            reached = torch.zeros(tokens, args.world, dtype=torch.bool, device=dev).scatter_(1, ids // local, True)
            remote_rows = int(reached.sum() - reached[:, rank].sum())  # (token, remote rank) pairs
            # The peer: equal splits of every row this rank's dispatch sends (its own share included).
            per_peer = torch.tensor([-(-int(reached.sum()) // args.world)])
            dist.all_reduce(per_peer, op=dist.ReduceOp.MAX, group=host)  # equal splits need one size everywhere
            send = x.new_empty(int(per_peer) * args.world, args.hidden).normal_()
            recv = torch.empty_like(send)
            # the most bytes any rank sends to the others
            b = torch.tensor([remote_rows * args.hidden * 2], dtype=torch.float64)
            dist.all_reduce(b, op=dist.ReduceOp.MAX, group=host)
            row = {"tokens": tokens, "remote_rows": remote_rows, "bytes": float(b),
                   "all_to_all": _timed(lambda: dist.all_to_all_single(recv, send), dev, args.iters, host)}
            if nccl:  # the transport alone inside a CUDA graph: the peer of the graphed rows below
                graph = torch.cuda.CUDAGraph()
                graphs.append(graph)
                with torch.cuda.graph(graph):
                    dist.all_to_all_single(recv, send)
                row["all_to_all graphed"] = _timed(graph.replay, dev, args.iters, host)
            for name, (backend, capacity) in _variants(backends, tokens).items():
                pending = {}

                def dispatch():
                    pending["d"] = backend.dispatch(x, ids, weights, args.experts, validate=False, capacity=capacity).wait()

                def combine():
                    backend.combine(pending["d"], pending["d"].hidden).wait()

                def both():
                    d = backend.dispatch(x, ids, weights, args.experts, validate=False, capacity=capacity).wait()
                    backend.combine(d, d.hidden).wait()

                for step, fn in (("dispatch", dispatch), ("combine", combine), ("dispatch+combine", both)):
                    if step == "combine":
                        dispatch()
                    row[f"{name} {step}"] = _timed(fn, dev, args.iters, host)
                if name == "cuda_sm100 fixed" and dev.type == "cuda":
                    row.update(_graphed(backend, x, ids, weights, args, tokens, dev, host, graphs))
                if args.profile and rank == 0:
                    _profile(both, dev, f"{name}, {tokens} tokens/rank: dispatch + combine x 5")
                elif args.profile:
                    for _ in range(5):
                        both()
            results.append(row)
        if rank == 0:
            with open(f"{store}.out", "w") as fh:
                json.dump(results, fh)
        dist.barrier()
    finally:
        if nccl:
            torch.cuda.synchronize(dev)
        for graph in graphs:
            graph.reset()
        dist.destroy_process_group()


def _variants(backends: dict, tokens: int) -> dict:
    """name -> (backend, dispatch capacity): each backend with buffers sized from exchanged counts, and
    cuda_sm100 also with fixed buffers of `tokens` rows per rank (no host sync; where ep_comm allows it)."""
    out = {name: (backend, None) for name, backend in backends.items()}
    if "cuda_sm100" in backends:
        out["cuda_sm100 fixed"] = (backends["cuda_sm100"], tokens)
    return out


def _graphed(backend, x, ids, weights, args, capacity: int, dev, host, graphs: list) -> dict:
    """The fixed-capacity dispatch and combine captured in CUDA graphs (as the engine's decode graphs hold
    them): device time with no host work. Every rank captures the same calls together; `graphs` keeps them."""
    d = backend.dispatch(x, ids, weights, args.experts, validate=False, capacity=capacity).wait()
    backend.combine(d, d.hidden).wait()  # compiled and warm outside the capture
    torch.cuda.synchronize(dev)
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    graphs += [gd, gc]
    with torch.cuda.graph(gd):
        d = backend.dispatch(x, ids, weights, args.experts, validate=False, capacity=capacity).wait()
    with torch.cuda.graph(gc):
        backend.combine(d, d.hidden).wait()
    torch.cuda.synchronize(dev)
    both = lambda: (gd.replay(), gc.replay())  # noqa: E731
    return {f"cuda_sm100 graphed {step}": _timed(fn, dev, args.iters, host)
            for step, fn in (("dispatch", gd.replay), ("combine", gc.replay), ("dispatch+combine", both))}


def _profile(fn, dev: torch.device, title: str) -> None:
    """Rank 0's host and device time per operator over 5 calls (the other ranks run the same calls)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    print(f"## {title}\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50),
          flush=True)


def _timed(fn, dev: torch.device, iters: int, host) -> float:
    """Median over iters of the slowest rank's seconds for fn() (after a barrier, the device synchronised)."""
    import torch.distributed as dist

    times = []
    for i in range(iters + 3):  # the first calls warm up the transport
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier(group=host)
        start = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host)  # the slowest rank sets the step
        if i >= 3:
            times.append(float(t))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every visible GPU)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096], help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--backends", nargs="+", default=["cuda_sm100", "reference"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="rank 0's operator table of dispatch + combine per backend")
    ap.add_argument("--v2-lite", action="store_true", help="DeepSeek-V2-Lite's MoE shape at decode batch 256")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.v2_lite:
        args.tokens, args.hidden, args.experts, args.top_k = [256], 2048, 64, 6
    if args.smoke:
        args.world, args.tokens, args.hidden, args.experts, args.top_k = 2, [8, 32], 64, 16, 4
        args.iters = 3
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            args.backends = ["reference"]  # cuda_sm100 runs on the CPU only under the Triton interpreter
    args.world = args.world or torch.cuda.device_count()
    if args.world < 2:
        print("ep_comm: needs at least 2 ranks (GPUs); --smoke runs 2 CPU ranks")
        return 1
    if args.experts % args.world:
        print(f"ep_comm: --experts {args.experts} must divide over {args.world} ranks")
        return 1
    store = f"/tmp/ep_comm_{os.getpid()}"
    print(f"# ep_comm: {args.world} ranks, hidden {args.hidden}, {args.experts} experts top-{args.top_k}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    mp.start_processes(_rank, args=(args, store), nprocs=args.world, start_method="spawn")
    with open(f"{store}.out") as fh:
        results = json.load(fh)
    print("| tokens/rank | backend | dispatch us | combine us | dispatch+combine us | all_to_all us (same bytes) | "
          "dispatch GB/s | all_to_all GB/s | dispatch time / all_to_all |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        gbs = lambda s: r["bytes"] / s / 1e9  # noqa: E731
        for name in [n for n in r if n.endswith(" dispatch")]:
            name = name[: -len(" dispatch")]
            d, c, dc = (r[f"{name} {step}"] for step in ("dispatch", "combine", "dispatch+combine"))
            a2a = r.get("all_to_all graphed", r["all_to_all"]) if "graphed" in name else r["all_to_all"]
            print(f"| {r['tokens']} | {name} | {d * 1e6:.1f} | {c * 1e6:.1f} | {dc * 1e6:.1f} | "
                  f"{a2a * 1e6:.1f} | {gbs(d):.1f} | {gbs(a2a):.1f} | {d / a2a:.2f} |")
    print("DeepEP (H800, issue 13): intranode dispatch 153 GB/s; low-latency dispatch 77 us at EP8, 128 tokens.")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), results=results), fh, indent=1)
    for suffix in ("", ".out"):
        if os.path.exists(store + suffix):
            os.unlink(store + suffix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
