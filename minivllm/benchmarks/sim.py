"""``minivllm bench sim``: the production-scale scenarios on the simulated engine (no model).

Prints (a) decode TPOT around a 16k-token prompt's arrival under v0 and v1, with a sweep of
v1 chunk sizes, and (b) the KV memory of 1000 sessions sharing a 30k-token system prompt.
All times are simulated (the cost model of ``minivllm.sim.cost_model``), not measured.
"""

from __future__ import annotations

import time

from minivllm.benchmarks.common import write_json
from minivllm.sim.workloads import LONG_PROMPT_GPU, SHARED_PREFIX_GPU


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("sim", help="production-scale scenarios on the simulated engine")
    p.add_argument("--long-prompt-len", type=int, default=LONG_PROMPT_GPU.long_prompt_len)
    p.add_argument("--num-decoding", type=int, default=LONG_PROMPT_GPU.num_chats)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    p.add_argument("--num-sessions", type=int, default=SHARED_PREFIX_GPU.num_requests)
    p.add_argument("--system-prompt-len", type=int, default=SHARED_PREFIX_GPU.prefix_len)
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)


def main(args) -> int:
    from minivllm.sim.cost_model import CostModel
    from minivllm.sim.scenarios import long_prompt_stall, shared_system_prompt

    cm = CostModel()
    print(f"cost model: {cm.name}; ridge point ~{cm.ridge_tokens:.0f} tokens/step; "
          f"KV {cm.kv_bytes_per_token / 1024:.0f} KiB/token (simulated times)")
    start = time.perf_counter()
    sizes = dict(num_chats=args.num_decoding, long_prompt_len=args.long_prompt_len)
    stall = {"v0": long_prompt_stall("v0", **sizes)}
    for c in args.chunk_sizes:
        stall[f"v1-{c}"] = long_prompt_stall("v1", chunk_size=c, **sizes)
    print(f"\n(a) {args.num_decoding} requests decoding, a {args.long_prompt_len}-token prompt arrives")
    print(f"{'scheduler':>10} {'steady TPOT':>12} {'P50':>9} {'P99':>9} {'P99/steady':>11} "
          f"{'long TTFT':>10}")
    for name, r in stall.items():
        print(f"{name:>10} {r['steady_tpot_ms']:10.1f}ms {r['window_tpot_p50_ms']:7.1f}ms "
              f"{r['window_tpot_p99_ms']:7.1f}ms {r['p99_over_steady']:10.1f}x "
              f"{r['long_prompt_ttft_s']:9.2f}s")
    shared = shared_system_prompt(num_sessions=args.num_sessions, prefix_len=args.system_prompt_len)
    print(f"\n(b) {args.num_sessions} sessions share a {args.system_prompt_len}-token system prompt "
          "(prefix caching on)")
    print(f"  busiest moment: {shared['sessions_alive_at_peak']} sessions alive, "
          f"{shared['peak_kv_blocks_used']} KV blocks used = 1 copy of the system prompt "
          f"({shared['system_prompt_blocks']}) + their own blocks "
          f"(check: {shared['peak_blocks_if_one_prefix_copy']}); "
          f"they reference {shared['block_references_at_peak']} blocks")
    print(f"  KV memory at that moment: {shared['kv_gb_at_peak']:.1f} GB shared vs "
          f"{shared['kv_gb_at_peak_unshared']:.0f} GB unshared")
    print(f"  all {args.num_sessions} sessions at once: {shared['kv_gb_all_sessions_shared']:.1f} GB "
          f"shared vs {shared['kv_gb_all_sessions_unshared']:.0f} GB unshared "
          f"(saves {shared['kv_gb_all_sessions_unshared'] - shared['kv_gb_all_sessions_shared']:.0f} GB)")
    print(f"\n(simulated in {time.perf_counter() - start:.1f} s of wall time)")
    write_json(args.json, {"benchmark": "sim", "cost_model": cm.__dict__, "long_prompt_stall": stall,
                           "shared_system_prompt": shared})
    return 0
