"""``minivllm bench long-prompt``: does a long prompt stall the running decodes? v0 vs v1.

``--num-chats`` requests are decoding (steady state) when a ``--long-prompt-len``-token prompt
arrives. For each scheduler we measure the gaps between consecutive output tokens (TPOT) of
the chats: "steady" in the second before the arrival, then P50 / P99 over the window until the
long prompt's first token. v0 prefills the whole prompt in one step while every chat waits;
v1 cuts it into ``chunk`` tokens per step beside the chats' decodes (budget = chunk + chats).

The chunk that keeps decodes flat depends on the hardware: a chunk is nearly free only while
the step stays memory-bound. On a CPU that ridge is a few dozen tokens, not vLLM's GPU-sized
hundreds: hence the sweep.
"""

from __future__ import annotations

import random
import time

from minivllm.benchmarks.common import machine_info, percentile, stall_window, write_json


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("long-prompt", help="decode TPOT when a long prompt arrives, v0 vs v1")
    p.add_argument("--num-chats", type=int, default=16)
    p.add_argument("--chat-prompt-len", type=int, default=48)
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--steady-steps", type=int, default=20, help="decode steps before the arrival")
    p.add_argument("--json", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def run_scenario(model, scheduler_kwargs: dict, num_chats: int, chat_prompt_len: int,
                 long_prompt_len: int, steady_steps: int, seed: int = 0) -> dict:
    from minivllm import LLM, SamplingParams

    max_len = long_prompt_len + 64
    llm = LLM(model, show_progress=False, max_model_len=max(max_len, 1024), **scheduler_kwargs)
    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = [t for t in range(100, 30000)]
    chat = SamplingParams(temperature=0, max_tokens=max_len - chat_prompt_len, ignore_eos=True)
    for i in range(num_chats):
        engine.add_request(f"chat-{i}", {"prompt_token_ids": rng.sample(vocab, chat_prompt_len)}, chat)
    latest: dict[str, object] = {}

    def step():
        for out in engine.step():
            latest[out.request_id] = out

    while len(latest) < num_chats or min(len(o.outputs[0].token_ids) for o in latest.values()) < steady_steps:
        step()
    arrival = time.time()
    engine.add_request("long", {"prompt_token_ids": [rng.choice(vocab) for _ in range(long_prompt_len)]},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), arrival_time=arrival)
    while "long" not in latest:
        step()
    for _ in range(3):  # a few steady steps after, so every window gap has its end
        step()
    engine.abort_request([f"chat-{i}" for i in range(num_chats)] + ["long"])
    long_metrics = latest["long"].metrics
    steady, window = stall_window(
        [latest[f"chat-{i}"].metrics.token_times for i in range(num_chats)],
        arrival, long_metrics.first_token_time, steady_span=float("inf"),
    )
    steady = steady[-num_chats * 10:]  # the last ten steady steps
    base = percentile(steady, 50)
    return {
        "steady_tpot_ms": base * 1e3,
        "window_tpot_p50_ms": percentile(window, 50) * 1e3,
        "window_tpot_p99_ms": percentile(window, 99) * 1e3,
        "p99_over_steady": percentile(window, 99) / base,
        "long_prompt_ttft_s": long_metrics.first_token_time - arrival,
        "num_window_gaps": len(window),
    }


def main(args) -> int:
    common = dict(num_chats=args.num_chats, chat_prompt_len=args.chat_prompt_len,
                  long_prompt_len=args.long_prompt_len, steady_steps=args.steady_steps,
                  seed=args.seed)
    runs = {"v0": dict(scheduler="v0")}
    for c in args.chunk_sizes:
        runs[f"v1-chunk{c}"] = dict(scheduler="v1", long_prefill_token_threshold=c,
                                    max_num_batched_tokens=c + args.num_chats)
    results = {}
    print(f"{args.num_chats} chats decoding, a {args.long_prompt_len}-token prompt arrives "
          "(TPOT of the chats)")
    print(f"{'run':>12} {'steady':>9} {'P50':>9} {'P99':>9} {'P99/steady':>11} {'long TTFT':>10}")
    for name, kw in runs.items():
        r = run_scenario(args.model, kw, **common)
        results[name] = r
        print(f"{name:>12} {r['steady_tpot_ms']:7.1f}ms {r['window_tpot_p50_ms']:7.1f}ms "
              f"{r['window_tpot_p99_ms']:7.1f}ms {r['p99_over_steady']:10.2f}x "
              f"{r['long_prompt_ttft_s']:9.2f}s", flush=True)
    write_json(args.json, {"benchmark": "long-prompt", "machine": machine_info(), **common,
                           "runs": results})
    return 0
