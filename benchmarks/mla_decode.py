"""MLA decode over the paged latent cache on one GPU: cuda_sm100 Triton kernels vs the H200's ceilings,
FlashMLA's published-here figures (shared/ANCHORS.md) and plain-PyTorch absorbed MLA, in one run.

    python benchmarks/mla_decode.py [--reps 30] [--sweep] [--json OUT.json]

One call = plan once, then run_attention (split-KV kernel + combine) replayed from a CUDA graph, L2 flushed
before each replay, median of --reps. Bytes and FLOPs are counted as FlashMLA's benchmark counts them:
bytes = cache rows read + q read + out written; FLOPs = 2 * B * H * ctx * (576 + 512). The same run
measures HBM read bandwidth (sum over 4 GiB bf16), a 2 GiB device copy and the bf16 matmul rate (8192^3).
The peer is absorbed MLA in plain PyTorch (einsum over a contiguous bf16 cache, fp32 softmax), also
graph-replayed; FP8 rows are compared with the same bf16 peer (PyTorch has no fused FP8 attention).
--sweep also tries a few kernel configurations and split sizes per shape and reports the fastest next to
the default (the numbers in parentheses); --splits 1024,2048 tries those split sizes (default tiles) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from gpu_timing import ceilings, events_median, graph_of

SHAPES = [(64, 4096, 128), (128, 4096, 16), (16, 32768, 128), (32, 65536, 16), (1, 65536, 128)]
# FlashMLA SM90 dense decode on this H200 (bf16 cache, ANCHORS.md): ms per call.
FLASHMLA_MS = {(64, 4096, 128): 0.124, (128, 4096, 16): 0.156, (16, 32768, 128): 0.229,
               (32, 65536, 16): 0.567, (1, 65536, 128): 0.0686}
# --sweep candidates by (dtype, heads class): (config "BM,BN,warps,stages[,fold,cvt]" or "" for the default,
# split tokens or None for the plan's choice). The default is always measured first and reported as such.
SWEEP = {  # 16 heads (2026-11-30, H200): one-warpgroup 16-row tiles, FP8 scales folded (1,1), became the defaults past
    # 4096 keys a step; the 8-warp tiles they replaced stay as candidates (and the defaults for one-tile items)
    ("bf16", 16): [("", None), ("16,64,8,2", None), ("16,32,4,2", None), ("", 64), ("", 4096), ("64,64,8,2", None),
                   # 128-key tiles (170 KiB of shared memory, 154 registers at 8 warps in the sm_90 compile): twice
                   # the key bytes a program has in flight, for one token over many keys (2026-12-01: 16k keys
                   # streamed at 0.20 of HBM with 64-key tiles); and the split sizes around the rule's
                   ("16,128,8,2", None), ("16,128,8,2", 256), ("", 128), ("", 256)],
    # 128 heads: split sizes around the split rule's one wave of 64-row programs (2026-11-30 sweep, RESULTS.md)
    ("bf16", 128): [("", None), ("", 256), ("", 512), ("", 1024), ("", 2048), ("", 4096), ("", 8192)],
    ("fp8_e4m3", 16): [("", None), ("16,64,8,2,0,0", None), ("16,16,4,2,0,0", None), ("16,32,4,2,0,0", None),
                        ("64,64,8,2", None), ("64,64,8,2", 1024), ("64,64,8,2", 4096)],
    ("fp8_e4m3", 128): [("", None), ("", 256), ("", 512), ("", 1024), ("", 2048), ("", 4096), ("", 8192)],
    # 32 rows (32 heads, or 16 heads verifying 2 tokens): 4-warp tiles spill 32-264 bytes in sm_90 compiles
    ("bf16", 32): [("", None), ("32,32,4,2", None), ("32,64,4,2", None), ("32,64,8,2", None), ("64,64,8,2", None)],
    ("fp8_e4m3", 32): [("", None), ("32,32,4,2,1,1", None), ("32,16,4,2,1,1", None), ("32,32,8,2,1,1", None),
                        ("64,64,8,2", None), ("64,64,8,2", 512), ("64,64,8,2", 2048), ("64,64,8,2", 8192)],
}
RANK, ROPE, BS = 512, 64, 64


def make_case(be, batch_size, ctx, heads, kv_dtype, gen):
    from deepinfer.attention import AttentionBatch, KVCacheSpec

    nblk = ctx // BS
    spec = KVCacheSpec(batch_size * nblk + 1, BS, RANK, ROPE, kv_dtype, heads)
    perm = torch.randperm(spec.num_blocks, generator=gen)[: batch_size * nblk].view(batch_size, nblk)
    batch = AttentionBatch((1,) * batch_size, (ctx,) * batch_size, tuple(tuple(r) for r in perm.tolist()))
    cache = be.allocate_kv_cache(spec)
    if kv_dtype == "bf16":
        cache.normal_()
    else:  # random finite E4M3 bytes, per-token scales, bf16 rope
        lat = torch.randint(0, 0x7F, (spec.num_blocks, BS, RANK), dtype=torch.uint8, device="cuda")
        lat |= torch.randint(0, 2, lat.shape, dtype=torch.uint8, device="cuda") << 7
        cache[..., :RANK] = lat
        cache[..., RANK : RANK + 16].view(torch.float32).uniform_(0.001, 0.01)
        cache[..., RANK + 16 :].view(torch.bfloat16).normal_()
        del lat
    q = torch.randn(batch_size, heads, RANK, device="cuda", dtype=torch.bfloat16) * 0.05
    qp = torch.randn(batch_size, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    return spec, batch, cache, q, qp, perm


def contiguous_bf16(spec, cache, perm):
    """The peer's cache: the same tokens gathered into [B, ctx, 576] bf16 (FP8 dequantised)."""
    rows = cache[perm.cuda()].reshape(perm.shape[0], -1, spec.entry_size)
    if not spec.is_fp8:
        return rows
    lat = rows[..., :RANK].contiguous().view(torch.float8_e4m3fn).float()
    scl = rows[..., RANK : RANK + 16].contiguous().view(torch.float32)
    lat = lat * scl.repeat_interleave(128, dim=-1)
    rope = rows[..., RANK + 16 :].contiguous().view(torch.bfloat16)
    return torch.cat([lat.bfloat16(), rope], dim=-1)


