"""Prefill attention for MLA's decompressed form on one GPU: PyTorch SDPA backends at DeepSeek head sizes.

MLA prefill rebuilds per-head keys (nope 128 + rope 64 = 192) and values (128): the key and value head
sizes differ. FlashAttention-2 (PyTorch's flash backend) needs one head size, so values get padded to 192;
cuDNN and the memory-efficient backend take v = 128 directly. This measures each on a chunk of queries at
the end of a longer sequence (lower-right causal), next to the bf16 matmul rate measured in the same run.

    python benchmarks/prefill_attention.py [--heads 16] [--chunks 16384x32768,4096x4096]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from gpu_timing import ceilings, events_median


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--chunks", default="16384x32768,16384x16384,4096x4096")
    p.add_argument("--reps", type=int, default=10)
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
        for name, backend, vv in (("flash, v padded to 192", SDPBackend.FLASH_ATTENTION, F.pad(v, (0, dk - dv))),
                                  ("cudnn, v 128", SDPBackend.CUDNN_ATTENTION, v),
                                  ("efficient, v 128", SDPBackend.EFFICIENT_ATTENTION, v)):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(q, k, vv, **causal)  # noqa: E731
                    out = fn()[..., :dv].float()
                    ms = events_median(fn, args.reps)
                err = 0.0 if ref is None else ((out - ref).abs().max() / ref.abs().max()).item()
                ref = out if ref is None else ref
                tf = flops / (ms * 1e-3) / 1e12
                print(f"  {q_len}x{s_len} h{h} {name:24s} {ms:8.3f} ms {tf:6.0f} TFLOPS ({tf / mm:.2f} of matmul) "
                      f"err {err:.1e}", flush=True)
            except RuntimeError as exc:
                print(f"  {q_len}x{s_len} h{h} {name:24s} unavailable: {str(exc).splitlines()[0][:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
