"""Prefill attention for MLA's decompressed form on one GPU: PyTorch SDPA backends at DeepSeek head sizes.

MLA prefill rebuilds per-head keys (nope 128 + rope 64 = 192) and values (128): the key and value head
sizes differ. FlashAttention-2 (PyTorch's flash backend) needs one head size, so values get padded to 192;
cuDNN and the memory-efficient backend take v = 128 directly. This measures each on a chunk of queries at
the end of a longer sequence (lower-right causal), and cuda_sm100's split (the chunk's square causal block
plus its prefix, both on cuDNN, merged), and the Triton flash kernel (backends/cuda_sm100/
prefill_attention_kernels.py, on MLA's layout: v a strided view of a [Ls, H, 256] tensor), next to the bf16
matmul rate measured in the same run. "first call" is the wall time of a shape's first call: cuDNN builds an
execution plan per shape; Triton compiles once per process (the first chunk's first call; later shapes reuse
it). --triton-alt times other Triton tiles too, e.g. tma:64x3,ptr:64x3 (loads:BLOCK_N x stages).

    python benchmarks/prefill_attention.py [--heads 16] [--chunks 16384x32768,4096x4096] [--triton-alt ...]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.errors import TritonError

from deepinfer.backends.cuda_sm100.prefill_attention import split_prefill_attention
from deepinfer.backends.cuda_sm100.prefill_attention_kernels import flash_prefill
from gpu_timing import ceilings, events_median


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--chunks", default="16384x32768,16384x16384,4096x4096,4000x8000,4001x8001")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--triton-alt", default="", help="extra Triton tiles, e.g. tma:64x3,ptr:64x3,ptr:128x2")
    args = p.parse_args()
    _, _, mm = ceilings()
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {mm:.0f} TFLOPS, torch {torch.__version__}")
    h, dk, dv = args.heads, 192, 128
    for spec in args.chunks.split(","):
        q_len, s_len = (int(v) for v in spec.split("x"))
        q = torch.randn(1, h, q_len, dk, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, h, s_len, dk, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, h, s_len, dv, device="cuda", dtype=torch.bfloat16)
        causal = dict(is_causal=True) if q_len == s_len else dict(attn_mask=causal_lower_right(q_len, s_len))
        # useful FLOPs: QK^T (dk) and PV (dv) over the visible keys
        visible = q_len * (s_len - q_len) + q_len * (q_len + 1) / 2
        flops = 2 * h * visible * (dk + dv)
        ref = None
        qs, ks, vs = (t[0].transpose(0, 1) for t in (q, k, v))  # [L, H, d] as the model holds them
        split = lambda: split_prefill_attention(qs, ks, vs, dk ** -0.5).transpose(0, 1)[None]  # noqa: E731
        # Triton on the layout MLA hands over: q, k [L, H, 192] contiguous, v = kv[..., 128:] of [Ls, H, 256]
        qm, km = qs.contiguous(), ks.contiguous()
        kv = torch.empty(s_len, h, 2 * dv, device="cuda", dtype=torch.bfloat16)  # [k_nope | v] per head
        kv[..., dv:] = vs
        vm = kv[..., dv:]
        tiles = [("triton (ours)", {})] + [
            (f"triton {t}", dict(tma=t.startswith("tma"), block_n=int(t[4:].split("x")[0]),
                                 num_stages=int(t.split("x")[1]))) for t in filter(None, args.triton_alt.split(","))]
        tri = [(name, (lambda kw=kw: flash_prefill(qm, km, vm, dk ** -0.5, **kw).transpose(0, 1)[None]), v)
               for name, kw in tiles]
        for name, backend, vv in (("flash, v padded to 192", SDPBackend.FLASH_ATTENTION, F.pad(v, (0, dk - dv))),
                                  ("cudnn, v 128", SDPBackend.CUDNN_ATTENTION, v),
                                  ("efficient, v 128", SDPBackend.EFFICIENT_ATTENTION, v),
                                  ("cudnn split + merge (ours)", None, v), *tri):
            try:
                with sdpa_kernel(backend if isinstance(backend, SDPBackend) else SDPBackend.CUDNN_ATTENTION):
                    fn = split if backend is None else backend if callable(backend) else \
                        (lambda: F.scaled_dot_product_attention(q, k, vv, scale=dk ** -0.5, **causal))  # noqa: E731
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = fn()[..., :dv].float()
                    torch.cuda.synchronize()
                    cold = (time.perf_counter() - t0) * 1e3
                    ms = events_median(fn, args.reps)
                err = 0.0 if ref is None else ((out - ref).abs().max() / ref.abs().max()).item()
                ref = out if ref is None else ref
                tf = flops / (ms * 1e-3) / 1e12
                print(f"  {q_len}x{s_len} h{h} {name:26s} {ms:8.3f} ms {tf:6.0f} TFLOPS ({tf / mm:.2f} of matmul) "
                      f"err {err:.1e}; first call {cold:.1f} ms", flush=True)
            except (RuntimeError, TritonError) as exc:  # TritonError: a Triton tile over the shared memory
                print(f"  {q_len}x{s_len} h{h} {name:26s} unavailable: {str(exc).splitlines()[0][:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