def peer_fn(kv, q_full, scale):
    def run():
        s = torch.einsum("bhd,bkd->bhk", q_full, kv).float() * scale
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        return torch.einsum("bhk,bkr->bhr", p, kv[..., :RANK])

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3")
    ap.add_argument("--shapes", default="all", help="all or e.g. '64x4096x128,128x4096x16'")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--splits", default="", help="e.g. '1024,2048': the plan's split forced to each (vs the rule's)")
    args = ap.parse_args()
    from deepinfer.registry import load_backend

    be = load_backend("cuda_sm100")
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    read, copy, mm = ceilings()
    print(f"ceilings: HBM read (sum, 4 GiB) {read:.0f} GB/s; copy {copy:.0f} GB/s (r+w); "
          f"bf16 matmul 8192^3 {mm:.0f} TFLOPS", flush=True)
    flush = torch.empty(256 * 2**20, dtype=torch.int32, device="cuda")  # 1 GiB: evicts the 60 MB L2
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    best_cfg: dict = {}
    rows = []
    for kv_dtype in args.dtypes.split(","):
        for (b, ctx, h) in shapes:
            spec, batch, cache, q, qp, perm = make_case(be, b, ctx, h, kv_dtype, gen)
            scale = (128 + 64) ** -0.5
            kv_bytes = b * ctx * spec.bytes_per_token + q.numel() * 2 + qp.numel() * 2 + q.numel() * 2
            flops = 2 * b * h * ctx * (RANK + ROPE + RANK)
            cls = (kv_dtype, 16 if h <= 16 else 32 if h <= 32 else 128)
            cands = SWEEP[cls] if args.sweep else [("", None)]
            if args.splits:  # the rule's own choice first, then each forced split, all on the default tiles
                cands = [("", None)] + [("", int(v)) for v in args.splits.split(",")]
            results = []
            for ci, (cfg, split_override) in enumerate(cands):
                if cfg:
                    os.environ["DEEPINFER_MLA_CONFIG"] = cfg
                else:
                    os.environ.pop("DEEPINFER_MLA_CONFIG", None)
                g = plan = None
                try:
                    plan = be.plan_attention(batch, spec, split_tokens=split_override)
                    out_box = {}

                    def ours():
                        out_box["o"] = be.run_attention(plan, cache, q, qp, scale)

                    g = graph_of(ours)
                    ms = events_median(g.replay, args.reps, flush)
                    results.append((ms, cfg or "default", plan.split_tokens, out_box["o"].clone(), ci))
                except Exception as exc:  # a config that does not build must not end the sweep
                    print(f"  config {cfg or 'default'} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                del g
            os.environ.pop("DEEPINFER_MLA_CONFIG", None)
            if not results:
                continue
            peer_ms, errs = float("nan"), [float("nan")] * len(results)
            if not args.no_peer:
                kv = contiguous_bf16(spec, cache, perm)
                q_full = torch.cat([q, qp], dim=-1)
                fn = peer_fn(kv, q_full, scale)
                ref = fn().float()
                errs = [((r[3].float() - ref).abs().max() / ref.abs().max()).item() for r in results]
                peer_ms = events_median(graph_of(fn).replay, args.reps, flush)
                del kv, ref
            if len(cands) > 1:
                print(f"  sweep {kv_dtype} {b}x{ctx}x{h}: " + ", ".join(
                    f"{c}/split {sp}: {m:.4f} ms (err {e:.1e})" for (m, c, sp, *_), e in zip(results, errs)),
                    flush=True)
            default_ms = results[0][0] if results[0][4] == 0 else float("nan")
            ok = [(r, e) for r, e in zip(results, errs) if not e > 2e-2] or list(zip(results, errs))
            (ms, cfg, split, out, _), err = min(ok, key=lambda re_: re_[0][0])
            best_cfg.setdefault(cls, []).append((b, ctx, h, cfg, split, ms))
            gbs, tfl = kv_bytes / (ms * 1e-3) / 1e9, flops / (ms * 1e-3) / 1e12
            fm = FLASHMLA_MS.get((b, ctx, h))
            row = dict(dtype=kv_dtype, batch=b, ctx=ctx, heads=h, config=cfg, split=split, ms=ms, default_ms=default_ms,
                       gbs=gbs, bw_ratio=gbs / read, tflops=tfl, mm_ratio=tfl / mm, flashmla_ms=fm,
                       vs_flashmla=(fm / ms) if fm else None, peer_ms=peer_ms, vs_peer=peer_ms / ms,
                       peer_gbs=kv_bytes / (peer_ms * 1e-3) / 1e9 if spec.dtype == "bf16" else None, max_rel_err=err)
            rows.append(row)
            print(f"{kv_dtype:8s} B={b:3d} ctx={ctx:5d} H={h:3d} [{row['config']}, split {split}] {ms:.4f} ms "
                  f"{gbs:6.0f} GB/s ({gbs / read:.2f} of read) {tfl:5.0f} TFLOPS ({tfl / mm:.2f} of matmul) | "
                  f"FlashMLA bf16 {fm} ms: x{row['vs_flashmla'] or float('nan'):.2f} | torch {peer_ms:.4f} ms: "
                  f"x{row['vs_peer']:.2f} | err {err:.1e}", flush=True)
            del cache, plan, results
            torch.cuda.empty_cache()
    print("\n| cache | B | ctx | H | config / split | ms (default ms) | GB/s | of HBM read | TFLOPS | of matmul "
          "| FlashMLA ms (bf16) | FlashMLA/ours | torch ms | torch/ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['batch']} | {r['ctx']} | {r['heads']} | {r['config']} / {r['split']} | "
              f"{r['ms']:.4f} ({r['default_ms']:.4f}) | {r['gbs']:.0f} | "
              f"{r['bw_ratio']:.2f} | {r['tflops']:.0f} | {r['mm_ratio']:.2f} | {r['flashmla_ms']} | "
              f"{r['vs_flashmla'] or float('nan'):.2f} | {r['peer_ms']:.4f} | {r['vs_peer']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(read_gbs=read, copy_gbs=copy, matmul_tflops=mm, device=props.name, rows=rows,
                           best={f"{k[0]}/{k[1]}": v for k, v in best_cfg.items()}), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
