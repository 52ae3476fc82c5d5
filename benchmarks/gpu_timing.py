"""Timing helpers shared by the GPU benchmarks: CUDA-event medians, graph capture, and the machine's
ceilings (HBM read bandwidth and bf16 matmul rate) measured in the same run as the thing compared to them."""

from __future__ import annotations

import statistics

import torch


def events_median(fn, reps: int, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of fn() over reps calls, timed with CUDA events (zeroing `flush` before each call
    evicts the L2 cache)."""
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile / allocate outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def ceilings() -> tuple[float, float, float]:
    """(HBM read GB/s from a sum over 4 GiB, device-copy GB/s over 2 GiB, bf16 matmul TFLOPS at 8192^3)."""
    x = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()
    read = 2**32 / (events_median(lambda: x.sum(), 10) * 1e-3) / 1e9
    src, dst = x[: 2**30], torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    copy = 2 * 2**31 / (events_median(lambda: dst.copy_(src), 10) * 1e-3) / 1e9
    del x, dst, src
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192**3 / (events_median(lambda: a @ b, 10) * 1e-3) / 1e12
    return read, copy, mm
