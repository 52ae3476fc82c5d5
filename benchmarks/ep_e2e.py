"""Expert parallelism end to end on one host (issue 13): e2e.py's V2-Lite-shaped MoE with its routed experts
split over N GPUs, next to the same model on one GPU, in one run.

    python benchmarks/ep_e2e.py [--world N] [--batch 256] [--context 1024] [--gen 64] [--backend cuda_sm100]
                                [--phases peer ep eplb] [--peer-json FILE] [--timeout 500] [--json OUT]
    python benchmarks/ep_e2e.py --smoke   # 2 CPU ranks on gloo, reference backend, e2e.py's TINY shape

NVLink multicast is off (NCCL_NVLS_ENABLE=0 and the others, set at import, inherited by spawned processes).
Phases run in spawned processes, killed past --timeout s; each builds the model with transformers (same --seed:
same weights everywhere) and DeepInfer loads it from memory, a rank only its experts. Printed (markdown):
- peer (GPU 0, no EP, exits before the ranks start): decode tok/s of --batch requests of --context random
  tokens, with CUDA graphs + overlapped scheduling (the defaults) and eager without overlap (enforce_eager and
  overlap_scheduling=False: the EP engine's eager mode, --ep-modes eager).
- ep (N ranks, --batch requests each): lockstep ExpertParallelEngine.step() until every request has its first
  token, then --gen decode steps timed at full batch. Per rank and overall: decode tok/s per GPU, total, median
  step ms, ratio to the peer, rows its experts received, host s in dispatch/combine (their size exchange syncs
  the device: includes waiting on compute). Then --profile-steps steps under torch.profiler: NCCL kernel time
  over wall time, and the part launched in dispatch / combine.
- eplb: the router's e_score_correction_bias of --hot-experts experts per layer (default top_k // 2, all on
  rank 0) raised by --skew-bias (sigmoid scores lie in (0, 1): 1.0 puts them in every top-k, 50% of routed
  pairs); EPLB with --redundant slots (default 2N). --gen steps timed on the initial placement,
  ep.rebalance() on every rank, --gen more on the same requests: experts moved, modelled imbalance
  (RebalanceEvent), measured rows per rank max/mean, tok/s, before and after.
Ranks write results to files in a temp folder; this process prints them (--json: everything). Under a 10-minute
command limit: `--phases peer --json peer.json`, then `--phases ep eplb --peer-json peer.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value  # multicast off, here and in every spawned process (they inherit the environment)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402

EAGER_FIELDS = dict(enforce_eager=True, overlap_scheduling=False)  # --ep-modes eager
SMOKE = dict(world=2, backend="reference", batch=6, context=24, gen=6, chunk=64, profile_steps=3)


# --- stepping and timing -------------------------------------------------------------------------------------
class Solo:
    """One process: the engine's own steps, nothing to agree on, nothing metered."""

    meter = None

    def __init__(self, engine):
        self.engine, self.device = engine, engine.backend.device

    def step(self) -> list:
        return self.engine.step()

    def agree(self, flag: bool) -> bool:
        return flag

    def snapshot(self) -> dict:
        return {}

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()


class Lockstep(Solo):
    """One rank of an ExpertParallelEngine: collective steps; agree() is an AND over the ranks (and a barrier).
    The backend's dispatch/combine are wrapped on the instance (the MoE layers call them there): host seconds in
    the calls and their waits, rows this rank's experts received, profiler ranges while `annotate`."""

    def __init__(self, ep):
        from deepinfer.backend import Pending

        super().__init__(ep.engine)
        self.ep, self.annotate, self.meter = ep, False, {}
        backend, calls = ep.engine.backend, {"dispatch": ep.engine.backend.dispatch, "combine": ep.engine.backend.combine}

        def timed(kind, fn, *a, **k):
            t = time.perf_counter()
            with torch.profiler.record_function(f"ep_{kind}") if self.annotate else contextlib.nullcontext():
                out = fn(*a, **k)
            self.meter[kind] += time.perf_counter() - t
            return out

        def wrap(kind):
            def call(*a, **k):  # the collective starts now, as in the backend's call; the wait is timed apart
                pending = timed(kind, calls[kind], *a, **k)

                def finish():
                    value = timed(kind, pending.wait)
                    if kind == "dispatch":  # routed pairs (fixed-capacity dispatch pads hidden past them); no sync
                        self._rows += value.group_sizes.sum()
                    return value
                return Pending(finish)
            return call

        backend.dispatch, backend.combine = wrap("dispatch"), wrap("combine")
        self.reset()

    def reset(self) -> None:
        self.meter.update(dispatch=0.0, combine=0.0)
        self._rows = torch.zeros((), dtype=torch.int64, device=self.device)

    def snapshot(self) -> dict:
        return dict(self.meter, rows=int(self._rows))

    def step(self) -> list:
        return self.ep.step() or []

    def agree(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.ep.ctx.cpu_group)
        return bool(t.item())

    def drain(self) -> None:
        self.ep.run_until_done()


