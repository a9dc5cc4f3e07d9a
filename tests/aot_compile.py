"""Compile every Triton kernel for real GPUs without one: ``python tests/aot_compile.py``.

The interpreter runs the kernels' arithmetic but not Triton's compiler: shape rules of ``tl.dot``,
types, layouts, shared memory. Triton ships ``ptxas``, so the full pipeline down to a cubin runs
on any Linux machine. Every kernel is compiled for an H200 (sm_90); the attention kernels also for
a T4 (sm_75, float16: no bfloat16 there) and an A10 (sm_86), in float32 and 16-bit at head size
128, each checked against its target's shared-memory limit (the kernels pick smaller tiles for
float32 at head size 128). Must run without TRITON_INTERPRET (the kernels are then real JIT
functions). Every ``@triton.jit`` function in minivllm.kernels (found by walking the package, not
listed here) must be compiled, or be called by name from one that is: a new kernel left out of
this script fails it.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import torch
import triton
from triton.runtime.jit import JITFunction

from minivllm.kernels import activation, decode_attention, prefill_attention
from minivllm.kernels import reshape_and_cache, rms_norm, rotary_embedding
from minivllm.kernels.aot import SHARED_MEMORY_LIMIT
from minivllm.kernels.aot import compile_for_gpu as _compile  # no alignment assumed

TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
over_limit: list[str] = []
shared_used: dict[str, int] = {}
compiled: list = []  # every (function, target) compiled, in order


def jit_functions() -> dict[str, JITFunction]:
    """Every ``@triton.jit`` function defined in a module of minivllm.kernels, by its qualified
    name."""
    import minivllm.kernels as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def uncompiled(found: dict, kernels) -> tuple[set[str], list[str]]:
    """Of the ``found`` functions that are not among the compiled ``kernels``: the helpers (called
    by name from a compiled kernel's source, so compiled inside it) and the rest, never compiled."""
    helpers = {name for name, fn in found.items()
               if fn not in kernels and any(f"{fn.__name__}(" in k.src for k in kernels)}
    return helpers, sorted(name for name, fn in found.items()
                           if fn not in kernels and name not in helpers)


def compile_for_gpu(fn, pointers, capability=90, **kwargs):
    kernel = _compile(fn, pointers, capability=capability, **kwargs)
    compiled.append((fn, capability))
    used = kernel.metadata.shared
    key = f"sm_{capability} {fn.__name__} {pointers.get('q_ptr', pointers.get('x_ptr', ''))}"
    shared_used[key] = max(used, shared_used.get(key, 0))
    if used > SHARED_MEMORY_LIMIT[capability]:
        over_limit.append(f"{key}: {used} > {SHARED_MEMORY_LIMIT[capability]} bytes")
    return kernel


def compile_attention(dt: str, group: int, head_dim: int, capability: int) -> None:
    """The four attention kernels (decode with and without splits, reduce, prefill) and the
    cache write, with the tiles the launchers pick for this dtype and head size."""
    prec = "ieee" if dt == "fp32" else "tf32"
    block_d = triton.next_power_of_2(head_dim)
    block_n = decode_attention.decode_block_n(TORCH_DTYPE[dt], block_d)
    block_m, block_n_prefill = prefill_attention.prefill_tiles(TORCH_DTYPE[dt], block_d)
    kv = dict(k_cache_ptr=dt, v_cache_ptr=dt, block_tables_ptr="i32", seq_lens_ptr="i32")
    for single in (True, False):
        compile_for_gpu(
            decode_attention._decode_partition_kernel,
            dict(q_ptr=dt, acc_ptr="fp32", max_ptr="fp32", sum_ptr="fp32", out_ptr=dt, **kv),
            capability, floats=("qk_scale",),
            constexprs=dict(GROUP=group, BLOCK_G=16, BLOCK_N=block_n,
                            BLOCK_D=block_d, DOT_PRECISION=prec, SINGLE_SPLIT=single))
    compile_for_gpu(decode_attention._decode_reduce_kernel,
                    dict(out_ptr=dt, acc_ptr="fp32", max_ptr="fp32", sum_ptr="fp32",
                         seq_lens_ptr="i32"), capability,
                    constexprs=dict(BLOCK_S=decode_attention.BLOCK_S, BLOCK_D=block_d),
                    num_warps=1 if block_d <= 64 else 2)
    compile_for_gpu(prefill_attention._prefill_kernel,
                    dict(q_ptr=dt, out_ptr=dt, query_start_loc_ptr="i32", **kv), capability,
                    floats=("qk_scale",),
                    constexprs=dict(GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n_prefill,
                                    BLOCK_D=block_d, DOT_PRECISION=prec), num_stages=2)
    compile_for_gpu(reshape_and_cache._reshape_and_cache_kernel,
                    dict(k_ptr=dt, v_ptr=dt, k_cache_ptr=dt, v_cache_ptr=dt,
                         slot_mapping_ptr="i64"), capability,
                    constexprs=dict(BLOCK_H=8, BLOCK_D=block_d))


def main() -> int:
    # sm_90: fp32 (the CPU tests' dtype; a tiny test model's head size 16 and a real one's 128)
    # and bf16 (a GPU's) at a real model's shape (Qwen3-0.6B: GQA 2, head_dim 128)
    for dt, shapes in (("fp32", ((2, 16), (2, 128))), ("bf16", ((2, 128),))):
        for group, head_dim in shapes:
            compile_attention(dt, group, head_dim, 90)
        for has_residual in (True, False):
            compile_for_gpu(rms_norm._rms_norm_kernel,
                            dict(x_ptr=dt, residual_ptr=dt, out_ptr=dt, residual_out_ptr=dt,
                                 weight_ptr=dt), floats=("eps",),
                            constexprs=dict(HAS_RESIDUAL=has_residual, BLOCK_ROWS=2, BLOCK=1024))
        compile_for_gpu(rotary_embedding._rotary_kernel,
                        dict(positions_ptr="i64", x_ptr=dt, out_ptr=dt, cos_sin_ptr="fp32"),
                        constexprs=dict(BLOCK_ROWS=32, BLOCK_HALF=64))
        compile_for_gpu(activation._silu_and_mul_kernel, dict(x_ptr=dt, out_ptr=dt),
                        constexprs=dict(BLOCK_ROWS=2, BLOCK=1024))
    # smaller GPUs: a T4 (sm_75, whose 16-bit type is fp16) and an A10 (sm_86)
    for capability, half in ((75, "fp16"), (86, "bf16")):
        for dt in ("fp32", half):
            compile_attention(dt, 2, 128, capability)
    for key, used in sorted(shared_used.items()):
        print(f"{key}: {used} bytes of shared memory")
    found = jit_functions()
    kernels = {fn for fn, _ in compiled}
    helpers, missing = uncompiled(found, kernels)
    targets = sorted({c for _, c in compiled})
    print(f"found {len(found)} @triton.jit functions in minivllm.kernels: {len(kernels)} kernels "
          f"compiled, {len(helpers)} helpers compiled inside them")
    if missing:
        print("never compiled: " + ", ".join(missing), file=sys.stderr)
    if over_limit:
        print("over the shared-memory limit:\n  " + "\n  ".join(over_limit), file=sys.stderr)
    if missing or over_limit:
        return 1
    print(f"compiled {len(compiled)} kernel variants for "
          f"{', '.join(f'sm_{c}' for c in targets)}, each within its shared memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
