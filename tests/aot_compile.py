"""Compile every Triton kernel for an H200 (CUDA sm_90) without a GPU: ``python tests/aot_compile.py``.

The interpreter runs the kernels' arithmetic but not Triton's compiler: shape rules of ``tl.dot``,
types, layouts. Triton ships ``ptxas``, so the full pipeline down to a cubin runs on any Linux
machine. Must run without TRITON_INTERPRET (the kernels are then real JIT functions).
"""

from __future__ import annotations

import sys

import triton

from minivllm.kernels import activation, decode_attention, prefill_attention
from minivllm.kernels import reshape_and_cache, rms_norm, rotary_embedding
from minivllm.kernels.aot import compile_for_sm90 as compile_for_gpu  # no alignment assumed


def main() -> int:
    n = 0
    # fp32 (the CPU tests' dtype) and bf16 (a GPU's): fp16 goes through the same 16-bit path
    for dt in ("fp32", "bf16"):
        prec = "ieee" if dt == "fp32" else "tf32"
        # (GQA group, head_dim): a real model's (Qwen3-0.6B) in bf16, a tiny test model's in fp32
        # (the GPU tests run those in float32; their 16-wide tl.dot is the smallest a tensor core
        # takes). The kernels' source is the same at every head size: BLOCK_D only sizes tiles.
        for group, head_dim in ((2, 16),) if dt == "fp32" else ((2, 128),):
            block_d = triton.next_power_of_2(head_dim)
            kv = dict(k_cache_ptr=dt, v_cache_ptr=dt, block_tables_ptr="i32", seq_lens_ptr="i32")
            for single in (True, False):
                compile_for_gpu(
                    decode_attention._decode_partition_kernel,
                    dict(q_ptr=dt, acc_ptr="fp32", max_ptr="fp32", sum_ptr="fp32", out_ptr=dt, **kv),
                    floats=("qk_scale",),
                    constexprs=dict(GROUP=group, BLOCK_G=16, BLOCK_N=decode_attention.BLOCK_N,
                                    BLOCK_D=block_d, DOT_PRECISION=prec, SINGLE_SPLIT=single))
            compile_for_gpu(decode_attention._decode_reduce_kernel,
                            dict(out_ptr=dt, acc_ptr="fp32", max_ptr="fp32", sum_ptr="fp32",
                                 seq_lens_ptr="i32"),
                            constexprs=dict(BLOCK_S=8, BLOCK_D=block_d), num_warps=2)
            compile_for_gpu(prefill_attention._prefill_kernel,
                            dict(q_ptr=dt, out_ptr=dt, query_start_loc_ptr="i32", **kv),
                            floats=("qk_scale",),
                            constexprs=dict(GROUP=group, BLOCK_M=prefill_attention.BLOCK_M,
                                            BLOCK_N=prefill_attention.BLOCK_N, BLOCK_D=block_d,
                                            DOT_PRECISION=prec), num_stages=2)
            compile_for_gpu(reshape_and_cache._reshape_and_cache_kernel,
                            dict(k_ptr=dt, v_ptr=dt, k_cache_ptr=dt, v_cache_ptr=dt,
                                 slot_mapping_ptr="i64"),
                            constexprs=dict(BLOCK_H=8, BLOCK_D=block_d))
            n += 5
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
        n += 4
    print(f"compiled {n} kernel variants for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
