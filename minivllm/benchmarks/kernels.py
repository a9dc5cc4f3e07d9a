"""``minivllm bench kernels``: the attention kernels against the hardware's limits.

* decode (``paged_decode_attention``): a batch of sequences at one context length, one query
  token each. The step must read every sequence's whole K and V from HBM, so the figure is the
  achieved bandwidth — bytes of K/V read per second — and its fraction of the GPU's peak.
* prefill (``paged_prefill_attention``): fresh causal prompts of one length, enough of them to
  fill the GPU, against ``torch.nn.functional.scaled_dot_product_attention`` on the same
  shapes (contiguous, no paging). The figure is TFLOP/s: 4 * L^2 * heads * head_dim / 2 per
  causal sequence (QK^T and PV, half the square).

Shapes default to Qwen3-0.6B's attention (16 query heads over 8 KV heads, head_dim 128), bf16,
block size 16, block tables scattered at random. ``--quick`` runs tiny shapes (on a CPU that
means the Triton interpreter: it proves the benchmark runs, its figures mean nothing).
"""

from __future__ import annotations

import os

import torch

from minivllm.benchmarks.common import event_median_time, machine_info, write_json
from minivllm.config import EngineArgs
from minivllm.utils import cdiv

H200_HBM_BYTES_PER_S = 4.8e12  # the H200 datasheet: peak HBM3e bandwidth
H200_BF16_FLOPS = 989e12  # its dense bf16 peak (the SXM part, as the H100 SXM; the NVL: 835e12)

# the caches are paged in the engine's default block size
FULL = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=EngineArgs.block_size,
            dtype=torch.bfloat16,
            decode_contexts=[1024, 4096, 16384, 32768], decode_batch=32,
            prefill_lens=[512, 1024, 2048, 4096, 8192], prefill_tokens=16384)
QUICK = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=EngineArgs.block_size,
             dtype=torch.float32,
             decode_contexts=[64, 200], decode_batch=2, prefill_lens=[32, 64], prefill_tokens=64)


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("kernels", help="attention kernels: decode GB/s, prefill TFLOP/s")
    p.add_argument("--quick", action="store_true", help="tiny shapes (runs on a CPU)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=main)


def _timer(device: torch.device, fn, iters: int) -> float:
    """Median seconds per call, after a warm-up call (which also compiles the kernel)."""
    return event_median_time(fn, iters, device)


def _scattered_cache(num_seqs, seq_len, s, device, gen):
    """A KV cache holding num_seqs contexts of seq_len tokens in randomly placed blocks."""
    blocks_per_seq = cdiv(seq_len, s["block_size"])
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.randn(2, num_blocks, s["block_size"], s["num_kv_heads"], s["head_dim"],
                        generator=gen, device=device).to(s["dtype"])
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    return cache, order.view(num_seqs, blocks_per_seq)


def bench_decode(s: dict, device: torch.device, iters: int) -> list[dict]:
    from minivllm.kernels.decode_attention import num_decode_splits, paged_decode_attention

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for ctx in s["decode_contexts"]:
        b = s["decode_batch"]
        cache, table = _scattered_cache(b, ctx, s, device, gen)
        q = torch.randn(b, s["num_heads"], s["head_dim"], generator=gen, device=device).to(s["dtype"])
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        scale = s["head_dim"] ** -0.5
        sec = _timer(device, lambda: paged_decode_attention(q, cache, table, lens, scale,
                                                            max_seq_len=ctx), iters)
        kv_bytes = 2 * b * ctx * s["num_kv_heads"] * s["head_dim"] * cache.element_size()
        rows.append({
            "context": ctx, "batch": b, "seconds": sec, "kv_bytes": kv_bytes,
            "num_splits": num_decode_splits(ctx, b, s["num_kv_heads"]),
            "achieved_GBps": kv_bytes / sec / 1e9,
            "fraction_of_h200_peak": kv_bytes / sec / H200_HBM_BYTES_PER_S,
        })
        del cache, table
    return rows


def bench_prefill(s: dict, device: torch.device, iters: int) -> list[dict]:
    import torch.nn.functional as F

    from minivllm.kernels.prefill_attention import paged_prefill_attention

    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    h, kvh, d, dt = s["num_heads"], s["num_kv_heads"], s["head_dim"], s["dtype"]
    for length in s["prefill_lens"]:
        n = max(1, s["prefill_tokens"] // length)  # sequences: enough work to fill the GPU
        cache, table = _scattered_cache(n, length, s, device, gen)
        q = torch.randn(n * length, h, d, generator=gen, device=device).to(dt)
        qsl = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=device)
        lens = torch.full((n,), length, dtype=torch.int32, device=device)
        scale = d**-0.5
        ours = _timer(device, lambda: paged_prefill_attention(
            q, cache, qsl, lens, table, scale, max_query_len=length), iters)
        # SDPA on the same numbers, laid out contiguously: [seqs, heads, L, d]
        qs = q.view(n, length, h, d).transpose(1, 2).contiguous()
        ks = torch.randn(n, kvh, length, d, generator=gen, device=device).to(dt)
        vs = torch.randn(n, kvh, length, d, generator=gen, device=device).to(dt)
        sdpa = _timer(device, lambda: F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True), iters)
        flops = n * 4 * length * length * h * d / 2
        rows.append({
            "length": length, "num_seqs": n, "flops": flops,
            "triton_seconds": ours, "triton_TFLOPs": flops / ours / 1e12,
            "sdpa_seconds": sdpa, "sdpa_TFLOPs": flops / sdpa / 1e12,
            "triton_over_sdpa": sdpa / ours,
            "triton_fraction_of_h200_bf16_peak": flops / ours / H200_BF16_FLOPS,
        })
        del cache, table, qs, ks, vs
    return rows


def run(quick: bool = False) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":  # exact float32 where the shapes are float32
        torch.backends.cuda.matmul.allow_tf32 = False
    else:  # only works if triton was not imported yet
        os.environ.setdefault("TRITON_INTERPRET", "1")
    s = QUICK if quick else FULL
    iters = 3 if device.type == "cpu" else 20
    shapes = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in s.items()}
    return {
        "benchmark": "kernels", "machine": machine_info(), "shapes": shapes,
        "interpreter": device.type == "cpu",
        "decode": bench_decode(s, device, iters),
        "prefill": bench_prefill(s, device, iters),
    }


def main(args) -> int:
    result = run(quick=args.quick)
    for r in result["decode"]:
        print(f"decode  ctx {r['context']:6d} x{r['batch']:3d}: {r['seconds'] * 1e6:9.1f} us  "
              f"{r['achieved_GBps']:8.1f} GB/s  ({100 * r['fraction_of_h200_peak']:.1f}% of H200 peak)")
    for r in result["prefill"]:
        print(f"prefill L {r['length']:5d} x{r['num_seqs']:3d}: triton {r['triton_TFLOPs']:7.2f} "
              f"TFLOP/s  sdpa {r['sdpa_TFLOPs']:7.2f} TFLOP/s  ratio {r['triton_over_sdpa']:.2f}")
    write_json(args.json, result)
    return 0
