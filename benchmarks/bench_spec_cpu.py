"""Speculative decoding on the embedded model's held-out code, on this CPU: drafters and prefix schedulers
against non-speculative decoding in the same run.

Prompts are windows of the held-out stdlib files the embedded model never trained on (its
heldout_files.txt, read from this interpreter's standard library). Printed:
  1. acceptance: mean accepted length (bonus token included), per-position conditional acceptance, mean
     verified length and verification waste (rejected / verified) for MTP-1, MTP chained k=5, DSpark with
     the whole block, a static threshold, and Algorithm 1 at low load (batch 1) and high load (batch 32);
     the fixed block and Algorithm 1 also at the further loads of --high-loads (e.g. 128);
  2. confidence-head calibration: per-position survival ECE before and after the shipped STS calibration,
     on whole-block drafts decoded at temperature 1 from held-out prompts (the calibration was fitted on
     other files);
  3. generated tokens per second at each of --batches for every configuration, and the ratio to
     non-speculative decoding measured in the same run (interleaved, best of --repeats). Batch B holds B
     requests in flight over 3B prompts (a finished request is replaced at once, as under a server's load).
  4. the waste-throughput frontier at --frontier-load: the fixed block, Algorithm 1 and static thresholds, each
     with its waste, its throughput against the fixed block's, and the share of the run spent drafting (the
     speculator's draft_seconds), so what verification cuts can buy is visible next to what drafting costs.

    python benchmarks/bench_spec_cpu.py [--temperature 1.0] [--threads 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

CONFIGS = {
    "non-speculative": {},
    "MTP-1": dict(speculative_engine="mtp", num_speculative_tokens=1),
    "MTP chained k=5": dict(speculative_engine="mtp", num_speculative_tokens=5),
    "DSpark fixed block (5)": dict(speculative_engine="dspark", dspark_confidence_threshold=0.0),
    "DSpark threshold": dict(speculative_engine="dspark"),  # threshold filled from --threshold
    "DSpark + Algorithm 1": dict(speculative_engine="dspark"),
}


def heldout_prompts(model_dir: Path, count: int, length: int, seed: int) -> list[list[int]]:
    from deepinfer.spec.calibrate import prompts_from_stream
    from deepinfer.spec.data import encode_files
    from deepinfer.train.corpus import read_heldout_list, stdlib_root

    root = stdlib_root()
    files = [root / rel for rel in read_heldout_list(model_dir) if (root / rel).exists()]
    stream = encode_files(model_dir / "tokenizer.json", files)
    return prompts_from_stream(stream, count, length, seed)


def build(model_dir: Path, name: str, threshold: float, max_num_seqs: int):
    from deepinfer import LLM

    opts = dict(CONFIGS[name])
    if name == "DSpark threshold":
        opts["dspark_confidence_threshold"] = threshold
    return LLM(model_dir, max_num_seqs=max_num_seqs, kv_cache_memory=96 << 20, progress=False, **opts)


def params(n: int, max_tokens: int, temperature: float, seed: int):
    from deepinfer import SamplingParams

    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True) for i in range(n)]


def generate(llm, prompts, batch: int, max_tokens: int, temperature: float, seed: int) -> tuple[int, float]:
    """(generated tokens, seconds) with `batch` requests in flight: each finished request is replaced at once by
    the next prompt, as a server under constant load sees them (batch 1: one request at a time). Closed batches
    (all requests start together) would end each batch with a few stragglers, which penalises speculation: its
    requests finish at different steps."""
    engine = llm.engine
    sampling = params(len(prompts), max_tokens, temperature, seed)
    waiting, running, tokens = list(range(len(prompts))), set(), 0
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < batch:
            i = waiting.pop(0)
            engine.add_request(f"bench-{seed}-{i}", prompts[i], sampling[i])
            running.add(f"bench-{seed}-{i}")
        for out in engine.step():
            if out.finished:
                running.discard(out.request_id)
                tokens += len(out.outputs[0].token_ids)
    return tokens, time.perf_counter() - start


def spec_stats(llm):
    spec = llm.engine.speculator
    return None if spec is None else spec.metrics.snapshot()


def reset(llm) -> None:
    if llm.engine.speculator is not None:
        llm.engine.speculator.metrics.reset()


def fmt_list(xs, digits=2):
    return " / ".join(f"{x:.{digits}f}" for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder with a dspark/ drafter (default: embedded)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threshold", type=float, default=0.3, help="DSpark static threshold row")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--accept-prompts", type=int, default=64, help="prompts for the acceptance table (batch 32)")
    ap.add_argument("--low-load-prompts", type=int, default=12, help="prompts decoded one at a time (batch 1)")
    ap.add_argument("--ece-prompts", type=int, default=512,
                    help="held-out prompts decoded for the ECE table (more drafts: less sampling noise in the observed ECE)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--high-loads", default="32,128",
                    help="loads of the acceptance table: every drafter at the first, fixed block and Algorithm 1 at all")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="requests run one after another at batch 1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frontier-load", type=int, default=128, help="load of the frontier table (0: skip it)")
    ap.add_argument("--frontier-thresholds", default="0.2,0.35,0.5,0.65")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from deepinfer.models import embedded_model_path
    from deepinfer.spec.calibrate import collect_traces
    from deepinfer.spec.confidence import STSCalibration

    model_dir = args.model or embedded_model_path()
    drafter = model_dir / "dspark"
    t = args.temperature
    results: dict = {"temperature": t, "date": datetime.date.today().isoformat()}
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "?"
    print(f"# bench_spec_cpu  {results['date']}  git {rev}  {platform.processor() or platform.machine()}, "
          f"{args.threads} torch threads, torch {torch.__version__}; model {model_dir.name}; temperature {t}")

    batches = [int(b) for b in args.batches.split(",")]
    high_loads = [int(b) for b in args.high_loads.split(",")]
    max_seqs = max(batches + high_loads + [args.frontier_load])
    engines = {name: build(model_dir, name, args.threshold, max_seqs) for name in CONFIGS}
    curve = engines["DSpark + Algorithm 1"].engine.speculator.scheduler.curve
    rows = curve.rows if hasattr(curve, "rows") else ((None, curve),)
    for r, c in rows:
        print(f"SPS(B) profiled at start-up{'' if r is None else f' for {r} sequences'} (steps/s): "
              + ", ".join(f"{b}: {1 / s:.0f}" for b, s in c.points))

    # 1. Acceptance at high load for every drafter; the fixed block and Algorithm 1 at every high load, and
    # Algorithm 1 also at low load (batch 1). A load of B decodes max(--accept-prompts, 2B) prompts, B in flight.
    prompts = heldout_prompts(model_dir, max([args.accept_prompts] + [2 * b for b in high_loads]), args.prompt_len,
                              args.seed)
    rows = []
    for name, llm in engines.items():
        if name == "non-speculative":
            continue
        both = name in ("DSpark fixed block (5)", "DSpark + Algorithm 1")
        loads = [(f"high ({b})", b, prompts[: max(args.accept_prompts, 2 * b)])
                 for b in (high_loads if both else high_loads[:1])]
        if name == "DSpark + Algorithm 1":
            loads = [("low (1)", 1, prompts[: args.low_load_prompts])] + loads
        for load, batch, ps in loads:
            reset(llm)
            generate(llm, ps, batch, args.max_tokens, t, args.seed)
            s = spec_stats(llm)
            rows.append({"config": name, "load": load, "drafts": s.num_drafts, "tau": s.mean_accepted_length,
                         "verified": s.mean_verified_length, "waste": s.verification_waste,
                         "cond_accept": s.conditional_acceptance(), "pos_accept": s.position_acceptance()})
    results["acceptance"] = rows
    print(f"\n## Acceptance on held-out code (prompts of {args.prompt_len} tokens, {args.max_tokens} generated each, "
          f"temperature {t}; load B: max({args.accept_prompts}, 2B) prompts, B at a time)\n")
    print("| drafter / scheduler | load (batch) | mean accepted length | verified / round | verification waste | "
          "conditional acceptance per position | acceptance per position (accepted / rounds) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['load']} | {r['tau']:.3f} | {r['verified']:.2f} | {r['waste']:.1%} | "
              f"{fmt_list(r['cond_accept'])} | {fmt_list(r['pos_accept'])} |")
    mtp5 = next(r for r in rows if r["config"] == "MTP chained k=5")["tau"]
    block = next(r for r in rows if r["config"] == "DSpark fixed block (5)")  # at the first high load, as MTP
    print(f"\nDSpark / chained MTP accepted length at block 5: {block['tau'] / mtp5:.3f}x (target >= 1.15x)")

    # 2. Calibration of the confidence head on held-out drafts.
    ece_prompts = heldout_prompts(model_dir, args.ece_prompts, args.prompt_len, args.seed + 1)
    traces, _ = collect_traces(model_dir, drafter, ece_prompts, args.max_tokens, temperature=1.0, seed=args.seed + 1,
                               max_num_seqs=32, kv_cache_memory=96 << 20)
    calib = STSCalibration.load(drafter / "calibration.json")
    results["ece"] = {"drafts": int(traces.confidence.shape[0])}
    print(f"\n## Confidence head: survival ECE per position on {traces.confidence.shape[0]} held-out whole-block drafts "
          "(temperature 1; observed = 0/1 survival, expected = prod_(i<k) min(1, p/q)(d_i) * (1 - TV_k))\n")
    k = traces.confidence.shape[1]
    print("| outcome | scores | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " | mean |")
    print("|---|---|" + "---|" * (k + 1))
    for label, expected in (("observed", False), ("expected", True)):
        for name, c in (("raw", None), ("STS-calibrated", calib)):
            ece = traces.ece(c, expected=expected)
            results["ece"][f"{label}_{name}"] = ece
            print(f"| {label} | {name} | " + " | ".join(f"{x:.2%}" for x in ece) + f" | {sum(ece) / len(ece):.2%} |")
    conf = calib.calibrate(traces.confidence).cumprod(1).mean(0).tolist()
    seen = traces.outcomes(expected=False)[0].mean(0).tolist()
    print("\nmean calibrated survival vs observed, per position: " +
          ", ".join(f"{a:.3f} vs {b:.3f}" for a, b in zip(conf, seen)))

    # 3. Throughput, interleaved, best of repeats.
    tput: dict = {name: {} for name in engines}
    tput_stats: dict = {name: {} for name in engines}
    for batch in batches:
        n = args.batch1_prompts if batch == 1 else 3 * batch  # the load held through 3 generations of requests
        ps = heldout_prompts(model_dir, n, args.prompt_len, args.seed + 100 + batch)
        for llm in engines.values():  # warm-up
            generate(llm, ps[:1], 1, 4, t, args.seed)
        for rep in range(args.repeats):
            for name, llm in engines.items():
                reset(llm)
                tokens, secs = generate(llm, ps, batch, args.max_tokens, t, args.seed + rep)
                tput[name][batch] = max(tput[name].get(batch, 0.0), tokens / secs)
                s = spec_stats(llm)
                if s is not None:
                    tput_stats[name][batch] = (s.mean_accepted_length, s.mean_verified_length, s.verification_waste)
    results["throughput"] = tput
    results["throughput_stats"] = tput_stats
    print(f"\n## Generated tokens/s on this CPU (best of {args.repeats}; ratio to non-speculative in the same run; "
          "accepted length / verified per round / waste)\n")
    print("| configuration | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name in engines:
        cells = []
        for b in batches:
            base = tput["non-speculative"][b]
            cell = f"{tput[name][b]:.0f} ({tput[name][b] / base:.2f}x)"
            if b in tput_stats[name]:
                tau, ver, waste = tput_stats[name][b]
                cell += f"; {tau:.2f} / {ver:.2f} / {waste:.0%}"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    acc = results["acceptance"]
    alg_lo = next(r for r in acc if r["config"] == "DSpark + Algorithm 1" and r["load"].startswith("low"))
    for b in high_loads:
        alg = next(r for r in acc if r["config"] == "DSpark + Algorithm 1" and r["load"] == f"high ({b})")
        fixed = next(r for r in acc if r["config"] == "DSpark fixed block (5)" and r["load"] == f"high ({b})")
        ratio = (f"{tput['DSpark + Algorithm 1'][b] / tput['DSpark fixed block (5)'][b]:.2f}x" if b in batches
                 else "not measured (add it to --batches)")
        print(f"\nAlgorithm 1 at load {b}: waste {alg['waste']:.1%} vs fixed block {fixed['waste']:.1%} "
              f"({1 - alg['waste'] / fixed['waste']:.0%} lower; target >= 50%); throughput vs fixed block at batch {b}: "
              f"{ratio}; verified per round {alg_lo['verified']:.2f} at load 1 -> {alg['verified']:.2f} at load {b}")
    if args.frontier_load:
        results["frontier"] = frontier(args, model_dir, engines, max_seqs)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")


def frontier(args, model_dir: Path, engines: dict, max_seqs: int) -> list[dict]:
    """Section 4: the fixed block, Algorithm 1 and each of --frontier-thresholds at --frontier-load (3x that many
    prompts, the load held), one run each after a warm-up."""
    b, t = args.frontier_load, args.temperature
    ps = heldout_prompts(model_dir, 3 * b, args.prompt_len, args.seed + 200)
    cuts = [(name, engines[name]) for name in ("DSpark fixed block (5)", "DSpark + Algorithm 1")]
    cuts += [(f"DSpark threshold {x}", build(model_dir, "DSpark threshold", float(x), max_seqs))
             for x in args.frontier_thresholds.split(",") if x]
    rows = []
    for name, llm in cuts:
        generate(llm, ps[:4], 4, 8, t, args.seed)  # warm-up
        reset(llm)
        tokens, secs = generate(llm, ps, b, args.max_tokens, t, args.seed)
        s = spec_stats(llm)
        rows.append({"config": name, "tok_s": tokens / secs, "waste": s.verification_waste, "tau": s.mean_accepted_length,
                     "verified": s.mean_verified_length, "draft_share": s.draft_seconds / secs,
                     "tok_s_without_drafting": tokens / (secs - s.draft_seconds)})
    base = rows[0]
    print(f"\n## Waste-throughput frontier at load {b} ({len(ps)} prompts, {b} in flight; one run each)\n")
    print("| verification cut | tok/s | vs fixed block | waste | waste below the fixed block's | verified / round | "
          "accepted length | run spent drafting | tok/s without the drafting time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['tok_s']:.0f} | {r['tok_s'] / base['tok_s']:.2f}x | {r['waste']:.1%} | "
              f"{1 - r['waste'] / base['waste']:.0%} | {r['verified']:.2f} | {r['tau']:.3f} | {r['draft_share']:.0%} | "
              f"{r['tok_s_without_drafting']:.0f} ({r['tok_s_without_drafting'] / base['tok_s_without_drafting']:.2f}x) |")
    return rows


if __name__ == "__main__":
    main()
