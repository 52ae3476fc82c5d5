"""Compile a Triton (or Gluon) kernel for sm_90 on a machine without a GPU and report what ptxas made of it.

Triton wheels ship ptxas, so the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) runs anywhere. The
report gives registers per thread, spilled stack bytes, shared memory, and how many loads the pipeliner
turned into asynchronous copies: enough to reject a tile configuration or a kernel rewrite before spending
device time on it. Registers near 255 with a non-zero stack mean spills; zero async copies in a loop that
loads tiles means the loop is not software-pipelined.

Arguments are given as the launch would pass them: a dtype string for pointers ("*bf16", "*fp8e4nv",
"*fp32", "*i32"), a Python int for integers (specialised as the JIT does: divisible by 16 or not), a float
for float scalars; constexprs by value.

    from triton_sm90_report import compile_report
    print(compile_report(kernel, args, consts, num_warps=8, num_stages=2))
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_sm90(kernel, args: dict, consts: dict, num_warps: int = 4, num_stages: int = 2, arch: int = 90,
                 **options):
    """Compile for sm_<arch>. Integers are specialised as the JIT does unless the kernel says do_not_specialize
    (1 becomes a constexpr, multiples of 16 get the divisibility hint); a "tensordesc<...>" string stands for a
    TMA descriptor argument (Gluon's, layout included); options go to the compiler as the launch's would (e.g.
    maxnreg). Passing a stride of 1 as a plain integer would hide the unit stride that the real launch specialises
    on, and with it the vectorised, pipelined loads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
    keep = set(getattr(kernel, "do_not_specialize", None) or ())
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        if name not in args:
            raise KeyError(f"no example value for argument {name!r}")
        value = args[name]
        if isinstance(value, str) and value.startswith("tensordesc"):
            signature[name] = value
        elif isinstance(value, str):  # a pointer, 16-byte aligned as torch allocations are
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and i not in keep and name not in keep:  # the JIT makes an integer 1 a constexpr
            signature[name] = "constexpr"
            consts = {**consts, name: 1}
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and i not in keep and name not in keep:
                attrs[(i,)] = [["tt.divisibility", 16]]
    if getattr(kernel, "is_gluon", lambda: False)():  # Gluon kernels take their own source
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def resource_usage(compiled) -> dict:
    from triton.backends.nvidia import compiler

    cuobjdump = os.path.join(os.path.dirname(compiler.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:
        out = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.S)
    ttgir = compiled.asm["ttgir"]
    return dict(regs=int(m[1]), stack=int(m[2]), smem=compiled.metadata.shared,
                async_copies=ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local"),
                wgmma=ttgir.count("warp_group_dot "))


def compile_report(kernel, args: dict, consts: dict, num_warps: int = 4, num_stages: int = 2, arch: int = 90) -> dict:
    return resource_usage(compile_sm90(kernel, args, consts, num_warps, num_stages, arch))
