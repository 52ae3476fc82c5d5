"""The weight-streaming GEMMs of one decode step, tile by tile, against cuBLAS: how much of HBM each reaches.

  python3 benchmarks/gemm_decode.py [--batches 1 32] [--formats bf16 fp8] [--model v2-lite|v3] [--sweep]
                                    [--cases experts dense] [--budget SECONDS] [--json FILE]

At decode batch sizes every GEMM of a DeepSeek layer reads its whole weight for a few rows, so what counts is
GB/s of weight bytes over the HBM read ceiling (measured in the same run). Cases, per batch B:
- experts: the routed + folded shared experts as the model runs them (tokens pick top_k distinct routed
  experts at random plus every shared slice): gate/up fused with SiLU (16-bit output, as the backend's
  gated_linear asks), then the down projection (for FP8 weights with its activation quantisation, timed with
  it), both grouped (contiguous layout); 16-bit experts' rows at batch 1 on the grouped GEMV unless
  DEEPINFER_GEMV=0 (--sweep times the GEMV's tiles for E4M3 experts too). Peers: a loop of per-expert cuBLAS calls over the active experts
  (bf16), and torch._grouped_mm where this torch has it.
- dense projections at M = B: the attention's fused q/kv_a projection, o_proj, lm_head: ours (the backend's
  linear: at batch 1 the GEMV, unless DEEPINFER_GEMV=0; else the GEMM tile for FP8 weights and cuBLAS for bf16
  ones, with the Triton tile as a further run) next to cuBLAS (bf16 matmul, or row-wise FP8 `torch._scaled_mm`).
With --sweep each case also tries narrower tiles, split-K and, for the fused gate/up, the unfused split-K
GEMM + SiLU kernel; every candidate is checked against the default's result first. Times: a CUDA graph runs
the case over COPIES distinct weights back to back, as consecutive layers do (so per-launch gaps count as in
the model, and the graph's own launch does not), median of 21 replays with L2 flushed before each, divided by
COPIES. --smoke runs tiny shapes on the CPU under the Triton interpreter (this script's flow only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

import gemm as B  # benchmarks/gemm.py: timing, FP8 weights, tile names
from deepinfer import quant
from deepinfer.weights import LinearWeight

from deepinfer.backends.cuda_sm100 import gemm as G, gemm_wm as WM, gemv as V

MODELS = {  # hidden, expert intermediate, routed experts, top_k, shared slices, q + kv_a width, o_proj in, vocab
    "v2-lite": dict(hidden=2048, inter=1408, experts=64, top_k=6, shared=2, q_kv_a=16 * 192 + 576, o_in=16 * 128, vocab=102400),
    "v3": dict(hidden=7168, inter=2048, experts=256, top_k=8, shared=1, q_kv_a=1536 + 576, o_in=128 * 128, vocab=129280),
}
RESULTS: list[dict] = []
# (weight rows a program, K step, warps) for the GEMV's sweeps. The last two hold 128 and 256 E4M3 weights a
# thread a step: a program's fixed work (the row's quantisation, the reductions) over more weights (sm_90: 13
# instructions a weight at 8 x 2048 on 8 warps, 8.3 at 16 x 2048, 5.8 at 32 x 2048). They lost everywhere on the
# H200 all the same (FP8 gate/up 25.2 / 33.2 us against 22.3 at 8 x 2048; RESULTS.md issue 10, twentieth session).
GEMV_GROUPED_TILES = [(8, 512, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4), (32, 512, 8), (64, 256, 8), (8, 2048, 8),
                      (16, 2048, 8), (32, 2048, 8)]
GEMV_DENSE_TILES = [(4, 2048, 8), (8, 2048, 8), (8, 1024, 4), (16, 1024, 8), (8, 512, 4), (4, 1024, 4), (16, 2048, 8),
                    (32, 2048, 8)]
# (weight rows a program, stages, warps) of the weights-as-M FP8 kernel's sweeps (gemm_wm.default_tiles).
WM_TILES = [(64, 3, 4), (64, 4, 4), (64, 6, 4), (64, 8, 4), (128, 3, 4), (128, 4, 8), (128, 6, 8)]
COPIES = 8  # distinct weights per timed graph (the lm_head case: 2)


def expert_sizes(tokens: int, experts: int, top_k: int, shared: int, dev) -> torch.Tensor:
    ids = torch.rand(tokens, experts, device=dev).argsort(dim=1)[:, :top_k]
    sizes = torch.bincount(ids.flatten(), minlength=experts)
    return torch.cat([sizes, torch.full((shared,), tokens, dtype=sizes.dtype, device=dev)])


def weight(fmt: str, n: int, k: int, groups: int | None = None) -> LinearWeight:
    if fmt == "fp8":
        return B.fp8_weight(n, k, groups)
    shape = (n, k) if groups is None else (groups, n, k)
    return LinearWeight.dense(torch.randn(shape, device=B.DEV, dtype=torch.bfloat16) / k**0.5)


def weight_bytes(w: LinearWeight, n: int, k: int) -> float:
    return n * k * (w.data.element_size() + (4 / 128**2 if w.scale is not None else 0))


def candidates(rows: int, bk: int, fused: bool) -> list[G.TileConfig]:
    """Tiles for few rows: narrow (more CTAs to spread the weight over the SMs), deeper pipelines, split-K."""
    out = []
    for bn in (32, 64, 128):
        for stages in (4, 6):
            out.append(G.TileConfig(16, bn, bk, 4, stages))
            if bn >= 64:  # TMA-fed: the copies leave the registers and load units free to keep more in flight
                out.append(G.TileConfig(16, bn, bk, 4, stages, tma=True))
    if bk == 128:  # FP8 16x128 with 8 warps (no spills with 4 either: 176 registers fused, 116 not, sm_90 compile with
        # unit strides specialised as the launch does; end to end 8 warps lost, RESULTS.md issue 10, twelfth session)
        out.append(G.TileConfig(16, 128, bk, 8, 4))
    if bk == 64:  # bf16 with 128-wide K steps: half the loop trips for the same bytes per stage as FP8's
        for bn in ((32, 64) if fused else (32, 64, 128)):
            for stages in (3, 4):
                out.append(G.TileConfig(16, bn, 128, 4, stages))
                if bn >= 64:
                    out.append(G.TileConfig(16, bn, 128, 4, stages, tma=True))
    if rows > 16:
        out.append(G.TileConfig(32, 64, bk, 4, 4))
    out.append(G.TileConfig(64, 128, bk, 4, 4, tma=True))
    if not fused:
        for cfg in (G.TileConfig(16, 64, bk, 4, 4), G.TileConfig(16, 128, bk, 4, 4), G.TileConfig(64, 128, bk, 4, 4, tma=True)):
            out += [replace(cfg, split_k=s) for s in (2, 4)]
    return out


def _per_copy(fn, copies: int) -> tuple[float | None, str]:
    """Milliseconds per call of fn(i) over copies i = 0.. copies-1 run back to back in one graph."""
    ms, err = B.try_time(lambda: [fn(i) for i in range(copies)])
    return (None if ms is None else ms / copies), err


def wm_run(x: torch.Tensor, w: LinearWeight, sizes: torch.Tensor | None, gated: bool, tiles) -> torch.Tensor:
    """x quantised as gemm._launch's callers do (quant_fp8), then the weights-as-M kernel on the given tiles."""
    n = w.out_features // 2 if gated else w.out_features
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return WM.launch(*G.quantize_fp8(x, column_major_scales=True), w, out, sizes, gated, tiles)