class _StallWatch:
    """Two usual suspects of a long step, counted over a window: Python's garbage collector (ms spent) and the
    CUDA caching allocator freeing its cache to retry a failed allocation (retries)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.gc_s, self._t = device, 0.0, 0.0
        self._retries = self._alloc_retries()
        gc.callbacks.append(self._on_gc)

    def _alloc_retries(self) -> int:
        return torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0) if self.device.type == "cuda" else 0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._t

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def report(self) -> dict:
        return dict(gc_ms=round(self.gc_s * 1e3, 1), alloc_retries=self._alloc_retries() - self._retries)


def _max_tokens(args, windows: int) -> int:
    """Enough that no request ends before the last window (and the profile): requests prefilled in the first
    chunks decode while later ones prefill, at most ~2 steps per chunk of the whole batch's prompts."""
    return 2 * -(-args.batch * (args.context + 1) // args.chunk) + 4 + windows * (args.gen + args.profile_steps + 2) + 4


def run_batch(run: Solo, args, tag: str, windows: int = 1, between=None, profile: bool = False) -> dict:
    """Add --batch requests of --context random tokens; step until every one (on every rank) has its first
    token; time `windows` windows of --gen decode steps at full batch (between() runs before each later window);
    optionally profile --profile-steps more; abort and drain. between(w) runs before window w > 0."""
    from deepinfer.engine.sampling_params import SamplingParams

    engine, gen = run.engine, torch.Generator().manual_seed(args.seed + 7919 * args.rank_seed)
    max_tokens = _max_tokens(args, windows)
    if not run.agree(e2e.fits(engine, args.batch, args.context, max_tokens)):
        return {"skipped": f"{args.batch} x {args.context + max_tokens} tokens do not fit a rank's cache "
                           f"({engine.num_cache_tokens} tokens here)"}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(args.batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(2, engine.config.vocab_size, (args.context,), generator=gen).tolist(), params)
    first: set[str] = set()
    started = time.perf_counter()
    while not run.agree(len(first) == len(ids)):
        first.update(o.request_id for o in run.step() if o.outputs[0].token_ids)
    out: dict = {"prefill_s": time.perf_counter() - started, "windows": []}
    for w in range(windows):
        if w and between is not None:
            between(w)
        e2e.sync(run.device)
        run.agree(True)  # the ranks start the window together
        before, steps = engine.stats().generated_tokens, []
        if run.meter is not None:
            run.reset()
        stalls = _StallWatch(run.device)
        t0 = time.perf_counter()
        for _ in range(args.gen):
            t = time.perf_counter()
            run.step()
            steps.append(time.perf_counter() - t)
        e2e.sync(run.device)
        seconds = time.perf_counter() - t0
        stalls.close()
        tokens = engine.stats().generated_tokens - before
        slowest = sorted(range(len(steps)), key=steps.__getitem__)[-3:][::-1]  # where a window's time went
        out["windows"].append(dict(tokens=tokens, seconds=seconds, tok_s=tokens / seconds, running=engine.stats().running,
                                   median_step_ms=statistics.median(steps) * 1e3,
                                   slowest_steps_ms=[(i, round(steps[i] * 1e3, 1)) for i in slowest], **stalls.report(),
                                   **run.snapshot()))
        if profile and args.profile_steps:
            for _ in range(2):  # warm again after the window, outside the profile
                run.step()
            out["windows"][-1]["profile"] = profile_steps(run, args.profile_steps)
            # The profiler's events hold reference cycles that only a full collection frees: collect them here,
            # or the next timed window pays for it (66-99 ms steps on 2 H200s, 88-142 ms of GC per window).
            gc.collect()
    for rid in ids:
        engine.abort(rid)
    run.drain()
    return out


def profile_steps(run: Lockstep, n: int) -> dict:
    """n decode steps under torch.profiler: NCCL kernel time (gloo op time on the CPU) and the wall time, with
    the part from dispatch / combine."""
    from torch.autograd import DeviceType

    on_gpu = run.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    is_comm = (lambda name: "nccl" in name.lower()) if on_gpu else (lambda name: name.lower().startswith("gloo:"))
    run.annotate = True
    run.reset()
    try:
        with torch.profiler.profile(activities=acts) as prof:
            e2e.sync(run.device)
            t0 = time.perf_counter()
            for _ in range(n):
                run.step()
            e2e.sync(run.device)
            wall = time.perf_counter() - t0
    finally:
        run.annotate = False
    events = prof.events()
    ranges = sorted(((e.time_range.start, e.name[3:], e) for e in events if e.name in ("ep_dispatch", "ep_combine")),
                    key=lambda r: r[0])
    part = {"dispatch": 0.0, "combine": 0.0}
    if on_gpu:  # a kernel belongs to the host op that launched it: those in a range's subtree are the range's
        def comm_us(e) -> float:
            return sum(k.duration for k in e.kernels if is_comm(k.name)) + sum(comm_us(c) for c in e.cpu_children)

        kernels = [e for e in events if e.device_type != DeviceType.CPU]
        total = sum(e.time_range.elapsed_us() for e in kernels if is_comm(e.name))
        busy = sum(e.time_range.elapsed_us() for e in kernels if not is_comm(e.name))  # compute, not waiting
        for _, kind, e in ranges:
            part[kind] += comm_us(e)
    else:  # gloo runs on its own thread: an op belongs to the last range begun before it
        comm = [e for e in events if is_comm(e.name)]
        total = sum(e.cpu_time_total for e in comm)
        busy = float("nan")
        for e in comm:
            for start, kind, _ in reversed(ranges):
                if start <= e.time_range.start:
                    part[kind] += e.cpu_time_total
                    break
    return dict(steps=n, wall_s=wall, comm_s=total / 1e6, compute_s=busy / 1e6, dispatch_comm_s=part["dispatch"] / 1e6,
                combine_comm_s=part["combine"] / 1e6, host_s=run.meter["dispatch"] + run.meter["combine"],
                kind="NCCL kernel" if on_gpu else "gloo op")


# --- the processes ---------------------------------------------------------------------------------------------
def _setup(args, rank: int):
    device = "cpu"
    if torch.cuda.is_available() and not args.smoke:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    if args.smoke:
        torch.set_num_threads(1)  # 2 ranks on a small CPU: one intra-op thread each
    args.rank_seed = rank
    args.device_name = torch.cuda.get_device_name(rank) if device != "cpu" else "CPU"
    return device, (torch.float32 if device == "cpu" else torch.bfloat16)


def _shape(args) -> dict:
    shape = e2e.TINY if args.smoke else e2e.V2_LITE
    return dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], args.max_model_len))


