"""Chapter 11's tools: the ablation ladder (``RUNGS``) served and measured, the simulator's cost
model calibrated from an engine's measured steps, and the simulated runs Exercise 11.1 tunes."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from minivllm.benchmarks.shared_prefix import run_all_at_once  # noqa: F401 (the chapter's name)
from minivllm.config import EngineArgs, SchedulerConfig
from minivllm.sim.cost_model import CostModel
from minivllm.sim.engine import SimEngine
from minivllm.sim.workloads import ServingWorkload, chat_and_documents  # noqa: F401 (11.1)
from minivllm.utils import percentile

# the ablation ladder: each rung adds one thing to the one before and states all four switches
RUNGS: list[tuple[str, list[str]]] = [
    ("torch eager", ["--attention-backend", "torch", "--custom-ops", "none", "--enforce-eager",
                     "--no-multiprocess"]),
    ("+ Triton attention", ["--attention-backend", "triton", "--custom-ops", "none",
                            "--enforce-eager", "--no-multiprocess"]),
    ("+ fused kernels", ["--attention-backend", "triton", "--custom-ops", "all", "--enforce-eager",
                         "--no-multiprocess"]),
    ("+ CUDA graphs", ["--attention-backend", "triton", "--custom-ops", "all",
                       "--no-enforce-eager", "--no-multiprocess"]),
    ("+ multi-process", ["--attention-backend", "triton", "--custom-ops", "all",
                         "--no-enforce-eager", "--multiprocess"]),
]


def rung_settings(flags: list[str], device: str = "cuda") -> dict:
    """What ``minivllm serve <flags>`` runs on ``device`` (parsed and resolved as it does)."""
    import torch

    from minivllm.entrypoints.cli import build_parser

    engine_args = EngineArgs.from_cli_args(build_parser().parse_args(["serve", *flags]))
    dev = torch.device(device)
    backend, fused = engine_args.resolve_kernels(dev)
    return {"attention": backend, "fused_kernels": fused,
            "cuda_graphs": dev.type == "cuda" and not engine_args.enforce_eager,
            "engine_core": "own process" if engine_args.multiprocess else "server's process"}


def first_layers(source: str, folder: str, num_layers: int) -> str:
    """A checkpoint of ``source``'s first ``num_layers`` decoder layers (with its embeddings,
    final norm, LM head and tokenizer), for short CPU runs; written with safetensors' numpy API
    (nothing imports torch)."""
    import glob
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    from minivllm.testing import copy_tokenizer

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    kept = {}
    for path in sorted(glob.glob(os.path.join(source, "*.safetensors"))):
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                parts = name.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                    continue
                kept[name] = f.get_tensor(name)
    save_file(kept, os.path.join(folder, "model.safetensors"))
    copy_tokenizer(source, folder)
    if os.path.isfile(os.path.join(source, "generation_config.json")):
        shutil.copy(os.path.join(source, "generation_config.json"), folder)
    return folder


def start_server(model: str | None, flags: list[str], env: dict | None = None):
    """``minivllm serve [model] <flags> --port 0`` as a child process, returned before ready."""
    import time

    from minivllm.benchmarks.common import ServerProcess

    server = ServerProcess(([model] if model else []) + list(flags) + ["--port", "0"], env=env)
    server.started_at = time.perf_counter()
    server.flags = list(flags)
    return server


def bench_url(url: str, num_prompts: int, input_len: int, output_len: int,
              max_concurrency: int | None = None, request_rate: float = float("inf"),
              seed: int = 0, keep_results: bool = False) -> dict:
    """``bench serve``'s summary against ``url``: random prompts, exactly ``output_len`` tokens."""
    from minivllm.course.loadtest import bench, client_args

    return bench(client_args(url, num_clients=max_concurrency, num_prompts=num_prompts,
                             input_len=input_len, output_len=output_len,
                             request_rate=request_rate, seed=seed), keep_results=keep_results)


def bench_server(server, **workload) -> dict:
    """Wait for ``server``, ``bench_url`` it with ``workload``, stop it: the summary, plus
    ``startup_s`` (time to ready) and its flags."""
    import time

    try:
        url = server.wait_ready()
        startup = time.perf_counter() - server.started_at
        summary = bench_url(url, **workload)
    finally:
        server.stop()
    return {**summary, "startup_s": startup, "flags": server.flags}


@contextlib.contextmanager
def serving_in_thread(model: str | None, flags: list[str]):
    """What ``minivllm serve [model] <flags> --no-multiprocess`` runs, on a thread of this
    process (no second Python, no second import of torch). Yields the server's URL."""
    from minivllm.course.checks.serving import app_in_thread
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.cli import build_parser
    from minivllm.entrypoints.openai.api_server import build_app
    from minivllm.model_hub import resolve_model

    args = build_parser().parse_args(["serve", *([model] if model else []), *flags,
                                      "--no-multiprocess"])
    args.model = resolve_model(args.model_tag or args.model)
    engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args), show_progress=False)
    with app_in_thread(build_app(engine, [os.path.basename(args.model)]), engine) as url:
        yield url