def measure(name: str, run, copies: int, bytes_: float, read: float | None, sweep_runs: list[tuple[str, object]],
            peers) -> None:
    """run(i), each sweep candidate fn(i) and each peer fn(i) compute the case on weight copy i."""
    ref = _value(run(0))
    ms, err = _per_copy(run, copies)
    if ms is None:
        print(f"| {name} | failed: {err} |")
        return
    gbs = lambda t: bytes_ / (t * 1e-3) / 1e9  # noqa: E731
    frac = lambda t: "-" if read is None else f"{gbs(t) / read:.2f}"  # noqa: E731
    best = (ms, "default")
    for label, fn in sweep_runs:
        try:
            out = _value(fn(0))
        except Exception as exc:  # a tile that does not compile or fit: not a candidate
            print(f"|   {name}: {label} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # e4m3 outputs may flip a rounding
        if not rel < 2e-2:
            print(f"|   {name}: {label} differs from the default (relative error {rel:.3g})")
            continue
        t, _ = _per_copy(fn, copies)
        if t is not None:
            print(f"|   {name}: {label} {t * 1e3:.1f} us ({frac(t)})")
            if t < best[0]:
                best = (t, label)
    peer_txt = []
    for pname, fn in peers:
        t, perr = _per_copy(fn, copies)
        peer_txt.append(f"{pname} {t * 1e3:.1f} us ({frac(t)}; ours/peer {t / ms:.2f}x)" if t else f"{pname}: {perr}")
    print(f"| {name} | {ms * 1e3:.1f} | {gbs(ms):.0f} | {frac(ms)} | {best[1]} | {best[0] * 1e3:.1f} | {frac(best[0])} | "
          f"{'; '.join(peer_txt)} |", flush=True)
    RESULTS.append(dict(case=name, us=ms * 1e3, gbs=gbs(ms), best=best[1], best_us=best[0] * 1e3))


def bench_experts(m: dict, batch: int, fmt: str, sweep: bool, read: float | None) -> None:
    dev, h, inter = B.DEV, m["hidden"], m["inter"]
    groups = m["experts"] + m["shared"]
    sizes = expert_sizes(batch, m["experts"], m["top_k"], m["shared"], dev)
    rows, active = int(sizes.sum()), int((sizes > 0).sum())
    gate_up = [weight(fmt, 2 * inter, h, groups) for _ in range(COPIES)]
    down = [weight(fmt, h, inter, groups) for _ in range(COPIES)]
    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
    fp8 = fmt == "fp8"
    bk = 128 if fp8 else 64
    hidden = G.gate_up_silu(x, gate_up[0], group_sizes=sizes, quantize=False, validate=False)
    tag = f"B={batch} {fmt}"

    def fused(i, cfg=None):
        return G.gate_up_silu(x, gate_up[i], group_sizes=sizes, quantize=False, cfg=cfg, validate=False)

    def unfused(i, cfg=None):
        return G.silu_and_mul(G.grouped_linear(x, gate_up[i], sizes, cfg=cfg, validate=False))

    runs = []
    if sweep:
        runs = [(B.cfg_name(c), lambda i, c=c: fused(i, c)) for c in candidates(rows, bk, True)]
        runs.append(("unfused default + silu (the model where gemm.fuse_gate_up says no)", unfused))
        runs += [("unfused " + B.cfg_name(c) + " + silu", lambda i, c=c: unfused(i, c))
                 for c in candidates(rows, bk, False) if c.split_k > 1]
        if V.gemv_grouped_fits(x, gate_up[0]):
            runs += [(f"gemv {c[0]}x{c[1]} w{c[2]}", lambda i, c=c: V.gemv_grouped(
                x, gate_up[i], sizes, gated=True, bn=c[0], bk=c[1], warps=c[2])) for c in GEMV_GROUPED_TILES]
        if WM.usable(*G.quantize_fp8(x), gate_up[0], gated=True):
            runs += [(f"quant + wm {c[0]} s{c[1]} w{c[2]}", lambda i, c=c: wm_run(x, gate_up[i], sizes, True, c))
                     for c in WM_TILES]
    peers = []
    if not fp8:
        host = sizes.tolist()
        starts = [sum(host[:g]) for g in range(groups)]

        def loop_gate_up(i):
            for g in range(groups):
                if host[g]:
                    G.silu_and_mul(x[starts[g] : starts[g] + host[g]] @ gate_up[i].data[g].t())

        peers.append(("per-expert cuBLAS + silu loop", loop_gate_up))
    measure(f"{tag} experts gate/up+SiLU [{active} of {groups} x {2 * inter}x{h}]", fused, COPIES,
            active * weight_bytes(gate_up[0], 2 * inter, h), read, runs, peers)

    def down_run(i, cfg=None):
        return G.grouped_linear(hidden, down[i], sizes, cfg=cfg, validate=False)

    runs = [(B.cfg_name(c), lambda i, c=c: down_run(i, c)) for c in (candidates(rows, bk, False) if sweep else [])]
    if sweep and V.gemv_grouped_fits(hidden, down[0]):
        runs += [(f"gemv {c[0]}x{c[1]} w{c[2]}", lambda i, c=c: V.gemv_grouped(
            hidden, down[i], sizes, bn=c[0], bk=c[1], warps=c[2])) for c in GEMV_GROUPED_TILES]
    if sweep and WM.usable(*G.quantize_fp8(hidden), down[0]):
        runs += [(f"quant + wm {c[0]} s{c[1]} w{c[2]}", lambda i, c=c: wm_run(hidden, down[i], sizes, False, c))
                 for c in WM_TILES]
    peers = []
    if not fp8:
        offs = torch.cumsum(sizes, 0).to(torch.int32)
        peers.append(("torch._grouped_mm", lambda i: torch._grouped_mm(hidden, down[i].data.transpose(-1, -2), offs=offs)))
    measure(f"{tag} experts down [{active} of {groups} x {h}x{inter}]", down_run, COPIES,
            active * weight_bytes(down[0], h, inter), read, runs, peers)
    del gate_up, down


def _value(out):
    """A result as float values: FP8 (e4m3, scales) pairs dequantised, so candidates compare by value."""
    return quant.dequantize_fp8_per_token_group(*out) if isinstance(out, tuple) else out.float()


def bench_dense(m: dict, batch: int, fmt: str, sweep: bool, read: float | None) -> None:
    dev, h = B.DEV, m["hidden"]
    cases = [("q/kv_a", m["q_kv_a"], h), ("o_proj", h, m["o_in"])]
    if fmt == "bf16":
        cases.append(("lm_head", m["vocab"], h))
    bk = 128 if fmt == "fp8" else 64
    for label, n, k in cases:
        copies = 2 if label == "lm_head" else COPIES
        ws = [weight(fmt, n, k) for _ in range(copies)]
        x = torch.randn(batch, k, device=dev, dtype=torch.bfloat16)
        runs = []
        if sweep:
            kb = -(-k // bk)
            for c in (G.TileConfig(16, 64, bk, 4, 4), G.TileConfig(16, 128, bk, 4, 4), G.TileConfig(16, 64, bk, 4, 6)):
                tiles = -(-n // c.bn)
                for s in sorted({1, G.split_divisor(kb, max(1, 132 // tiles)), G.split_divisor(kb, max(1, 264 // tiles))}):
                    cfg = replace(c, split_k=s)
                    runs.append((B.cfg_name(cfg), lambda i, cfg=cfg: G.linear(x, ws[i], cfg=cfg, dense_triton=True)))
            if fmt == "bf16":  # 128-wide K steps (see candidates)
                for c in (G.TileConfig(16, 64, 128, 4, 4), G.TileConfig(16, 128, 128, 4, 3)):
                    tiles = -(-n // c.bn)
                    for s in sorted({1, G.split_divisor(k // 128, max(1, 132 // tiles))}):
                        cfg = replace(c, split_k=s)
                        runs.append((B.cfg_name(cfg), lambda i, cfg=cfg: G.linear(x, ws[i], cfg=cfg, dense_triton=True)))
        if fmt == "fp8":
            sb = torch.rand(1, n, device=dev) + 0.5
            pad = max(16, -(-batch // 16) * 16)  # cuBLAS FP8 wants rows in multiples of 16
            xp = torch.zeros(pad, k, device=dev).to(quant.FP8_DTYPE)
            sp = torch.ones(pad, 1, device=dev)
            peers = [("cuBLAS FP8 row-wise", lambda i: torch._scaled_mm(xp, ws[i].data.t(), scale_a=sp, scale_b=sb,
                                                                         out_dtype=torch.bfloat16))]
        else:
            peers = [("cuBLAS bf16", lambda i: x @ ws[i].data.t())]
            runs.append(("Triton tile", lambda i: G.linear(x, ws[i], dense_triton=True)))
        # ours: the backend's choice (batch 1: the GEMV unless DEEPINFER_GEMV=0; else cuBLAS for bf16 weights, and for
        # E4M3 ones the quantiser and the weights-as-M kernel up to 32 rows unless DEEPINFER_WM=0)
        ours = lambda i: G.linear(x, ws[i])  # noqa: E731
        if sweep and V.gemv_usable(x, ws[0]):
            for bn, bk, warps in GEMV_DENSE_TILES:
                runs.append((f"gemv {bn}x{bk} w{warps}", lambda i, c=(bn, bk, warps): V.gemv(x, ws[i], bn=c[0], bk=c[1], warps=c[2])))
        if sweep and WM.usable(*G.quantize_fp8(x), ws[0]):
            runs += [(f"quant + wm {c[0]} s{c[1]} w{c[2]}", lambda i, c=c: wm_run(x, ws[i], None, False, c))
                     for c in WM_TILES]
        measure(f"B={batch} {fmt} {label} [{n}x{k}]", ours, copies, weight_bytes(ws[0], n, k), read, runs, peers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--model", default="v2-lite", choices=sorted(MODELS))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cases", nargs="+", default=["experts", "dense"], choices=["experts", "dense"])
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later cases are skipped past it")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    m = dict(MODELS[args.model])
    if args.smoke:
        B.SMOKE, B.DEV = True, torch.device("cpu")
        m = dict(hidden=256, inter=128, experts=8, top_k=2, shared=1, q_kv_a=192, o_in=128, vocab=512)
    read = None
    if not B.SMOKE:
        from gpu_timing import ceilings

        read = ceilings()[0]
    print(f"# {torch.cuda.get_device_name(B.DEV) if B.DEV.type == 'cuda' else 'cpu'}; {args.model}; HBM read "
          f"{read or float('nan'):.0f} GB/s; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print("| case | default us | GB/s | of HBM | best | us | of HBM | peers |")
    print("|---|---|---|---|---|---|---|---|")
    deadline = time.time() + args.budget
    torch.manual_seed(0)
    for fmt in args.formats:
        for batch in args.batches:
            if time.time() > deadline:
                print(f"| B={batch} {fmt} | skipped (time budget) |")
                continue
            if "experts" in args.cases:
                bench_experts(m, batch, fmt, args.sweep, read)
            if "dense" in args.cases:
                bench_dense(m, batch, fmt, args.sweep, read)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