def _write(path: str, results: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)  # whole, even if the process is killed later


def _free(device: str, serving: bool = False) -> None:
    """Free what was dropped (the engine and its expert-parallel wrapper refer to each other: a cycle, so the
    heap is unfrozen first); serving: then freeze the heap as deepinfer-serve does once an engine is built."""
    from deepinfer.engine.heap import freeze_startup_heap

    gc.unfreeze()
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()
    if serving:
        freeze_startup_heap()


def _peer(_, args, out: str) -> None:
    """One GPU, no expert parallelism: graphs + overlap (the defaults), then eager without overlap."""
    device, dtype = _setup(args, 0)
    hf, cfg = e2e.build_transformers(_shape(args), device, dtype, args.seed)
    ns = argparse.Namespace(backend=args.backend, tiny=args.smoke, batches=[args.batch], chunk=args.chunk,
                            kv_cache_dtype=None, kv_cache_fraction=args.kv_cache_fraction, enforce_eager=False)
    engine = e2e.build_engine(hf, cfg, ns, None, args.max_model_len)
    del hf
    _free(device, serving=True)
    run = Solo(engine)
    results = {"device": args.device_name, "graphs": run_batch(run, args, "peer-graphs")}
    _write(out, results)
    engine.runner.graphs = None  # as e2e.profile_eager_step: the eager path of the same engine
    engine.engine_config = engine.engine_config.model_copy(update={"overlap_scheduling": False})
    results["eager"] = run_batch(run, args, "peer-eager")
    _write(out, results)