def serve_and_bench(model: str | None, flags: list[str], env: dict | None = None,
                    **workload) -> dict:
    """One rung: ``start_server``, then ``bench_server`` with ``workload`` (its keywords)."""
    return bench_server(start_server(model, flags, env), **workload)


def cost_model_for(config: dict, name: str, dtype_bytes: int, peak_flops: float,
                   mem_bandwidth: float, mfu: float = 0.5, mbu: float = 0.7,
                   step_overhead_s: float = 0.0) -> CostModel:
    """The simulator's cost model for a checkpoint's config.json (a dict) on a device with these
    peaks. FLOPs: 2 per decoder-layer weight per token; bytes: every weight once."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * config["intermediate_size"])
    embed = config["vocab_size"] * h
    tied = config.get("tie_word_embeddings", False)
    total = linear + layers * 2 * h + h + embed * (1 if tied else 2)
    return CostModel(name=name, num_params=linear, weight_bytes=total * dtype_bytes,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                     dtype_bytes=dtype_bytes, peak_flops=peak_flops, mfu=mfu,
                     mem_bandwidth=mem_bandwidth, mbu=mbu, step_overhead_s=step_overhead_s)


def step_work(trace: list[dict]) -> list[tuple[float, list[tuple[int, int]]]]:
    """(measured seconds, [(new tokens, context after the step)]) per step of a
    ``get_step_trace()`` (run without prefix-cache hits or preemptions)."""
    done: dict[str, int] = {}
    steps = []
    for step in trace:
        work = []
        for rid, n, _ in step["scheduled"]:
            done[rid] = done.get(rid, 0) + n
            work.append((n, done[rid]))
        steps.append((step["duration_s"], work))
    return steps


def _split_times(cm: CostModel, work: list[tuple[int, int]]) -> tuple[float, float]:
    """(compute time, memory time) of a step under ``cm``, overhead left out."""
    compute = dataclasses.replace(cm, mem_bandwidth=float("inf"), step_overhead_s=0.0)
    memory = dataclasses.replace(cm, peak_flops=float("inf"), step_overhead_s=0.0)
    return compute.step_time(work), memory.step_time(work)


def _nonnegative_lstsq(columns: list[list[float]], y: list[float]) -> list[float]:
    """argmin ||A x - y|| with x >= 0: the best non-negative unconstrained fit of any subset."""
    import itertools

    import numpy as np

    a, y = np.array(columns, dtype=float).T, np.array(y, dtype=float)
    best, best_x = float("inf"), [0.0] * a.shape[1]
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            err = float(((a[:, cols] @ sol - y) ** 2).sum())
            if err < best:
                best, best_x = err, [0.0] * a.shape[1]
                for c, v in zip(cols, sol):
                    best_x[c] = float(v)
    return best_x


def calibrate(cm: CostModel, steps: list[tuple[float, list[tuple[int, int]]]],
              rounds: int = 5) -> CostModel:
    """``cm`` with its step overhead, MFU and MBU fitted to measured steps (``step_work``).

    A step takes ``overhead + max(compute, memory)``: given which term bounds each step, linear
    in (overhead, 1 / MFU, 1 / MBU), fitted with overhead >= 0 and MFU, MBU <= 1; re-classify and
    refit until the classes settle. ``calibration`` on the result counts each bound's steps and
    says which utilisation ended at 100%."""
    fitted = dataclasses.replace(cm, mfu=min(cm.mfu, 1.0), mbu=min(cm.mbu, 1.0))
    bound = None
    extra = (0.0, 0.0, 0.0)
    for _ in range(rounds):
        split = [_split_times(fitted, work) for _, work in steps]
        new_bound = [c >= m for c, m in split]
        if new_bound == bound:
            break
        bound = new_bound
        # each step's time at utilisation 1: the least its bounding term can take
        unit = [_split_times(dataclasses.replace(fitted, mfu=1.0, mbu=1.0), work)
                for _, work in steps]
        compute = [c if b else 0.0 for (c, _), b in zip(unit, bound)]
        memory = [0.0 if b else m for (_, m), b in zip(unit, bound)]
        # time = overhead + (1 + x) * compute + (1 + y) * memory, with overhead, x, y >= 0
        rest = [t - c - m for (t, _), c, m in zip(steps, compute, memory)]
        extra = _nonnegative_lstsq([[1.0] * len(steps), compute, memory], rest)
        overhead, x, y = extra
        fitted = dataclasses.replace(fitted, step_overhead_s=overhead, mfu=1.0 / (1.0 + x),
                                     mbu=1.0 / (1.0 + y))
    fitted.calibration = {"num_steps": len(steps), "compute_bound_steps": sum(bound or []),
                          "memory_bound_steps": len(steps) - sum(bound or []),
                          "mfu_at_bound": extra[1] == 0.0, "mbu_at_bound": extra[2] == 0.0}
    return fitted


def scheduler_config_of(scheduler) -> tuple[str, SchedulerConfig]:
    """("v0" or "v1", the SchedulerConfig) of a real engine's scheduler, for a simulated one."""
    from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler

    kind = "v0" if isinstance(scheduler, PhaseSeparatedScheduler) else "v1"
    fields = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill",
              "long_prefill_token_threshold")
    return kind, SchedulerConfig(**{f: getattr(scheduler, f) for f in fields})


