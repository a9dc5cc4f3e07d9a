"""``minivllm bench shared-prefix``: many requests sharing a system prompt, caching on vs off.

``--num-requests`` requests arrive together, each a ``--prefix-len``-token system prompt plus a
question of its own. With prefix caching the system prompt's KV blocks are computed once and
shared by reference count: the first token comes much sooner and the blocks in use are one
copy of the prefix plus each request's own. Without it, every request recomputes and stores
its own copy.
"""

from __future__ import annotations

import time

from minivllm.benchmarks.common import machine_info, write_json
from minivllm.benchmarks.long_prompt import limits_line, measured_limits, save_plot
from minivllm.sim.workloads import SHARED_PREFIX_CPU, SharedPrefix
from minivllm.config import EngineArgs
from minivllm.utils import cdiv


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("shared-prefix", help="TTFT and KV blocks with/without prefix caching")
    w = SHARED_PREFIX_CPU
    p.add_argument("--num-requests", type=int, default=w.num_requests)
    p.add_argument("--prefix-len", type=int, default=w.prefix_len)
    p.add_argument("--question-len", type=int, default=w.suffix_len)
    p.add_argument("--output-len", type=int, default=w.output_len)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: each request's TTFT and the KV blocks in use, caching on/off")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=w.seed)
    p.set_defaults(func=main)


def run_once(model, caching: bool, prompts: list[list[int]], output_len: int, **engine_args) -> dict:
    """All ``prompts`` arrive at once (``SharedPrefix.prompts()``, or any others); a KV cache of
    the default block size, big enough for every one of them unshared.

    ``engine_args`` go to ``LLM`` (e.g. ``max_num_batched_tokens``).
    """
    from minivllm import LLM

    block_size = EngineArgs.block_size
    max_len = max(len(p) for p in prompts) + output_len
    need = len(prompts) * cdiv(max_len, block_size)
    llm = LLM(model, show_progress=False, enable_prefix_caching=caching, num_kv_blocks=need + 16,
              block_size=block_size, max_model_len=max_len, **engine_args)
    return run_all_at_once(llm, prompts, output_len)


def run_all_at_once(llm, prompts: list[list[int]], output_len: int) -> dict:
    """On an engine already loaded: every prompt arrives at once, greedy, exactly
    ``output_len`` tokens each. TTFTs in the order of ``prompts``, and the peak of KV blocks in
    use (read after every step); the prefix-cache hits are the engine's totals."""
    from minivllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.time()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": list(p)}, params, arrival_time=start)
    finished = []
    peak_blocks = 0
    blocks_over_time = []  # (seconds since the arrival, KV blocks in use) after every step
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        used = engine.get_stats()["kv_blocks_used"]
        blocks_over_time.append((time.time() - start, used))
        peak_blocks = max(peak_blocks, used)
    elapsed = time.time() - start
    stats = engine.get_stats()
    finished.sort(key=lambda o: int(o.request_id))
    ttfts = [o.metrics.ttft for o in finished]
    return {
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "max_ttft_s": max(ttfts),
        "elapsed_s": elapsed,
        "peak_kv_blocks_used": peak_blocks,
        "prefix_cache_hit_tokens": stats["prefix_cache_hits"],
        "kv_blocks_used_after": stats["kv_blocks_used"],
        "kv_blocks_over_time": blocks_over_time,
        "ttfts_s": ttfts,  # per request, in the order of ``prompts``
        "outputs": [o.outputs[0].token_ids for o in finished],
    }


def main(args) -> int:
    prompts = SharedPrefix(num_requests=args.num_requests, prefix_len=args.prefix_len,
                           suffix_len=args.question_len, output_len=args.output_len,
                           seed=args.seed).prompts()
    on = run_once(args.model, True, prompts, args.output_len)
    off = run_once(args.model, False, prompts, args.output_len)
    same = on.pop("outputs") == off.pop("outputs")
    block = EngineArgs.block_size
    own = cdiv(args.prefix_len + args.question_len + args.output_len, block) - args.prefix_len // block
    expected = args.prefix_len // block + args.num_requests * own
    print(f"{args.num_requests} requests sharing a {args.prefix_len}-token prefix "
          f"(+{args.question_len} own tokens, {args.output_len} output tokens)")
    for name, r in (("caching on", on), ("caching off", off)):
        print(f"  {name:>11}: mean TTFT {r['mean_ttft_s']:7.2f} s  peak KV blocks {r['peak_kv_blocks_used']:5d}"
              f"  total {r['elapsed_s']:.1f} s")
    print(f"  mean TTFT {off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x lower with caching; blocks with "
          f"caching: {on['peak_kv_blocks_used']} (one prefix copy + own blocks = {expected})")
    print(f"  same greedy tokens both ways: {same}")
    machine = {**machine_info(), **measured_limits()}
    print(limits_line(machine))
    write_json(args.json, {"benchmark": "shared-prefix", "machine": machine,
                           "num_requests": args.num_requests, "prefix_len": args.prefix_len,
                           "caching_on": on, "caching_off": off, "ttft_ratio": off["mean_ttft_s"] / on["mean_ttft_s"],
                           "expected_blocks_shared": expected, "same_tokens": same})
    if args.plot:
        plot(args.plot, on, off, expected, args, machine)
    return 0


def plot(path: str, on: dict, off: dict, expected: int, args, machine: dict) -> None:
    """Left: each request's time to first token, caching on and off. Right: the KV blocks in
    use after every step, against one prefix copy plus each request's own blocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r, color in (("caching on", on, "tab:green"), ("caching off", off, "tab:red")):
        left.plot(range(len(r["ttfts_s"])), r["ttfts_s"], marker=".", color=color,
                  label=f"{name}: mean {r['mean_ttft_s']:.2f} s")
        xs, ys = zip(*r["kv_blocks_over_time"])
        right.plot(xs, ys, color=color, label=f"{name}: peak {r['peak_kv_blocks_used']}")
    left.set_xlabel("request (all arrive at once)")
    left.set_ylabel("time to first token (s)")
    left.set_title(f"{args.num_requests} requests, a shared {args.prefix_len}-token prefix "
                   f"+ {args.question_len} own tokens", fontsize=10)
    left.legend(fontsize=8)
    right.axhline(expected, color="grey", linestyle=":", linewidth=1,
                  label=f"one prefix copy + own blocks = {expected}")
    right.set_xlabel("seconds since the requests arrived")
    right.set_ylabel("KV blocks in use")
    right.set_title(f"KV blocks ({off['peak_kv_blocks_used']} vs {on['peak_kv_blocks_used']} at "
                    "the peak)", fontsize=10)
    right.legend(fontsize=8)
    save_plot(fig, path, "shared-prefix", machine)