def _build_ep(args, ctx, device, dtype, hot: dict | None = None, **fields):
    """This rank's ExpertParallelEngine over the transformers model, whose router's correction bias is first
    raised by --skew-bias for hot[layer] experts; `fields`: EngineConfig fields. The transformers model is freed."""
    from deepinfer.config import EngineConfig, ModelConfig
    from deepinfer.engine.expert_parallel import build_engine
    from deepinfer.model.checkpoint import TensorDictCheckpoint

    hf, cfg = e2e.build_transformers(_shape(args), device, dtype, args.seed)
    with torch.no_grad():
        for layer, experts in (hot or {}).items():
            hf.model.layers[layer].mlp.gate.e_score_correction_bias[experts] += args.skew_bias
    ec = EngineConfig(model="v2-lite-random", backend=args.backend, expert_parallel_size=args.world,
                      max_model_len=args.max_model_len, max_num_seqs=args.batch, max_num_batched_tokens=args.chunk,
                      kv_cache_fraction=args.kv_cache_fraction, enable_prefix_caching=False, progress=False,
                      dtype="float32" if dtype == torch.float32 else "bfloat16", **fields)
    ckpt = TensorDictCheckpoint.from_transformers(hf)
    ep = build_engine(ec, ctx, checkpoint=ckpt, config=ModelConfig.from_hf_dict(cfg.to_dict()))
    del ckpt, hf
    _free(device, serving=True)
    return ep


def _hot_experts(args) -> dict[int, list[int]]:
    """Per MoE layer, --hot-experts experts whose every copy sits on rank 0 in EPLB's initial placement."""
    from transformers import DeepseekV3Config

    from deepinfer.config import ModelConfig
    from deepinfer.moe.placement import ModelPlacement

    c = ModelConfig.from_hf_dict(DeepseekV3Config(**_shape(args)).to_dict())
    layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
    initial = ModelPlacement.initial(layers, c.n_routed_experts, c.n_routed_experts + args.redundant, c.n_group, 1, args.world)
    hot = {}
    for row, layer in enumerate(layers):
        elsewhere = set(initial.phy2log[row, initial.slots_per_rank:].tolist())
        hot[layer] = [e for e in initial.rank_experts(row, 0) if e not in elsewhere][: args.hot_experts]
    return hot