# Exercise 11.1: goodput under P99 targets, simulated
KNOBS = ("max_num_batched_tokens", "long_prefill_token_threshold", "max_num_seqs")
TARGET_KEYS = ("p99_ttft_ms", "p99_itl_ms")
# the request rates (requests/s) at which a configuration is tried
GOODPUT_RATES: tuple[float, ...] = tuple(float(r) for r in range(4, 36, 4))


def config_problem(config, knobs=KNOBS) -> str | None:
    """Why ``config`` is not a choice of ``knobs`` as ints in their ranges (None if it is)."""
    if not isinstance(config, dict):
        return f"expected a dict, got {type(config).__name__}"
    if set(config) != set(knobs):
        return f"expected exactly the keys {list(knobs)}, got {sorted(config)}"
    lows = {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 0, "max_num_seqs": 1}
    for key in knobs:
        v = config[key]
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            return f"{key} must be an int, got {v!r}"
        if not lows[key] <= int(v) <= 65536:
            return f"{key} must be in [{lows[key]}, 65536], got {int(v)}"
    return None


def simulate_at_rate(config: dict, workload: ServingWorkload, rate: float,
                     cost_model: CostModel | None = None) -> dict:
    """The workload arriving at ``rate`` requests/s on a simulated v1 engine (chunked prefill,
    no prefix caching, room for every request) scheduled with ``config``: P99 TTFT and ITL,
    mean and median TTFT, in simulated milliseconds."""
    problem = config_problem(config)
    if problem:
        raise ValueError(problem)
    sc = SchedulerConfig(max_num_seqs=int(config["max_num_seqs"]),
                         max_num_batched_tokens=int(config["max_num_batched_tokens"]),
                         max_model_len=workload.max_model_len, enable_chunked_prefill=True,
                         long_prefill_token_threshold=int(config["long_prefill_token_threshold"]))
    block_size = EngineArgs.block_size
    num_blocks = sum(-(-(p + o) // block_size) for p, o in workload.requests) + 16
    sim = SimEngine(num_blocks, block_size, scheduler_config=sc, enable_prefix_caching=False,
                    cost_model=cost_model)
    t = 0.0
    for i, ((prompt, output), gap) in enumerate(zip(workload.requests, workload.unit_gaps)):
        t += gap / rate
        sim.add_request(f"r{i}", [100] * prompt, output, t)  # token ids matter only to caching
    records = sim.run()
    ttft = [r.ttft for r in records.values()]
    itl = [b - a for r in records.values() for a, b in zip(r.token_times, r.token_times[1:])]
    return {"rate": rate, "p99_ttft_ms": percentile(ttft, 99) * 1e3,
            "p99_itl_ms": percentile(itl, 99) * 1e3, "duration_s": sim.clock,
            "mean_ttft_ms": sum(ttft) / len(ttft) * 1e3, "p50_ttft_ms": percentile(ttft, 50) * 1e3}


def misses(run: dict, targets: dict) -> dict[str, float]:
    """{target: by how many ms the run misses it} (empty: the run meets both targets)."""
    return {k: run[k] - targets[k] for k in TARGET_KEYS if run[k] > targets[k]}


def evaluate_goodput(config: dict, workload: ServingWorkload, targets: dict,
                     rates: tuple[float, ...] = GOODPUT_RATES,
                     cost_model: CostModel | None = None) -> dict:
    """Goodput of ``config``: the highest of ``rates`` (bisected) meeting both P99 targets, 0 if
    none. Returns ``goodput``, every simulated ``runs`` entry (rate -> P99s) and ``limit``: the
    lowest missing rate's run with its ``misses`` (None if none missed)."""
    runs: dict[float, dict] = {}
    lo, hi = -1, len(rates)  # rates[lo] meets the targets, rates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        run = simulate_at_rate(config, workload, rates[mid], cost_model)
        runs[rates[mid]] = run
        if misses(run, targets):
            hi = mid
        else:
            lo = mid
    limit = runs.get(rates[hi]) if hi < len(rates) else None
    limit = limit and {**limit, "misses": misses(limit, targets)}
    return {"goodput": rates[lo] if lo >= 0 else 0.0,
            "runs": dict(sorted(runs.items())), "limit": limit}
