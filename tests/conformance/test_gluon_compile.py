"""The Gluon kernels (MLA decode: lockstep and seesaw; warp-specialised FP8 GEMM) compiled for sm_90 on any machine
(Triton ships ptxas): they still build, and their shared memory is what the host's capacity checks (`SMEM_BYTES`)
assume.
The GPU tests run them; this keeps a compile break or a shared-memory change from first showing up on a GPU.

The compiles run in one child process (gluon_sm90_compile.py) with the Triton interpreter off and an empty
cache: a cached kernel would skip the compile this is here to check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from deepinfer.backends.cuda_sm100 import gluon_gate

    if not gluon_gate.gluon_release():
        pytest.skip(f"the Gluon kernels are written for Triton 3.6 (this is {triton.__version__})")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton_cache")))
    script = Path(__file__).with_name("gluon_sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_mla_kernel_compiles_for_sm90_within_its_shared_memory(compiled, fp8):
    from deepinfer.backends.cuda_sm100 import mla_gluon_kernels as G

    case = compiled[f"mla-{fp8}"]
    assert case["shared"] == G.SMEM_BYTES
    assert case["ptx"].count("wgmma.mma_async") > 0 and "cp.async.cg.shared.global" in case["ptx"]
    assert "griddepcontrol.wait" in case["ptx"]  # PDL: nothing is read before the previous kernel is done
    assert ("mul.rn.f16x2" in case["ptx"]) == fp8  # an E4M3 tile widened and scaled a pair at a time


@pytest.mark.parametrize("fp8", [False, True])
def test_keys_as_m_mla_kernel_compiles_for_sm90_without_spills(compiled, fp8):
    """Keys as the wgmma's M, 16 query rows as its N: 64 x 16 MMAs only (the score MMAs over 512 + 64 channels in
    steps of 16, the output MMA's 512 columns in 8 blocks over 64 keys), cp.async copies, the shared memory that
    runs_on checks. The bf16 kernel has no stack; the E4M3 kernel reads its latent channels as float16 (the
    rope's 4 score MMAs stay bf16) and takes 16 bytes of stack: four values ptxas keeps across the key loop for
    the epilogue (sm_90 SASS: no local memory access in the loop)."""
    from deepinfer.backends.cuda_sm100 import mla_gluon_kt_kernels as K

    case = compiled[f"mla-kt-{fp8}"]
    ptx = case["ptx"]
    mmas = (512 + 64) // 16 + 8 * 64 // 16
    if fp8:
        assert case["stack"] <= 16 and case["shared"] == K.SMEM_BYTES
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == 64 // 16
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16") == mmas - 64 // 16
        assert ptx.count("cvt.rn.f16x2.e4m3x2") == 64 * 512 // 128 // 2  # a thread's share of a tile, unrolled
    else:
        assert case["stack"] == 0 and case["shared"] < K.SMEM_BYTES
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == mmas
    assert ptx.count("wgmma.mma_async") == ptx.count("m64n16k16")
    assert "cp.async.cg.shared.global" in ptx and "griddepcontrol.wait" in ptx
    _triggers_before_its_wait(ptx)


def _triggers_before_its_wait(ptx: str) -> None:
    """pdl.py's EARLY (the keys-as-M kernels compiled with it): the successor may launch before this kernel waits."""
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")


def test_warp_specialised_keys_as_m_kernel_compiles_for_sm90_without_spills(compiled):
    """The E4M3 keys-as-M kernel with its loads in a TMA warp and its widening in a producer warpgroup: the
    consumer's MMAs as the one-warpgroup kernel's; the cache read only by TMA (a tile's two halves, six copies
    each: four 128-byte row boxes, rope keys, scales); a thread's share of a tile widened twice over (unmasked, and
    masked for an item's last half tile); the partitions meeting at mbarriers (consumer: full; producer: the two
    raw slots and empty; loader: the raw slots' hand-backs) and synchronising each on its own named barrier; no
    stack."""
    from deepinfer.backends.cuda_sm100 import mla_gluon_kt_ws_kernels as W

    case = compiled["mla-kt-ws"]
    ptx = case["ptx"]
    assert case["stack"] == 0 and case["shared"] == W.SMEM_BYTES
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16") == 64 // 16
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16") == 512 // 16 + 8 * 64 // 16
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global") == 2 * (512 // 128 + 2)
    assert ptx.count("cp.async") == ptx.count("cp.async.bulk.tensor")  # no pointer copies
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * (64 * 512 // 128 // 2)
    assert ptx.count("mbarrier.try_wait") == 1 + 3 + 2
    assert ptx.count("mbarrier.arrive.expect_tx") == 2 and ptx.count("mbarrier.arrive") == 2 + 1 + 3
    assert all(f"bar.sync \t{i}, 128" in ptx for i in (0, 2))  # the consumer's and the producer's own barrier
    assert "griddepcontrol.wait" in ptx
    _triggers_before_its_wait(ptx)


@pytest.mark.parametrize("variant", ["0", "1", "fp8"])
def test_seesaw_mla_kernel_compiles_for_sm90_without_spills(compiled, variant):
    """Both warpgroups' loops keep their wgmma descriptors in registers (a hoisted set spills: 576 B of stack)
    and hand P to each other through stmatrix; PDL as the lockstep kernel. bf16 key blocks by cp.async (eager
    launches) or by TMA (no cp.async in the loop; the queries still come by cp.async); FP8 by TMA, widened to
    float16 in place (one cvt per two values), float16 queries through registers. SMEM_BYTES is the largest."""
    from deepinfer.backends.cuda_sm100 import mla_seesaw_kernels as S

    case = compiled[f"mla-seesaw-{variant}"]
    assert case["stack"] == 0
    assert case["shared"] <= S.SMEM_BYTES
    assert max(compiled[f"mla-seesaw-{v}"]["shared"] for v in ("0", "1", "fp8")) == S.SMEM_BYTES
    ptx = case["ptx"]
    latent = "f16.f16" if variant == "fp8" else "bf16.bf16"
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx  # the rope keys' scores
    assert f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{latent}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n256k16.f32.{latent}" in ptx
    assert "stmatrix" in ptx and "griddepcontrol.wait" in ptx
    assert ("cp.async.mbarrier.arrive.noinc" in ptx) == (variant != "fp8")
    assert ("cp.async.bulk.tensor.2d" in ptx) == (variant != "0")
    # a bf16 cache's direct output leaves through shared memory, whole rows in 16-byte stores (_store_direct)
    assert ("st.global.v4" in ptx) == (variant != "fp8")
    # each warpgroup widens two halves of 64 x 256 a pair, and two before its loop: 8 x 64 x 256 values in all,
    # written twice (the plain conversion, and a sequence's last block's with its bytes masked), each pair of
    # values times its scales in one packed multiply
    widened = 2 * 8 * 64 * 256 // 128 // 2 if variant == "fp8" else 0
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == ptx.count("mul.rn.f16x2") == widened
    assert ptx.count("and.b32 x, ") == widened // 4


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_gluon_fp8_gemm_compiles_for_sm90_within_its_shared_memory(compiled, consumers, out_dtype, layout):
    """The warp-specialised GEMM (one matrix; contiguous groups): TMA copies, e4m3 wgmma, the register split
    between its partitions, and the scales staged by the producer: its lanes' cp.async copies signal the ready
    barrier, and one matrix's kernel makes no global load at all (a warpgroup's wgmma issue waits for its loads
    in flight; the grouped layout reads its tile map)."""
    from deepinfer.backends.cuda_sm100 import gemm_gluon_kernels as G

    case = compiled[f"gemm-{consumers}-{out_dtype}-{layout}"]
    assert case["shared"] == G.CONFIGS[consumers][3]
    ptx = case["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{G.PRODUCER_REGS.value};" in ptx
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    if layout == 0:
        assert "ld.global" not in ptx


def test_gluon_fp8_gemm_split_k_compiles_for_sm90(compiled):
    """Split-K (small M, one matrix): the same rings and register split, float32 partials stored from registers
    (no TMA store), no stack."""
    from deepinfer.backends.cuda_sm100 import gemm_gluon_kernels as G

    case = compiled["gemm-2-bf16-0-split2"]
    assert case["shared"] < G.CONFIGS[2][3] and case["stack"] == 0  # (the output tiles are not allocated)
    ptx = case["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert "st.global" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared" not in ptx  # no TMA store of a bf16 tile