def _rank(rank: int, args, tmp: str) -> None:
    from deepinfer.engine.expert_parallel import init_distributed, shutdown_distributed
    from deepinfer.moe.placement import imbalance

    device, dtype = _setup(args, rank)
    ctx = init_distributed("gloo" if device == "cpu" else "nccl", rank=rank, world_size=args.world,
                           init_method=f"file://{tmp}/store", local_world_size=args.world, timeout_s=args.timeout)
    out, results = f"{tmp}/rank{rank}.json", {"device": args.device_name}
    for mode in args.ep_modes if "ep" in args.phases else ():
        ep = _build_ep(args, ctx, device, dtype, **EAGER_FIELDS if mode == "eager" else {})
        results[f"ep-{mode}"] = run_batch(Lockstep(ep), args, f"ep-{mode}", profile=True)
        _write(out, results)
        ep.close()  # its graphs hold NCCL work: released before the next engine and the group's teardown
        del ep
        _free(device)
    if "eplb" in args.phases:
        hot = _hot_experts(args)
        ep = _build_ep(args, ctx, device, dtype, hot, enable_eplb=True, num_redundant_experts=args.redundant,
                       eplb_window_size=args.gen, eplb_step_interval=10**9,
                       **({} if "graphs" in args.ep_modes else EAGER_FIELDS))
        balancer, run = ep.balancer, Lockstep(ep)
        info = {"hot": hot, "placement_before": balancer.placement.phy2log.tolist()}

        def rebalance(window: int) -> None:  # collective: every rank, before the second window (a third: steady)
            if window != 1:
                return
            load = balancer.global_load()  # the static window's routed pairs [layers, E], summed over ranks
            info["hot_share"] = float(sum(load[r, h].sum() for r, h in enumerate(hot.values())) / load.sum())
            e2e.sync(run.device)
            t = time.perf_counter()
            event = ep.rebalance(load)
            e2e.sync(run.device)
            info.update(rebalance_s=time.perf_counter() - t, transfers=event.transfers,
                        imbalance_before=event.imbalance_before, imbalance_after=event.imbalance_after,
                        placement_after=balancer.placement.phy2log.tolist())

        results["eplb"] = cell = run_batch(run, args, "eplb", windows=3, between=rebalance, profile=True)
        if "windows" in cell:  # the recorder's window is now the last timed window
            cell.update(info, imbalance_window2=imbalance(balancer.placement.phy2log, balancer.global_load(), args.world))
        _write(out, results)
        ep.close()
    shutdown_distributed(ctx)


