"""cuda_sm100 GEMMs on the GPU against their peers, in one run: TFLOPS and ratios.

  python3 benchmarks/gemm.py [--out DIR] [--budget SECONDS] [--sweep] [--sections fp8,grouped,precision,dense]

- FP8 block-scaled GEMM (DeepGEMM's recipe) at ANCHORS.md's DeepSeek-V3 shapes, M in (64, 128, 4096):
  ours (GEMM only, activations pre-quantised, as DeepGEMM and cuBLAS are timed), ours end to end (bf16 in,
  fused activation quantisation + GEMM), cuBLAS FP8 (`torch._scaled_mm`, row-wise scales), bf16 matmul.
- Grouped: 8 groups x 512 tokens (N 4096, K 7168) against torch's grouped GEMMs and per-group loops; 256
  experts top-8 at 128 and 4096 tokens against a loop of per-expert cuBLAS FP8 calls.
- Decode-shaped GEMMs (a few rows, weight-streaming): benchmarks/gemm_decode.py.
- bf16 Triton tile GEMM against cuBLAS (which `linear` uses for dense weights), NVFP4 weight-only, and
  the FP8 GEMM's error against float64 math on the same quantised inputs.
Each timing: median of 21 calls, CUDA events, L2 flushed (256 MiB written) before each call, replayed from
a CUDA graph (GPU time, as decode runs) unless marked eager (host overhead included).
With --sweep, every FP8 shape also tries a few tile configurations (each checked against the default's
result) and prints the best one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

import torch
import triton

from gpu_timing import events_median

from deepinfer import quant
from deepinfer.weights import LinearWeight

from deepinfer.backends.cuda_sm100 import gemm as G

SHAPES = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
MS = [64, 128, 4096]
DEV = torch.device("cuda")
_FLUSH = None
RESULTS: dict = {"fp8": [], "grouped": [], "dense": [], "nvfp4": [], "precision": [], "sweep": []}


SMOKE = False  # --smoke: tiny shapes on the CPU under the Triton interpreter, to check this script's flow
GROUPED_NK = (4096, 7168)


def _capture(fn):
    """fn recorded into a CUDA graph (warmed up on a side stream first, as torch recommends)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def timed(fn, reps: int = 21, graph: bool = True) -> float:
    """Median milliseconds of fn() over reps calls, each after an L2 flush.

    graph=True replays fn from a CUDA graph: the GPU time of its kernels, as decode runs them (and as
    DeepGEMM's figures are taken); graph=False calls it eagerly, so Python and launch overhead count
    whenever they exceed the flush's ~60 us.
    """
    global _FLUSH
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    fn()
    torch.cuda.synchronize()
    return events_median(_capture(fn).replay if graph else fn, reps, _FLUSH)


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def try_time(fn, graph: bool = True) -> tuple[float | None, str]:
    try:
        return timed(fn, graph=graph), ""
    except Exception as exc:  # a peer missing from this torch, or a config that does not compile
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def fp8_weight(n: int, k: int, groups: int | None = None) -> LinearWeight:
    """Random e4m3 data with random block scales, made directly (quantising 7.5 GB of floats is slow)."""
    shape = (n, k) if groups is None else (groups, n, k)
    data = torch.empty(shape, dtype=quant.FP8_DTYPE, device=DEV)
    flat = data.view(-1, n, k)
    for g in range(flat.shape[0]):
        flat[g] = (torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 64).clamp(-448, 448).to(quant.FP8_DTYPE)
    scale = torch.rand(*shape[:-2], triton.cdiv(n, 128), triton.cdiv(k, 128), device=DEV) * 1e-3 + 1e-4
    return LinearWeight.fp8_block(data, scale)


def cfg_name(c: G.TileConfig) -> str:
    flags = [f for f, on in (("tma", c.tma), ("ws", c.ws)) if on]
    return (f"{c.bm}x{c.bn}x{c.bk} w{c.warps} s{c.stages}" + (f" sk{c.split_k}" if c.split_k > 1 else "")
            + (f" gm{c.group_m}" if c.group_m != 8 else "") + "".join(" " + f for f in flags))


