"""What a Triton kernel compiles to for an H200 (sm_90), without a GPU: chapter 09 runs
``python -m minivllm.course.kernel_report`` (TRITON_INTERPRET unset) and reads the JSON it
prints: per kernel, shared memory, registers, spills and counts of telling PTX instructions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter


def _resource_usage(cubin: bytes) -> dict:
    """Registers per thread, stack and local (spill) bytes, from the cubin via cuobjdump."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out))
    return {"registers_per_thread": int(found["REG"]), "stack_bytes": int(found["STACK"]),
            "spill_bytes": int(found["LOCAL"])} if "REG" in found else {}


def _ptx_summary(ptx: str) -> dict:
    ops = Counter()
    for line in ptx.splitlines():
        words = line.strip().replace("\t", " ").split()
        if words and words[0].startswith("@"):  # a predicated instruction: @%p1 ld.global...
            words = words[1:]
        if words and words[0][0].isalpha():
            ops[words[0]] += 1
    mma = sorted({op for op in ops if op.startswith(("mma.", "wgmma."))})
    loads = {op: n for op, n in ops.items()
             if op.startswith(("ld.global", "cp.async.cg", "cp.async.ca"))}
    return {
        "ptx_lines": len(ptx.splitlines()),
        "mma_instructions": sum(ops[op] for op in mma),
        "mma_kinds": mma,
        "ex2_instructions": sum(n for op, n in ops.items() if op.startswith("ex2")),
        "global_loads": dict(sorted(loads.items())),
        "mma_example": next((line.strip() for line in ptx.splitlines()
                             if line.strip().startswith(("mma.", "wgmma."))), None),
    }


def report() -> dict:
    """Decode attention (stage 1) for Qwen3-0.6B's attention and the fused add + RMSNorm for its
    hidden size, in bf16, compiled as a launch from torch would (pointers aligned to 16)."""
    from minivllm.kernels import decode_attention, rms_norm
    from minivllm.kernels.aot import compile_for_sm90

    kv = dict(k_cache_ptr="bf16", v_cache_ptr="bf16", block_tables_ptr="i32", seq_lens_ptr="i32")
    kernels = {
        "decode attention, stage 1 (Qwen3-0.6B: GQA group 2, head_dim 128, bf16)": compile_for_sm90(
            decode_attention._decode_partition_kernel, aligned=True, pointers=dict(
                q_ptr="bf16", acc_ptr="fp32", max_ptr="fp32", sum_ptr="fp32", out_ptr="bf16", **kv),
            floats=("qk_scale",), divisible=("block_size", "head_dim", "partition_size"),
            constexprs=dict(GROUP=2, BLOCK_G=16, BLOCK_N=decode_attention.BLOCK_N, BLOCK_D=128,
                            DOT_PRECISION="tf32", SINGLE_SPLIT=False)),
        "fused add + RMSNorm (hidden 1024, bf16)": compile_for_sm90(
            rms_norm._rms_norm_kernel, aligned=True, pointers=dict(
                x_ptr="bf16", residual_ptr="bf16", out_ptr="bf16", residual_out_ptr="bf16",
                weight_ptr="bf16"), floats=("eps",), divisible=("n_cols",),
            constexprs=dict(HAS_RESIDUAL=True, BLOCK_ROWS=2, BLOCK=1024), num_warps=4),
    }
    out = {}
    for name, compiled in kernels.items():
        md = compiled.metadata
        out[name] = {"target": f"{md.target.backend} sm_{md.target.arch}",
                     "num_warps": md.num_warps, "shared_memory_bytes": md.shared,
                     **_resource_usage(compiled.asm["cubin"]), **_ptx_summary(compiled.asm["ptx"])}
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run without TRITON_INTERPRET: the kernels must be compiled, not interpreted",
              file=sys.stderr)
        return 2
    print(json.dumps(report(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
