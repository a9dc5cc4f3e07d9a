"""``minivllm bench long-prompt``: does a long prompt stall the running decodes? v0 vs v1.

``--num-chats`` requests are decoding when a ``--long-prompt-len``-token prompt arrives. For
each scheduler we measure the gaps between consecutive output tokens (TPOT) of the chats from
the arrival until the long prompt's first token, and the same gaps in a control run that takes
as many steps without the long prompt (the chats' contexts grow, and on a CPU their decodes slow
down, long prompt or not). v0 prefills the whole prompt in one step while every chat waits;
v1 cuts it into ``chunk`` tokens per step beside the chats' decodes (budget = chunk + chats).

The chunk that keeps decodes flat depends on the hardware: a chunk is nearly free only while
the step stays memory-bound. On a CPU that ridge is a few dozen tokens, not vLLM's GPU-sized
hundreds: hence the sweep.
"""

from __future__ import annotations

import time

from minivllm.benchmarks.common import machine_info, percentile, stall_window, write_json
from minivllm.sim.workloads import LONG_PROMPT_CPU, LongPromptAmongChats


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("long-prompt", help="decode TPOT when a long prompt arrives, v0 vs v1")
    w = LONG_PROMPT_CPU
    p.add_argument("--num-chats", type=int, default=w.num_chats)
    p.add_argument("--chat-prompt-len", type=int, default=w.chat_prompt_len)
    p.add_argument("--long-prompt-len", type=int, default=w.long_prompt_len)
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--steady-steps", type=int, default=w.steady_steps,
                   help="decode steps before the arrival")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: the chats' time per output token around the arrival, per run")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=w.seed)
    p.set_defaults(func=main)


def run_scenario(model, scheduler_kwargs: dict, num_chats: int, chat_prompt_len: int,
                 long_prompt_len: int, steady_steps: int, seed: int = 0,
                 control_steps: int | None = None, llm=None, extra_steps: int = 1) -> dict:
    """The workload ``LongPromptAmongChats`` of these sizes (``minivllm.sim.workloads``):
    chats decode for ``steady_steps``; then the long prompt arrives, and we step until its
    first token. ``control_steps``: the control run instead — no long prompt, just that many
    more steps — so the chats' own growth (longer contexts, slower decodes) is not blamed on it.
    Returns the chats' token gaps after the arrival point, and the number of steps taken.

    ``llm``: run on this engine as it is (the course swaps schedulers into one loaded model,
    ``minivllm.course.swap``) instead of building one from ``model`` and ``scheduler_kwargs``.
    ``extra_steps``: steps run after the window (at least one, so every gap in it has its end).
    The result also holds every request's token times, the arrival and the window's end (wall
    times), and the step trace, for timelines."""
    from minivllm import LLM, SamplingParams

    w = LongPromptAmongChats(num_chats=num_chats, chat_prompt_len=chat_prompt_len,
                             long_prompt_len=long_prompt_len, steady_steps=steady_steps, seed=seed)
    if llm is None:
        llm = LLM(model, show_progress=False, max_model_len=max(w.max_model_len, 1024),
                  **scheduler_kwargs)
    engine = llm.llm_engine
    chat_prompts, long_ids = w.prompts()
    chat = SamplingParams(temperature=0, max_tokens=w.chat_max_tokens, ignore_eos=True)
    chat_ids = w.chat_ids()
    for rid, prompt in zip(chat_ids, chat_prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, chat)
    latest: dict[str, object] = {}

    def step():
        for out in engine.step():
            latest[out.request_id] = out

    while len(latest) < num_chats or min(len(latest[r].outputs[0].token_ids) for r in chat_ids) < steady_steps:
        step()
    arrival = time.time()
    steps = 0
    if control_steps is None:
        engine.add_request("long", {"prompt_token_ids": long_ids},
                           SamplingParams(temperature=0, max_tokens=w.long_output_len,
                                          ignore_eos=True),
                           arrival_time=arrival)
        while "long" not in latest:
            step()
            steps += 1
        window_end = latest["long"].metrics.first_token_time
    else:
        for _ in range(control_steps):
            step()
        steps = control_steps
        window_end = time.time()
    for _ in range(max(extra_steps, 1)):  # so every gap that began in the window has its end
        step()
    engine.abort_request([r for r in (*chat_ids, "long") if r in latest and not latest[r].finished])
    _, window = stall_window([latest[r].metrics.token_times for r in chat_ids], arrival,
                             window_end, steady_span=0.0)
    return {
        "gaps": window,
        "steps": steps,
        "long_prompt_ttft_s": (window_end - arrival) if control_steps is None else None,
        "arrival": arrival,
        "window_end": window_end,
        "token_times": {r: list(out.metrics.token_times) for r, out in latest.items()},
        "trace": engine.get_step_trace(),
    }


def measured_limits(n: int = 1024) -> dict:
    """This machine's speed now, measured in the same run as the figures it qualifies: a float32
    ``n``×``n``×``n`` matmul's GFLOP/s (the compute a prefill needs) and the GB/s ``torch.sum``
    reads from a tensor far larger than the caches (what a decode needs)."""
    import torch

    from minivllm.benchmarks.common import median_time
    from minivllm.benchmarks.decode_roofline import read_bandwidth

    cpu = torch.device("cpu")
    a, b = torch.randn(n, n), torch.randn(n, n)
    gflops = 2 * n**3 / median_time(lambda: a @ b, 7, cpu) / 1e9
    return {"matmul_gflops": gflops, "read_gb_per_s": read_bandwidth(cpu) / 1e9}


def threads_text(machine: dict) -> str:
    n = machine["torch_threads"]
    return f"{n} torch thread{'' if n == 1 else 's'}"