def sweep_configs(m: int, n: int, k: int) -> list[G.TileConfig]:
    base = G.pick_config(m, n, k, 1, 0, DEV)
    cands = [base]
    if m >= 1024 or SMOKE:
        # (256x128 tiles with 16 warps were tried on 2026-11-29: they spill and ran 10-35% slower; 128x256 and
        # 256x128 with 8 warps spill too, offline for sm_90a: 56-392 bytes of stack)
        # (2026-11-29, H200: the half-tile variant that keeps one MMA in flight across the other half's promotion
        # ran 5-25% below plain tiles at every shape, so it is not in the kernel; see gemm._fp8_large_m_stages)
        t = G.TileConfig(64, 128, 128, 4, 3, group_m=16, tma=True)
        cands += [G.TileConfig(128, 128, 128, 8, 4, tma=True), replace(t, stages=7 - base.stages), replace(t, group_m=8)]
    else:
        # The large-M tile, unsplit where it fills the GPU (H200, 2026-11-29: M=128, 24576x1536 473 vs 367 TFLOPS and
        # 32768x512 270 vs 258 for the default; slower where split-K is needed). TMA costs host time when eager.
        sms = G._num_sms(DEV)
        kb = triton.cdiv(k, 128)
        for bm, bn in ((64, 128), (64, 64)):
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            split = G.split_divisor(kb, min(max(1, sms // tiles), max(1, kb // 4), 8))
            cands.append(G.TileConfig(bm, bn, 128, 4, 5, split_k=split, tma=True))
        cands.append(replace(base, split_k=1))
        cands.append(replace(base, tma=not base.tma))
        if m >= 128:
            cands.append(G.TileConfig(128, 128, 128, 8, 4, tma=True))
        tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
        cands.append(G.TileConfig(64, 128, 128, 4, 3, tma=True, split_k=G.split_divisor(kb, min(max(1, 3 * sms // tiles), max(1, kb // 4), 8))))
        # Pointer-fed (no per-launch descriptor cost when eager) one-warpgroup tiles at several depths, split to
        # fill 1 / 2 / 3 CTAs an SM.
        for bm, bn, warps in ((64, 128, 4), (128, 64, 4), (64, 256, 8), (128, 128, 8)):
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            for stages in (3, 5):
                for per_sm in (1, 2, 3):
                    split = G.split_divisor(kb, min(max(1, per_sm * sms // tiles), max(1, kb // 4), 8))
                    cands.append(G.TileConfig(bm, bn, 128, warps, stages, split_k=split))
    seen, out = set(), []
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def bench_fp8(sweep: bool, deadline: float) -> None:
    print("\n## FP8 block-scaled GEMM (bf16 out). TFLOPS = 2MNK/t, CUDA-graph replay; ratios: ours (GEMM only) / peer")
    print("(tile kernel: gemm_kernels' Triton tile, which the Gluon kernel replaces from M = "
          f"{G.gemm_gluon.MIN_ROWS} on Hopper; '-' where ours is that tile)")
    print("| M | N x K | ours GEMM | ours e2e (+act quant) | cuBLAS FP8 row-wise | bf16 matmul | ours/cuBLAS FP8 | ours/bf16 "
          "| eager: ours / cuBLAS FP8 | tile kernel | best sweep cfg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        w = fp8_weight(n, k)
        w_bf16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        b_col = w.data.t()  # [K, N] column-major, as _scaled_mm wants
        sb = torch.rand(1, n, device=DEV) + 0.5
        for m in MS:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            xq, xs = G.quantize_fp8(x, column_major_scales=True)
            sa = torch.rand(m, 1, device=DEV) + 0.5
            ours, _ = try_time(lambda: G.fp8_gemm(xq, xs, w))
            e2e, _ = try_time(lambda: G.linear(x, w))
            ours_eager, _ = try_time(lambda: G.fp8_gemm(xq, xs, w), graph=False)
            cub, err_c = try_time(lambda: torch._scaled_mm(xq, b_col, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            cub_eager, _ = try_time(lambda: torch._scaled_mm(xq, b_col, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), graph=False)
            bf, _ = try_time(lambda: x @ w_bf16.t())
            tile = None
            if m >= G.gemm_gluon.MIN_ROWS:
                tile, _ = try_time(lambda: G.fp8_gemm(xq, xs, w, cfg=G.pick_config(m, n, k, 1, 0, DEV)))
            best = ""
            if sweep and time.time() < deadline:
                tried = []
                want = G.fp8_gemm(xq, xs, w).float()
                for cfg in sweep_configs(m, n, k):
                    t, err = try_time(lambda: G.fp8_gemm(xq, xs, w, cfg=cfg))
                    if t is not None:  # every configuration must give the default's result
                        diff = ((G.fp8_gemm(xq, xs, w, cfg=cfg).float() - want).abs().max() / want.abs().max()).item()
                        if diff > 1e-2:
                            t, err = None, f"wrong result: rel diff {diff:.2e}"
                    tried.append((t, cfg, err))
                    RESULTS["sweep"].append({"m": m, "n": n, "k": k, "cfg": asdict(cfg), "ms": t, "error": err})
                if m < G.gemm_gluon.MIN_ROWS and G.gemm_gluon.fp8_ws_usable(xq, xs, w.data, w.scale, want.bfloat16(), G.gemm_gluon.MIN_ROWS):
                    # The persistent warp-specialised kernel below its row threshold (128-row tiles), for comparison
                    out_ws = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
                    t, err = try_time(lambda: G.gemm_gluon.launch_fp8_ws(xq, xs, w.data, w.scale, out_ws, consumers=2))
                    if t is not None:
                        err = f"(rel diff {((out_ws.float() - want).abs().max() / want.abs().max()).item():.1e})"
                    print(f"|   sweep M={m} {n}x{k}: Gluon warp-specialised kernel, 2 consumers: "
                          f"{tflops(m, n, k, t) if t else float('nan'):.0f} TFLOPS {err} |")
                ok = [(t, c) for t, c, _ in tried if t is not None]
                if ok:
                    t, c = min(ok, key=lambda p: p[0])
                    best = f"{tflops(m, n, k, t):.0f} @ {cfg_name(c)}"
                for t, c, err in tried:
                    if err:
                        print(f"  (config {asdict(c)} failed: {err})", file=sys.stderr)
                print(f"|   sweep M={m} {n}x{k} (TFLOPS; cuBLAS FP8 {tflops(m, n, k, cub) if cub else float('nan'):.0f}): "
                      + "; ".join(f"{cfg_name(c)} {tflops(m, n, k, t) if t else float('nan'):.0f}" for t, c, _ in tried) + " |")
            f = lambda ms: tflops(m, n, k, ms) if ms else float("nan")  # noqa: E731
            row = {"m": m, "n": n, "k": k, "ours": f(ours), "ours_e2e": f(e2e), "cublas_fp8": f(cub), "bf16": f(bf),
                   "ours_eager": f(ours_eager), "cublas_eager": f(cub_eager), "cublas_error": err_c, "best_sweep": best,
                   "tile_kernel": f(tile) if tile else None}
            RESULTS["fp8"].append(row)
            print(f"| {m} | {n} x {k} | {row['ours']:.0f} | {row['ours_e2e']:.0f} | {row['cublas_fp8']:.0f} | {row['bf16']:.0f} "
                  f"| {row['ours'] / row['cublas_fp8']:.2f} | {row['ours'] / row['bf16']:.2f} "
                  f"| {row['ours_eager']:.0f} / {row['cublas_eager']:.0f} | {f'{f(tile):.0f}' if tile else '-'} | {best} |",
                  flush=True)
        del w, w_bf16, b_col


def bench_precision() -> None:
    print("\n## FP8 GEMM error against float64 math on the same e4m3 inputs (max |err| / max |ref|)")
    m, n, k = 128, 2112, 7168
    w = fp8_weight(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    xq, xs = G.quantize_fp8(x, column_major_scales=True)
    exact = quant.dequantize_fp8_per_token_group(xq, xs).double() @ w.dequantize().double().t()
    for name, cfg in (("default", None), ("max_num_imprecise_acc=32", replace(G.pick_config(m, n, k, 1, 0, DEV), imprecise=32))):
        try:
            out = G.fp8_gemm(xq, xs, w, out_dtype=torch.float32, cfg=cfg).double()
            err = ((out - exact).abs().max() / exact.abs().max()).item()
            t, _ = try_time(lambda: G.fp8_gemm(xq, xs, w, cfg=cfg))
            print(f"| {name} | rel err {err:.2e} | {tflops(m, n, k, t) if t else float('nan'):.0f} TFLOPS at M={m} |")
            RESULTS["precision"].append({"variant": name, "rel_err": err})
        except Exception as exc:
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:160]} |")


def _routed_sizes(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    ids = torch.rand(tokens, experts, device=DEV).argsort(dim=1)[:, :top_k]
    return torch.bincount(ids.flatten(), minlength=experts)


def bench_grouped(deadline: float) -> None:
    print("\n## Grouped FP8 GEMM (contiguous layout, sizes on the device)")
    print("| case | ours GEMM | ours e2e | peer | peer TFLOPS | ours/peer |")
    print("|---|---|---|---|---|---|")
    cases = [("8 groups x 512, N 4096, K 7168", 8, None, 512), ("256 experts top-8, 128 tokens, N 4096, K 7168", 256, 128, None),
             ("256 experts top-8, 4096 tokens, N 4096, K 7168", 256, 4096, None)]
    if SMOKE:
        cases = [("8 groups x 16", 8, None, 16), ("256 experts top-8, 4 tokens", 256, 4, None)]
    n, k = GROUPED_NK
    w256 = None
    for name, groups, tokens, per in cases:
        if time.time() > deadline:
            print(f"| {name} | skipped (time budget) |")
            continue
        if groups == 8:
            w = fp8_weight(n, k, groups)
        else:
            w256 = w256 if w256 is not None else fp8_weight(n, k, groups)
            w = w256
        sizes = torch.full((groups,), per, device=DEV) if per else _routed_sizes(tokens, groups, 8)
        m = int(sizes.sum())
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        xq, xs = G.quantize_fp8(x, column_major_scales=True)
        host = sizes.tolist()
        ours, _ = try_time(lambda: G.grouped_linear(xq, w, sizes, x_scale=xs, validate=False))
        alts = []
        for cfg in (G.TileConfig(128, 128, 128, 8, 4, tma=True), G.TileConfig(64, 128, 128, 4, 5, tma=True),
                    G.TileConfig(64, 128, 128, 4, 3, tma=True)):
            t, err = try_time(lambda: G.grouped_linear(xq, w, sizes, x_scale=xs, cfg=cfg, validate=False))
            alts.append(f"{cfg_name(cfg)}: {tflops(m, n, k, t) if t else float('nan'):.0f}{' (' + err + ')' if err else ''}")
        probe = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        which = "Gluon" if G.gemm_gluon.fp8_ws_usable(xq, xs, w.data, w.scale, probe, m, groups) else "tile"
        print(f"|   {name}: ours is the {which} kernel; tile alternatives (GEMM only, TFLOPS): {'; '.join(alts)} | | | | | |")
        e2e, _ = try_time(lambda: G.grouped_linear(x, w, sizes, validate=False))
        f = lambda ms: tflops(m, n, k, ms) if ms else float("nan")  # noqa: E731
        sb = torch.rand(groups, 1, n, device=DEV) + 0.5
        sa = torch.rand(m, 1, device=DEV) + 0.5
        starts = [sum(host[:g]) for g in range(groups)]
        # cuBLAS FP8 takes row counts in multiples of 16: each expert's rows padded (outside the timing).
        padded = [(torch.zeros(-(-c // 16) * 16, k, device=DEV).to(quant.FP8_DTYPE), torch.ones(-(-c // 16) * 16, 1, device=DEV))
                  if c else None for c in host]

        def loop_fp8():
            for g in range(groups):
                if padded[g] is not None:
                    torch._scaled_mm(padded[g][0], w.data[g].t(), scale_a=padded[g][1], scale_b=sb[g], out_dtype=torch.bfloat16)

        peers = [("per-expert cuBLAS FP8 loop (graph)", loop_fp8), ("per-expert cuBLAS FP8 loop (eager)", loop_fp8)]
        if groups == 8:
            offs = torch.cumsum(sizes, 0).to(torch.int32)
            wb = torch.randn(groups, n, k, device=DEV, dtype=torch.bfloat16)
            peers += [
                ("torch._scaled_grouped_mm FP8", lambda: torch._scaled_grouped_mm(
                    xq, w.data.transpose(-1, -2), sa.reshape(-1), sb.reshape(groups, n), offs=offs, out_dtype=torch.bfloat16)),
                ("torch._grouped_mm bf16", lambda: torch._grouped_mm(x, wb.transpose(-1, -2), offs=offs)),
                ("8 separate bf16 matmuls", lambda: [x[s : s + per] @ wb[g].t() for g, s in enumerate(starts)]),
            ]
        for pname, fn in peers:
            t, err = try_time(fn, graph="eager" not in pname)
            ratio = f(ours) / f(t) if t else float("nan")
            print(f"| {name} | {f(ours):.0f} | {f(e2e):.0f} | {pname} | {f(t) if t else float('nan'):.0f}{' (' + err + ')' if err else ''} | {ratio:.2f} |", flush=True)
            RESULTS["grouped"].append({"case": name, "ours": f(ours), "ours_e2e": f(e2e), "peer": pname, "peer_tflops": f(t) if t else None, "error": err})
        if groups == 256:
            # Fused gate/up + SiLU + quantisation (N = 2 x 2048) and, for decode, the masked layout.
            fused, _ = try_time(lambda: G.gate_up_silu(x, w, group_sizes=sizes, validate=False))
            print(f"| {name}: fused gate/up+SiLU+FP8 quant (one kernel) | {f(fused):.0f} |  |  |  |  |")
            if tokens <= 128:
                cap = max(16, triton.next_power_of_2(int(sizes.max())))
                xm = torch.randn(groups, cap, k, device=DEV, dtype=torch.bfloat16)
                qm, sm = G.quantize_fp8(xm.reshape(-1, k), column_major_scales=True)
                masked, _ = try_time(lambda: G.grouped_linear_masked(qm.reshape(groups, cap, k), w, sizes, x_scale=sm))
                print(f"| {name}: masked layout, capacity {cap} | {f(masked):.0f} |  |  |  |  |")
                RESULTS["grouped"].append({"case": name + " masked", "ours": f(masked), "fused": f(fused)})
            # Weight-streaming view of the decode case: every expert's weight is read once.
            if tokens <= 128 and ours:
                print(f"|   (weight bytes / time: {w.data.numel() / (ours * 1e-3) / 1e12:.2f} TB/s) | | | | | |")


def bench_dense_and_nvfp4(deadline: float) -> None:
    print("\n## bf16 GEMM: Triton tile kernel vs cuBLAS (TFLOPS); NVFP4 weight-only (bf16 activations) vs bf16 matmul")
    print("| M | N x K | Triton bf16 (M=4096: best of 128x128, 128x256 tiles) | cuBLAS bf16 | Triton/cuBLAS | NVFP4 w-only | NVFP4/bf16 |")
    print("|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        if time.time() > deadline:
            print("| skipped (time budget) |")
            return
        w_bf16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        dense = LinearWeight.dense(w_bf16)
        fp4 = LinearWeight.quantize(w_bf16, "nvfp4") if (n, k) in ((7168, 2048), (2112, 7168), (2112, 128)) else None
        for m in MS[:1] + MS[-1:]:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            tri, _ = try_time(lambda: G.linear(x, dense, dense_triton=True))
            if m > 128:  # a wider tile for the large-M case
                tri2, _ = try_time(lambda: G.linear(x, dense, dense_triton=True, cfg=G.TileConfig(128, 256, 64, 8, 3, tma=True)))
                tri = min(t for t in (tri, tri2) if t) if (tri or tri2) else None
            cub, _ = try_time(lambda: x @ w_bf16.t())
            f = lambda ms: tflops(m, n, k, ms) if ms else float("nan")  # noqa: E731
            fp4_t = try_time(lambda: G.linear(x, fp4))[0] if fp4 is not None else None
            print(f"| {m} | {n} x {k} | {f(tri):.0f} | {f(cub):.0f} | {f(tri) / f(cub):.2f} | {f(fp4_t) if fp4_t else float('nan'):.0f} "
                  f"| {f(fp4_t) / f(cub) if fp4_t else float('nan'):.2f} |", flush=True)
            RESULTS["dense"].append({"m": m, "n": n, "k": k, "triton": f(tri), "cublas": f(cub)})
            if fp4_t:
                RESULTS["nvfp4"].append({"m": m, "n": n, "k": k, "tflops": f(fp4_t), "bf16": f(cub)})


def main() -> None:
    global SMOKE, DEV, SHAPES, MS, GROUPED_NK
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sections", default="fp8,grouped,precision,dense")
    ap.add_argument("--ms", type=int, nargs="+", default=MS, help="FP8 section's row counts")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    MS = args.ms
    if args.smoke:
        SMOKE, DEV, SHAPES, MS, GROUPED_NK = True, torch.device("cpu"), [(256, 256), (2112, 128)], [16, 64], (256, 128)
    start = time.time()
    deadline = start + args.budget
    props = torch.cuda.get_device_properties(DEV) if DEV.type == "cuda" else argparse.Namespace(name="cpu", multi_processor_count=0)
    print(f"# {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    sections = args.sections.split(",")
    if "fp8" in sections:
        bench_fp8(args.sweep, deadline - args.budget * 0.35)
    if "grouped" in sections:
        bench_grouped(deadline - args.budget * 0.15)
    if "precision" in sections and time.time() < deadline:
        bench_precision()
    if "dense" in sections:
        bench_dense_and_nvfp4(deadline)
    print(f"\n# wall time {time.time() - start:.0f} s")
    if args.out:
        with open(f"{args.out}/gemm.json", "w") as fh:
            json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
