"""``minivllm bench serve-compare``: the process split, measured side by side in one run.

The same workload (``bench serve``'s datasets and options), three ways on this machine:

1. ``minivllm serve``: the engine core in its own process (the default);
2. ``minivllm serve --no-multiprocess``: the same core on a thread of the API server's process,
   sharing its GIL with HTTP handling, tokenization and detokenization;
3. offline ``LLM.generate`` on the same prompts and output lengths (no HTTP at all), with the
   torch threads a server's engine core gets (on a CPU: all cores but one), so that only the
   serving differs.

Each server is started fresh, driven by the ``bench serve`` client (streaming requests, at most
``--max-concurrency`` in flight) while /health is probed every ``--health-interval`` seconds,
then stopped. ``--server-args`` go to both servers and configure the offline engine too.
"""

from __future__ import annotations

import asyncio
import shlex
import statistics
import time

from minivllm.benchmarks.common import ServerProcess, machine_info, write_json
from minivllm.benchmarks.serve import add_client_args, make_requests, print_summary, run_benchmark

MODES = ("multiprocess", "inprocess", "offline")


def add_parser(subparsers, add_engine_args=None) -> None:
    p = subparsers.add_parser(
        "serve-compare", help="multi-process vs in-process server vs offline, one workload")
    add_client_args(p)
    p.set_defaults(max_concurrency=128, num_prompts=256, health_interval=0.05)
    p.add_argument("--server-args", default="",
                   help="`minivllm serve` flags for both servers and the offline engine, "
                        "e.g. '--max-num-seqs 128' or 'path/to/model --max-model-len 1024'")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--rounds", type=int, default=1, help="repeat the modes, interleaved")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=main)


def _serve_args(server_args: str):
    from minivllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", *shlex.split(server_args)])
    if args.model_tag is not None:
        args.model = args.model_tag
    return args


def run_server_mode(args, requests, multiprocess: bool) -> dict:
    flags = shlex.split(args.server_args) + ["--port", "0"]
    if not multiprocess:
        flags.append("--no-multiprocess")
    server = ServerProcess(flags)
    try:
        args.base_url = server.wait_ready()
        from minivllm.benchmarks.serve import served_model

        model, _ = served_model(args)
        return asyncio.run(run_benchmark(args, requests, model))
    finally:
        server.stop()


def run_offline(engine_kwargs: dict, requests) -> dict:
    """``LLM.generate`` with the torch threads a server's engine core gets (same compute)."""
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.engine.core_proc import configure_cpu_threads

    llm = LLM(show_progress=False, **engine_kwargs)
    configure_cpu_threads(llm.llm_engine.config)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(r.output_len for r in requests)
    in_tokens = sum(len(r.prompt_token_ids) for r in requests)
    llm.llm_engine.shutdown()
    return {"duration_s": elapsed, "torch_threads": torch.get_num_threads(),
            "total_output_tokens": out_tokens,
            "request_throughput": len(requests) / elapsed,
            "output_throughput": out_tokens / elapsed,
            "total_token_throughput": (in_tokens + out_tokens) / elapsed}


def main(args) -> int:
    from minivllm.engine.processor import load_tokenizer
    from minivllm.entrypoints.cli import engine_kwargs
    from minivllm.model_hub import resolve_model

    serve_args = _serve_args(args.server_args)
    kwargs = engine_kwargs(serve_args)
    kwargs.pop("multiprocess", None)
    tok = load_tokenizer(args.tokenizer or resolve_model(serve_args.model))
    requests = make_requests(args, len(tok), set(tok.all_special_ids))
    result = {"benchmark": "serve-compare", "machine": machine_info(),
              "model": serve_args.model or "bundled SmolLM2-135M-Instruct",
              "server_args": args.server_args, "dataset": args.dataset,
              "num_prompts": len(requests), "max_concurrency": args.max_concurrency,
              "request_rate": str(args.request_rate)}
    failed = 0
    rounds = []
    for r in range(args.rounds):  # interleaved: a slow minute on a shared machine hits every mode
        one = {}
        for mode in args.modes:
            title = f"round {r + 1}/{args.rounds}: "
            if mode == "offline":
                one[mode] = run_offline(kwargs, requests)
                print(f"============ {title}offline LLM.generate ============\n"
                      f"output throughput (tok/s):  {one[mode]['output_throughput']:.1f}  "
                      f"({one[mode]['duration_s']:.2f} s, {one[mode]['torch_threads']} torch threads)")
            else:
                one[mode] = run_server_mode(args, requests, multiprocess=mode == "multiprocess")
                failed += one[mode]["failed"]
                print_summary(f"{title}minivllm serve, {mode}", one[mode])
        one.update(_ratios(one))
        rounds.append(one)
    result["rounds"] = rounds
    for key in rounds[0]:
        if key.endswith("_throughput"):
            result[f"median_{key}"] = statistics.median(one[key] for one in rounds)
            print(f"{key}: " + ", ".join(f"{v:.3f}" for v in (one[key] for one in rounds)))
    write_json(args.json, result)
    return 0 if failed == 0 else 1


def _ratios(one: dict) -> dict:
    ratios = {}
    if "multiprocess" in one and "inprocess" in one:
        ratios["multiprocess_vs_inprocess_throughput"] = (
            one["multiprocess"]["output_throughput"] / one["inprocess"]["output_throughput"])
    for mode in ("multiprocess", "inprocess"):
        if mode in one and "offline" in one:
            ratios[f"{mode}_vs_offline_throughput"] = (
                one[mode]["output_throughput"] / one["offline"]["output_throughput"])
    return ratios