def _spawn(fn, nprocs: int, args, extra, timeout: float) -> str | None:
    """Run fn(i, args, extra) in nprocs spawned processes; kill them all past `timeout` s. None, or what failed."""
    pc = mp.start_processes(fn, args=(args, extra), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not pc.join(timeout=2):
            if time.monotonic() > deadline:
                for p in pc.processes:
                    if p.is_alive():
                        p.kill()
                return f"killed past the {timeout:.0f} s deadline"
    except Exception as err:  # a process raised or died; join has terminated the others
        print(err, file=sys.stderr)
        lines = str(err).strip().splitlines()
        return f"{type(err).__name__}: {lines[-1] if lines else ''}"
    return None


# --- the report -------------------------------------------------------------------------------------------------
def _ok(cell) -> bool:
    return bool(cell) and "windows" in cell


def _row(*cells, head: bool = False) -> None:
    print("| " + " | ".join(str(c) for c in cells) + " |" + ("\n|" + "---|" * len(cells) if head else ""))


def _report(args, peer: dict, ranks: list[dict]) -> None:
    device = next((r["device"] for r in [peer, *ranks] if r.get("device")), "?")
    print(f"\n## One {device}, no expert parallelism (batch {args.batch}, context {args.context}, {args.gen} decode steps)")
    _row("engine", "decode tok/s", "median step ms", "prefill s", head=True)
    ref = {}
    for name, label in (("graphs", "CUDA graphs + overlap (defaults)"), ("eager", "eager, no overlap (as EP runs with --enforce-eager)")):
        c = peer.get(name)
        if _ok(c):
            w = c["windows"][0]
            ref[name] = w["tok_s"]
        _row(label, *([f"{w['tok_s']:.1f}", f"{w['median_step_ms']:.2f}", f"{c['prefill_s']:.1f}"] if _ok(c)
                      else [(c or {}).get("skipped", peer.get("error", "not run")), "", ""]))
    ratio = lambda x, k: f"{x / ref[k]:.2f}x" if ref.get(k) else "-"  # noqa: E731
    for mode in args.ep_modes:
        _report_ep(args, [r.get(f"ep-{mode}") for r in ranks], ratio,
                   "decode graphs + overlap: the default" if mode == "graphs" else "eager, no overlap: --enforce-eager")
    cells = [r.get("eplb") for r in ranks]
    if not cells or not all(_ok(c) and "transfers" in c for c in cells):
        print(f"\nEPLB: {[(c or {}).get('skipped', 'no result') for c in cells]}" if any(cells) else "")
        return
    c0 = cells[0]
    layer, hot = next(iter(c0["hot"].items()))
    print(f"\n## EPLB on a skewed router ({args.redundant} redundant slots; +{args.skew_bias} correction bias on "
          f"{len(hot)} experts per layer, all on rank 0, e.g. layer {layer}: {hot})")
    _row("placement", "total tok/s", "per GPU", "median step ms (rank 0)", "slowest steps (rank 0: step, ms)",
         "routed pairs/rank max/mean (measured, eager)", "modelled imbalance", "GPU compute ms/step per rank (profiled)",
         head=True)
    for w, name, model in ((0, "initial", c0["imbalance_before"]), (1, "after rebalance", None),
                           (2, "after rebalance, next window", c0["imbalance_window2"])):
        tot, rows = sum(c["windows"][w]["tok_s"] for c in cells), [c["windows"][w]["rows"] for c in cells]
        compute = [_profile(c, w) for c in cells]
        compute = " / ".join(f"{p['compute_s'] / p['steps'] * 1e3:.2f}" if p else "-" for p in compute)
        w0 = c0["windows"][w]
        _row(name, f"{tot:.1f}", f"{tot / args.world:.1f}", f"{w0['median_step_ms']:.2f}",
             f"{w0['slowest_steps_ms']}; gc {w0['gc_ms']} ms, allocator retries {w0['alloc_retries']}",
             f"{max(rows) / statistics.mean(rows):.2f}" if min(rows) > 0 else "- (graphed steps)",
             "-" if model is None else f"{model:.3f}", compute)
    moved = sum(a != b for ra, rb in zip(c0["placement_before"], c0["placement_after"]) for a, b in zip(ra, rb))
    print(f"hot experts' share of routed pairs (static window): {c0['hot_share']:.1%}; rebalance: {c0['transfers']} "
          f"expert copies moved ({moved} slots changed) in {c0['rebalance_s']:.2f} s; modelled imbalance on the "
          f"static window {c0['imbalance_before']:.3f} -> {c0['imbalance_after']:.3f}")
    print(f"layer {layer} slots before: {c0['placement_before'][0]}\nlayer {layer} slots after:  {c0['placement_after'][0]}")


def _report_ep(args, cells: list, ratio, mode: str) -> None:
    """One EP mode's tables: decode rate per rank against the peer, then the profiled network wait."""
    if any(_ok(c) for c in cells):
        print(f"\n## Expert parallel over {args.world} ranks ({args.batch} requests per rank; {mode})")
        _row("rank", "decode tok/s", "median step ms", "vs 1 GPU graphs", "vs 1 GPU eager",
             "routed pairs received (eager steps)", "host s in dispatch (eager)", "host s in combine (eager)", head=True)
        for r, c in enumerate(cells):
            w = c["windows"][0] if _ok(c) else None
            _row(r, *([f"{w['tok_s']:.1f}", f"{w['median_step_ms']:.2f}", ratio(w["tok_s"], "graphs"), ratio(w["tok_s"], "eager"),
                       w["rows"], f"{w['dispatch']:.3f}", f"{w['combine']:.3f}"] if w
                      else [(c or {}).get("skipped", "no result")] + [""] * 6))
        total = sum(c["windows"][0]["tok_s"] for c in cells if _ok(c))
        _row("all", f"{total:.1f} total, {total / args.world:.1f} per GPU", "", ratio(total / args.world, "graphs"),
             ratio(total / args.world, "eager"), "", "", "")
        print("\n## Network wait (profiled decode steps after the timed window; the profiler slows the host)")
        _row("rank", "steps", "step ms", "compute ms/step", "comm ms/step", "comm / wall", "launched in dispatch",
             "in combine", "host ms/step in dispatch+combine", head=True)
        profiles = [_profile(c, 0) for c in cells]
        for r, p in enumerate(profiles):
            if p:
                share = lambda x: f"{x / p['comm_s']:.0%}" if p["dispatch_comm_s"] + p["combine_comm_s"] else "-"  # noqa: E731
                n = p["steps"]
                _row(r, n, f"{p['wall_s'] / n * 1e3:.2f}", f"{p['compute_s'] / n * 1e3:.2f}", f"{p['comm_s'] / n * 1e3:.2f}",
                     f"{p['comm_s'] / p['wall_s']:.1%}", share(p["dispatch_comm_s"]), share(p["combine_comm_s"]),
                     f"{p['host_s'] / n * 1e3:.2f}")
        kind = next((p["kind"] for p in profiles if p), "")
        print(f"comm: {kind} time (it includes waiting on slower peers and may overlap shared-expert compute).")
    elif any(cells):
        print(f"\nexpert parallel: {[(c or {}).get('skipped', 'no result') for c in cells]}")


def _profile(cell, window: int) -> dict | None:
    """The profile taken after a cell's timed window, if any."""
    windows = (cell or {}).get("windows") or []
    return windows[window].get("profile") if window < len(windows) else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=None, help="ranks, one GPU each (default: every visible GPU)")
    p.add_argument("--batch", type=int, default=256, help="requests per rank (and for the one-GPU peer)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--gen", type=int, default=64, help="decode steps per timed window")
    p.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens (prefill chunk)")
    p.add_argument("--backend", default="cuda_sm100")
    p.add_argument("--ep-modes", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"],
                   help="EP engine runs: eager without overlap (enforce_eager), and the default (graphs + overlap)")
    p.add_argument("--kv-cache-fraction", type=float, default=0.85)
    p.add_argument("--phases", nargs="+", default=["peer", "ep", "eplb"], choices=["peer", "ep", "eplb"])
    p.add_argument("--peer-json", default=None, help="the peer's numbers from an earlier run's --json")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--hot-experts", type=int, default=None, help="default: top_k // 2")
    p.add_argument("--skew-bias", type=float, default=1.0)
    p.add_argument("--redundant", type=int, default=None, help="EPLB redundant slots (default 2 * world)")
    p.add_argument("--timeout", type=float, default=500.0, help="seconds per spawn before its processes are killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="2 CPU ranks, gloo, reference backend, TINY shape")
    args = p.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.world = args.world or torch.cuda.device_count()
    shape = e2e.TINY if args.smoke else e2e.V2_LITE
    args.hot_experts = args.hot_experts or max(1, shape["num_experts_per_tok"] // 2)
    args.redundant = 2 * args.world if args.redundant is None else args.redundant
    if args.world < 2 or (shape["n_routed_experts"] + args.redundant) % args.world:
        print(f"ep_e2e: needs >= 2 ranks and (experts + --redundant) % world == 0; world {args.world}, "
              f"{shape['n_routed_experts']} + {args.redundant} (--smoke runs 2 CPU ranks)")
        return 1
    args.max_model_len = args.context + _max_tokens(args, 3) + 8
    print(f"# ep_e2e: {args.world} ranks, backend {args.backend}, {'TINY' if args.smoke else 'V2-Lite'} shape, "
          f"batch {args.batch}/rank, context {args.context}, {args.gen} decode steps; torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    results: dict = {"args": vars(args), "peer": {}, "ranks": []}
    with tempfile.TemporaryDirectory(prefix="ep_e2e_") as tmp:
        if "peer" in args.phases:
            t, path = time.perf_counter(), f"{tmp}/peer.json"
            err = _spawn(_peer, 1, args, path, args.timeout)
            results["peer"] = json.load(open(path)) if os.path.exists(path) else {}
            results["peer"].update({"error": err} if err else {})
            print(f"peer: {time.perf_counter() - t:.0f} s{'; ' + err if err else ''}", flush=True)
        elif args.peer_json:
            results["peer"] = json.load(open(args.peer_json))["peer"]
        if {"ep", "eplb"} & set(args.phases):
            t = time.perf_counter()
            err = results["ep_error"] = _spawn(_rank, args.world, args, tmp, args.timeout)
            for r in range(args.world):
                path = f"{tmp}/rank{r}.json"
                results["ranks"].append(json.load(open(path)) if os.path.exists(path) else {})
            print(f"ranks: {time.perf_counter() - t:.0f} s{'; ' + err if err else ''}", flush=True)
    _report(args, results["peer"], results["ranks"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 2 if results.get("ep_error") or "error" in results["peer"] else 0


if __name__ == "__main__":
    sys.exit(main())
