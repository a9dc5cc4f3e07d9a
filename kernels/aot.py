"""Compile a Triton kernel for a CUDA GPU ahead of time, on any Linux machine.

Triton ships its compiler and NVIDIA's ``ptxas``, so Triton IR, PTX and a cubin can be built
without a GPU. The kernels must be real JIT functions (``TRITON_INTERPRET`` unset). Used by the
compile test (``tests/aot_compile.py``: sm_75, sm_86 and sm_90, each kernel's shared memory
against the target's limit) and chapter 09's kernel report (``minivllm.course.kernel_report``).
"""

from __future__ import annotations

SM90 = ("cuda", 90, 32)  # backend, compute capability, warp size
# the most shared memory one block may use (bytes): T4 (sm_75), A10/RTX 30xx (sm_86), H100/H200
SHARED_MEMORY_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}


def compile_for_sm90(fn, pointers: dict, floats=(), constexprs=None, divisible=(),
                     aligned: bool = False, num_warps: int = 4, num_stages: int = 3,
                     capability: int = 90):
    """Compile ``fn`` for compute capability ``capability`` (default 90, an H200) with pointer
    element types ``pointers`` (name -> "fp32", "bf16", "i32"...), fp32 scalars ``floats``,
    ``constexprs``, and i32 for every other argument. ``.metadata.shared`` of the result is the
    shared memory a block of it needs.

    ``aligned``: declare every pointer, every ``stride*`` argument and those named in
    ``divisible`` multiples of 16, as a launch from torch would (Triton's JIT specialises on
    that: it lets the compiler emit wide, vectorised loads).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = constexprs or {}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {}
    if aligned:
        for i, name in enumerate(fn.arg_names):
            if name in pointers or name.startswith("stride") or name in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


compile_for_gpu = compile_for_sm90
