"""Programmatic dependent launch (Hopper and later), on by default on SM90+; DEEPINFER_PDL=0 turns it off.

A decode step at batch 1 is a chain of ~15 small launches per layer, each paying its launch and ramp-up in
full after the previous kernel drains. With PDL a kernel may be scheduled while its predecessor still runs:
every kernel here calls `enter`, which waits for the previous grid to finish and flush its memory
(griddepcontrol.wait), then lets its own successor launch (griddepcontrol.launch_dependents). Nothing is written
before the wait, and only what is settled is read before it, so stream order holds as without PDL: what no
kernel of the step writes (weights, the attention plan the host wrote before the step's first kernel), or what
a kernel at least two launches back wrote (its successor waited for it before letting this kernel launch).
What overlaps is the launch, the CTAs' arrival and those reads. A kernel after a launch without PDL (cuBLAS,
torch ops) simply starts when that one ends.

A one-matrix GEMM also asks for the first K blocks of its weight rows (what its pipeline's first stages load) in L2
before its wait (gemm_kernel's PREFETCH), so their streaming starts during the previous kernel. H200, V2-Lite
batch 1 (benchmarks/RESULTS.md, eighth session): FP8 437.0 vs 387.6 tok/s, bf16 388.1 vs 374.7; the engine's
graph and greedy-equality tests pass under it (gpu_suite.sh pdl).
Never under the Triton interpreter, which has no griddepcontrol.

EARLY (early_trigger(), on unless DEEPINFER_PDL_EARLY=0): the kernel lets its successor launch before its own wait,
so that successor's reads before its wait overlap more than one kernel (a chain of them can be launched at once).
Then what the successor reads before its wait must not come from any kernel still in that chain: only the kernels
of the MLA block take it (the fused cache write, the per-head GEMVs, the keys-as-M attention and the combine),
whose successors read nothing before their wait but weights and the step's plan. The two-launches-back rule
holds again from the first kernel after them that enters without EARLY (o_proj's GEMV): its wait is for a kernel
that waited in turn.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl


@functools.cache
def launch_kwargs() -> dict:
    """Extra launch arguments for a PDL-capable kernel: {} off an SM90+ GPU or with DEEPINFER_PDL=0."""
    if os.environ.get("DEEPINFER_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        return {}
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return {}
    return {"PDL": True, "launch_pdl": True}


@functools.cache
def early_trigger() -> bool:
    """Whether the kernels that may (see EARLY in the module docstring) let their successor launch before their own
    wait; DEEPINFER_PDL_EARLY=0 keeps every kernel's trigger after its wait (A/B runs)."""
    return bool(launch_kwargs()) and os.environ.get("DEEPINFER_PDL_EARLY", "1") != "0"


@triton.jit
def enter(PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """First statement of a PDL-capable kernel (see the module docstring)."""
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
