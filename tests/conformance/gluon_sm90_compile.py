"""Compile the Gluon kernels for sm_90 (Triton ships ptxas, so no GPU is needed) and print, as JSON, what the
tests check: shared memory and the PTX instructions that must be there.

Run as a script in its own process (test_gluon_compile.py does): Gluon compiles only with the Triton interpreter
off, and the test session runs with it on, which turns every jit helper into an interpreted function.

    TRITON_INTERPRET=0 python tests/conformance/gluon_sm90_compile.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from triton_sm90_report import compile_sm90, resource_usage  # noqa: E402


def mla_args(fp8: bool) -> dict:
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
    return args


def mla(fp8: bool):
    from deepinfer.backends.cuda_sm100 import mla_gluon_kernels as G

    consts = dict(R=G.R, P=G.P, BM=G.BM, BN=G.BN, FP8=fp8, PDL=True)
    return compile_sm90(G.mla_attn_gluon_kernel, mla_args(fp8), consts, G.NUM_WARPS)


def mla_keys_as_m(fp8: bool):
    from deepinfer.backends.cuda_sm100 import mla_gluon_kt_kernels as K

    args = {**mla_args(fp8), "H": 16, "q_st": 16 * 512, "qpe_st": 16 * 64, "o_st": 16 * 512, "row_tiles": 1}
    consts = dict(R=K.R, P=K.P, BM=K.BM, BN=K.BN, PDL=True, EARLY=True)
    kernel = K.mla_attn_gluon_kt_e4m3_kernel if fp8 else K.mla_attn_gluon_kt_kernel
    return compile_sm90(kernel, args, consts, K.NUM_WARPS)


def mla_keys_as_m_ws():
    from deepinfer.backends.cuda_sm100 import mla_gluon_kt_ws_kernels as W

    half, piece, p, g = W.HALF.value, W.PIECE.value, W.P.value, W.G.value
    views = dict(lat_desc=f"tensordesc<fp8e4nv[{half}, {piece}],{W.LAT_SMEM.value!r}>",
                 rope_desc=f"tensordesc<bf16[{half}, {p}],{W.PE_SMEM.value!r}>",
                 scl_desc=f"tensordesc<fp32[{half}, {g}],{W.SC_SMEM.value!r}>")
    args = {k: v for k, v in mla_args(True).items() if not k.startswith(("lat_", "scl_", "rope_", "scale_"))}
    args = {**args, **views, "H": 16, "q_st": 16 * 512, "qpe_st": 16 * 64, "o_st": 16 * 512, "row_tiles": 1}
    return compile_sm90(W.mla_attn_gluon_kt_e4m3_ws_kernel, args, dict(PDL=True, EARLY=True), W.NUM_WARPS,
                        maxnreg=W.MAXNREG)


def mla_seesaw(tma: bool, fp8: bool = False):
    from deepinfer.backends.cuda_sm100 import mla_seesaw_keys as K
    from deepinfer.backends.cuda_sm100 import mla_seesaw_kernels as S

    kv = pe = f"tensordesc<bf16[64, 64],{K.KV_SMEM.value!r}>" if tma else "*bf16"  # eager launches pass the cache
    if fp8:
        kv = f"tensordesc<fp8e4nv[64, {K.E4M3_BOX.value}],{K.E4M3_SMEM.value!r}>"
    return compile_sm90(S.mla_seesaw_kernel, {**mla_args(fp8), "kv_desc": kv, "pe_desc": pe},
                        dict(TMA=tma, FP8=fp8, PDL=True), S.NUM_WARPS, maxnreg=S.MAXNREG)


def gemm(consumers: int, out_dtype: str, layout: int, split: int = 1):
    from triton.experimental.gluon import language as gl

    from deepinfer.backends.cuda_sm100 import gemm_gluon_kernels as G

    half, bn, bk = G.HALF.value, G.BN.value, G.BK.value
    al = gl.NVMMASharedLayout.get_default_for([half, bk], gl.float8e4nv)
    bl = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv)
    cl = gl.NVMMASharedLayout.get_default_for([half, bn], {"bf16": gl.bfloat16, "fp16": gl.float16}[out_dtype])
    args = dict(a_desc=f"tensordesc<fp8e4nv[{half}, {bk}],{al!r}>", b_desc=f"tensordesc<fp8e4nv[{bn}, {bk}],{bl!r}>",
                c_desc=f"tensordesc<{out_dtype}[{half}, {bn}],{cl!r}>", c_ptr="*fp32" if split > 1 else f"*{out_dtype}", stride_cm=7168,
                stride_cw=4096 * 7168,
                as_ptr="*fp32", stride_asm=1, stride_ask=4096, bs_ptr="*fp32", stride_bsg=56 * 56, stride_bsn=56,
                stride_bsk=1, tmap_ptr="*i32", M=4096, N=7168, K=7168, m_tiles=32)
    stages, regs, maxnreg, _ = G.CONFIGS[consumers]
    consts = dict(GROUP_M=G.GROUP_M, CONSUMERS=consumers, STAGES=stages, CONSUMER_REGS=regs, LAYOUT=layout, SPLIT=split)
    return compile_sm90(G.fp8_gemm_ws_kernel, args, consts, G.NUM_WARPS, maxnreg=maxnreg)


def report(compiled) -> dict:
    return {"shared": compiled.metadata.shared, "ptx": compiled.asm["ptx"]}


def main() -> None:
    out = {f"mla-{fp8}": report(mla(fp8)) for fp8 in (False, True)}
    for fp8 in (False, True):
        kt = mla_keys_as_m(fp8)
        out[f"mla-kt-{fp8}"] = {**report(kt), **resource_usage(kt)}
    ws = mla_keys_as_m_ws()
    out["mla-kt-ws"] = {**report(ws), **resource_usage(ws)}
    for tma in (False, True):
        seesaw = mla_seesaw(tma)
        out[f"mla-seesaw-{int(tma)}"] = {**report(seesaw), **resource_usage(seesaw)}
    seesaw = mla_seesaw(True, fp8=True)
    out["mla-seesaw-fp8"] = {**report(seesaw), **resource_usage(seesaw)}
    for consumers in (2, 3):
        for out_dtype in ("bf16", "fp16"):
            for layout in (0, 1):
                out[f"gemm-{consumers}-{out_dtype}-{layout}"] = report(gemm(consumers, out_dtype, layout))
    split = gemm(2, "bf16", 0, split=2)
    out["gemm-2-bf16-0-split2"] = {**report(split), **resource_usage(split)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
