"""The Gluon MLA kernel compiled for sm_90 on any machine (Triton ships ptxas): it still builds, and its
shared memory is what the host's capacity check (`SMEM_BYTES`) assumes. The GPU tests run it; this keeps a
compile break or a shared-memory change from first showing up on a GPU."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _compile(fp8: bool):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from deepinfer.backends.cuda_sm100 import mla_gluon_kernels as G

    kernel = G.mla_attn_gluon_kernel
    if fp8:  # DeepSeek's 656-byte rows through the fp8 / fp32 / bf16 views, strides in elements
        views = dict(lat_ptr="*fp8e4nv", scl_ptr="*fp32", rope_ptr="*bf16", lat_sb=64 * 656, lat_st=656,
                     scl_sb=64 * 164, scl_st=164, rope_sb=64 * 328, rope_st=328, scale_off=128, rope_off=264)
    else:
        views = dict(lat_ptr="*bf16", scl_ptr="*bf16", rope_ptr="*bf16", lat_sb=64 * 576, lat_st=576,
                     scl_sb=64 * 576, scl_st=576, rope_sb=64 * 576, rope_st=576, scale_off=0, rope_off=512)
    args = dict(q_ptr="*bf16", qpe_ptr="*bf16", q_st=128 * 512, q_sh=512, qpe_st=128 * 64, qpe_sh=64, BS=64,
                bt_ptr="*i32", bt_stride=64, meta_ptr="*i32", meta_stride=128, items_ptr="*i32", out_ptr="*bf16",
                lse_ptr="*fp32", o_st=128 * 512, o_sh=512, po_ptr="*fp32", plse_ptr="*fp32", H=128, qk_scale=0.1,
                row_tiles=2, **views)
    consts = dict(R=G.R, P=G.P, BM=G.BM, BN=G.BN, FP8=fp8, PDL=True)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str):  # pointers: 16-byte aligned, as torch allocates
            signature[name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:  # integers specialised as the JIT does: divisible by 16 or not
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=G.NUM_WARPS))


@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_mla_kernel_compiles_for_sm90_within_its_shared_memory(fp8):
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    if A._gluon_kernels() is None:
        pytest.skip(f"the Gluon kernel is written for Triton 3.6 (this is {triton.__version__})")
    compiled = _compile(fp8)
    assert compiled.metadata.shared == A._gluon_kernels().SMEM_BYTES
    ptx = compiled.asm["ptx"]
    assert ptx.count("wgmma.mma_async") > 0 and "cp.async.cg.shared.global" in ptx
    assert "griddepcontrol.wait" in ptx  # PDL: nothing is read before the previous kernel is done
