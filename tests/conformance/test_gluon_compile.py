"""The Gluon kernels (MLA decode, warp-specialised FP8 GEMM) compiled for sm_90 on any machine (Triton ships
ptxas): they still build, and their shared memory is what the host's capacity checks (`SMEM_BYTES`) assume.
The GPU tests run them; this keeps a compile break or a shared-memory change from first showing up on a GPU."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _mla_args(fp8: bool):
    from deepinfer.backends.cuda_sm100 import mla_gluon_kernels as G

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
    return G.mla_attn_gluon_kernel, args, dict(R=G.R, P=G.P, BM=G.BM, BN=G.BN, FP8=fp8, PDL=True), G.NUM_WARPS


def _compile(kernel, args: dict, consts: dict, num_warps: int, **options):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str) and value.startswith("tensordesc"):
            signature[name] = value
        elif isinstance(value, str):  # pointers: 16-byte aligned, as torch allocates
            signature[name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:  # integers specialised as the JIT does: divisible by 16 or not
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, **options))


def _skip_unless_tested_triton():
    from deepinfer.backends.cuda_sm100 import gluon_gate

    if not gluon_gate.gluon_release():
        pytest.skip(f"the Gluon kernels are written for Triton 3.6 (this is {triton.__version__})")


@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_mla_kernel_compiles_for_sm90_within_its_shared_memory(fp8):
    from deepinfer.backends.cuda_sm100 import mla_launch as A

    _skip_unless_tested_triton()
    compiled = _compile(*_mla_args(fp8))
    assert compiled.metadata.shared == A._gluon_kernels().SMEM_BYTES
    ptx = compiled.asm["ptx"]
    assert ptx.count("wgmma.mma_async") > 0 and "cp.async.cg.shared.global" in ptx
    assert "griddepcontrol.wait" in ptx  # PDL: nothing is read before the previous kernel is done


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp16"])
def test_gluon_fp8_gemm_compiles_for_sm90_within_its_shared_memory(consumers, out_dtype, layout):
    """The warp-specialised GEMM (one matrix; contiguous groups): TMA copies, e4m3 wgmma, the register split
    between its partitions."""
    _skip_unless_tested_triton()
    from triton.experimental.gluon import language as gl

    from deepinfer.backends.cuda_sm100 import gemm_gluon_kernels as G

    al = gl.NVMMASharedLayout.get_default_for([G.HALF.value, G.BK.value], gl.float8e4nv)
    bl = gl.NVMMASharedLayout.get_default_for([G.BN.value, G.BK.value], gl.float8e4nv)
    cl = gl.NVMMASharedLayout.get_default_for([G.HALF.value, G.BN.value], {"bf16": gl.bfloat16, "fp16": gl.float16}[out_dtype])
    args = dict(a_desc=f"tensordesc<fp8e4nv[{G.HALF.value}, {G.BK.value}],{al!r}>",
                b_desc=f"tensordesc<fp8e4nv[{G.BN.value}, {G.BK.value}],{bl!r}>",
                c_desc=f"tensordesc<{out_dtype}[{G.HALF.value}, {G.BN.value}],{cl!r}>", c_ptr=f"*{out_dtype}",
                stride_cm=7168, as_ptr="*fp32", stride_asm=1, stride_ask=4096, bs_ptr="*fp32", stride_bsg=56 * 56,
                stride_bsn=56, stride_bsk=1, tmap_ptr="*i32", M=4096, N=7168, K=7168, m_tiles=32)
    stages, regs, maxnreg, smem = G.CONFIGS[consumers]
    consts = dict(GROUP_M=G.GROUP_M, CONSUMERS=consumers, STAGES=stages, CONSUMER_REGS=regs, LAYOUT=layout)
    compiled = _compile(G.fp8_gemm_ws_kernel, args, consts, G.NUM_WARPS, maxnreg=maxnreg)
    assert compiled.metadata.shared == smem
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{G.PRODUCER_REGS.value};" in ptx