def limits_line(limits: dict) -> str:
    return (f"machine now: float32 matmul {limits['matmul_gflops']:.1f} GFLOP/s, torch.sum reads "
            f"{limits['read_gb_per_s']:.1f} GB/s")



def save_plot(fig, path: str, bench: str, machine: dict, limits: str | None = None) -> None:
    """Title a benchmark's figure with the machine it ran on and its measured limits (``limits``:
    instead of the machine's own line), save it as a PNG at ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(f"minivllm bench {bench} — {machine['date']}, {machine['cpu_count']} CPUs, "
                 f"{threads_text(machine)}, torch {machine['torch']}; "
                 f"{limits or limits_line(machine)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")

def main(args) -> int:
    common = dict(num_chats=args.num_chats, chat_prompt_len=args.chat_prompt_len,
                  long_prompt_len=args.long_prompt_len, steady_steps=args.steady_steps,
                  seed=args.seed)
    runs = {"v0": dict(scheduler="v0")}
    for c in args.chunk_sizes:
        runs[f"v1-chunk{c}"] = dict(scheduler="v1", long_prefill_token_threshold=c,
                                    max_num_batched_tokens=c + args.num_chats)
    results, timelines = {}, {}
    print(f"{args.num_chats} chats decoding, a {args.long_prompt_len}-token prompt arrives: the "
          "chats' time per output token until its first token, against a control run of as many "
          "steps without it")
    print(f"{'run':>12} {'control P50':>12} {'P99':>9} {'with long P50':>14} {'P99':>9} "
          f"{'P99 ratio':>10} {'long TTFT':>10}")
    for name, kw in runs.items():
        treated = run_scenario(args.model, kw, **common)
        control = run_scenario(args.model, kw, **common, control_steps=treated["steps"])
        r = {
            "control_tpot_p50_ms": percentile(control["gaps"], 50) * 1e3,
            "control_tpot_p99_ms": percentile(control["gaps"], 99) * 1e3,
            "tpot_p50_ms": percentile(treated["gaps"], 50) * 1e3,
            "tpot_p99_ms": percentile(treated["gaps"], 99) * 1e3,
            "long_prompt_ttft_s": treated["long_prompt_ttft_s"],
            "window_steps": treated["steps"],
        }
        r["p99_ratio"] = r["tpot_p99_ms"] / r["control_tpot_p99_ms"]
        results[name] = r
        timelines[name] = chat_timeline(treated)
        r["chat_timeline"] = timelines[name]
        print(f"{name:>12} {r['control_tpot_p50_ms']:10.1f}ms {r['control_tpot_p99_ms']:7.1f}ms "
              f"{r['tpot_p50_ms']:12.1f}ms {r['tpot_p99_ms']:7.1f}ms {r['p99_ratio']:9.2f}x "
              f"{r['long_prompt_ttft_s']:9.2f}s", flush=True)
    machine = {**machine_info(), **measured_limits()}
    print(limits_line(machine))
    write_json(args.json, {"benchmark": "long-prompt", "machine": machine, **common,
                           "runs": results})
    if args.plot:
        plot(args.plot, results, timelines, common, machine)
    return 0


def chat_timeline(run: dict, chat: str = "chat-0") -> list[tuple[float, float]]:
    """One chat's token gaps as (seconds since the long prompt arrived, gap in ms), up to the
    first token after the window: the steady decode before the arrival, then the window."""
    times = [t for t in run["token_times"][chat] if t <= run["window_end"]]
    later = [t for t in run["token_times"][chat] if t > run["window_end"]]
    times += later[:1]
    return [(b - run["arrival"], (b - a) * 1e3) for a, b in zip(times, times[1:])]


def plot(path: str, results: dict, timelines: dict, common: dict, machine: dict) -> None:
    """Left: one chat's time per output token around the arrival, each run a line (log scale).
    Right: the chats' P99 TPOT until the long prompt's first token, against the control run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[1.6, 1])
    for name, points in timelines.items():
        xs, ys = zip(*points) if points else ((), ())
        left.plot(xs, ys, drawstyle="steps-pre", linewidth=1.2,  # each gap spans its interval
                  label=f"{name} (long TTFT {results[name]['long_prompt_ttft_s']:.1f} s)")
    left.axvline(0, color="grey", linestyle=":", linewidth=1)
    left.set_yscale("log")
    left.set_xlabel("seconds since the long prompt arrived")
    left.set_ylabel("time per output token of one chat (ms)")
    left.set_title(f"{common['num_chats']} chats decoding, a {common['long_prompt_len']}-token "
                   "prompt arrives at 0", fontsize=10)
    left.legend(fontsize=8)
    names = list(results)
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [results[n]["control_tpot_p99_ms"] for n in names], 0.4,
              label="control (no long prompt)", color="lightgrey")
    right.bar([i + 0.2 for i in x], [results[n]["tpot_p99_ms"] for n in names], 0.4,
              label="with the long prompt", color="tab:red")
    for i, n in enumerate(names):
        right.annotate(f"{results[n]['p99_ratio']:.2f}x", (i + 0.2, results[n]["tpot_p99_ms"]),
                       ha="center", va="bottom", fontsize=8)
    right.set_yscale("log")
    top = max(max(r["tpot_p99_ms"], r["control_tpot_p99_ms"]) for r in results.values())
    right.set_ylim(top=top * 6)  # room for the ratios and the legend above the bars
    right.set_xticks(list(x), names, rotation=20, fontsize=8)
    right.set_ylabel("chats' P99 TPOT until its first token (ms)")
    right.set_title("P99 against the control run", fontsize=10)
    right.legend(fontsize=8)
    save_plot(fig, path, "long-prompt", machine)
