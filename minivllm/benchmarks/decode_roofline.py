"""``minivllm bench decode-roofline``: a decode step against what this machine allows.

A decode step of a small model on a CPU does two kinds of work: the linear layers (compute:
every weight times every token of the batch) and attention (memory: every sequence's K/V read
once). This benchmark runs ``--batch`` requests decoding together, their contexts spread over
``--context-range`` tokens, and prints, per step:

* the step's wall time;
* the same step's matmuls alone (every linear layer and the lm_head at this batch, each run
  the way the engine runs it: ``cpu_gemm.linear``, through the packed weight's panels or
  oneDNN's copy where the engine packed one, else ``F.linear``) and the GFLOP/s they reach:
  the machine's limit for those shapes, measured in the same run. Their ratio is how close
  the step comes to its matmuls (1.0: nothing else costs anything);
* attention's time and share of the step, and its effective bandwidth: the bytes of K/V the
  step must read (each sequence's context, every layer, K and V) over attention's time,
  against this machine's measured read bandwidth (``torch.sum`` over a tensor much larger
  than the caches).
"""

from __future__ import annotations

import random
import time

from minivllm.benchmarks.common import machine_info, median_time, percentile, sync, write_json
from minivllm.config import DEFAULT_BATCHED_TOKENS
from minivllm.testing import engine_core
from minivllm.utils import cdiv


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("decode-roofline",
                              help="decode step time against the matmuls' and memory's limits")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context-range", type=int, nargs=2, default=[64, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--steps", type=int, default=10, help="timed decode steps")
    p.add_argument("--json", default=None, help="write the figures to this file")
    add_engine_args(p)
    p.set_defaults(func=main)


def read_bandwidth(device, num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes per second ``torch.sum`` reads from a tensor far larger than the caches."""
    import torch

    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / median_time(lambda: x.sum(), repeats, device)


def matmul_time(model, batch: int, repeats: int = 5) -> tuple[float, float]:
    """Seconds and FLOPs of one step's linear layers (and lm_head) at ``batch`` tokens."""
    import torch

    from minivllm.model.cpu_gemm import linear
    from minivllm.model.parallel_layers import ParallelLMHead

    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, ParallelLMHead))]
    weights = [m.weight for m in layers]
    dtype, device = weights[0].dtype, weights[0].device
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype, device=device)
              for w in weights}
    flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in weights)

    @torch.inference_mode()
    def run():
        for layer in layers:
            linear(layer, inputs[layer.weight.shape[1]])

    return median_time(run, repeats, device), flops


def main(args) -> int:
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.entrypoints.cli import engine_kwargs

    lo, hi = args.context_range
    rng = random.Random(args.seed)
    lens = [rng.randint(lo, hi) for _ in range(args.batch)]
    kwargs = engine_kwargs(args)
    # a request whose prompt is in early decodes while the later prompts prefill (a step per
    # budget's worth of prompt tokens): it must still be running in the timed steps. Without a
    # budget given, the smallest default one bounds the number of prefill steps from above.
    budget = kwargs.get("max_num_batched_tokens") or min(DEFAULT_BATCHED_TOKENS.values())
    max_tokens = args.steps + 4 + cdiv(sum(lens), budget) + args.batch
    if kwargs.get("num_kv_blocks") is None:  # room for every sequence at once: no preemption
        bs = kwargs.get("block_size") or 16
        kwargs["num_kv_blocks"] = sum(cdiv(n + max_tokens + 1, bs) for n in lens) + 8
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 0, args.batch)
    kwargs["max_model_len"] = kwargs.get("max_model_len") or hi + max_tokens + 8
    kwargs["enable_prefix_caching"] = False  # random prompts: nothing to share anyway
    kwargs["trace_steps"] = 0
    llm = LLM(show_progress=False, **kwargs)
    engine = llm.llm_engine
    cfg = engine.config
    core = engine_core(llm)
    runner = core.model_runner
    mc = cfg.model_config.hf_config

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, n in enumerate(lens):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(3, mc.vocab_size)
                                                         for _ in range(n)]}, params)
    started: set[str] = set()
    while len(started) < args.batch:  # every prompt prefilled, its first token out
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    engine.step()  # one warm-up decode step
    running = core.scheduler.running
    if len(running) != args.batch or core.scheduler.waiting:
        raise RuntimeError(f"expected {args.batch} requests decoding, {len(running)} are")
    # contexts during the timed steps: what each holds now, then one more token per step
    mean_context = sum(r.num_tokens for r in running) / args.batch + (args.steps - 1) / 2

    backend = runner.attention_backend
    attention_s = [0.0]
    forward = backend.forward

    def timed_forward(*a, **kw):  # on a GPU: synchronised around (run it with enforce_eager)
        sync(cfg.device_config.device)
        start = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            sync(cfg.device_config.device)
            attention_s[0] += time.perf_counter() - start

    backend.forward = timed_forward
    step_times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()  # returns once the sampled tokens are back on the host
        step_times.append(time.perf_counter() - start)
    backend.forward = forward
    engine.abort_request([str(i) for i in range(args.batch)])

    step = percentile(step_times, 50)
    attention = attention_s[0] / args.steps
    kv_bytes = (args.batch * mean_context * mc.num_hidden_layers * 2 * mc.num_key_value_heads
                * mc.head_dim * torch.finfo(cfg.model_config.dtype).bits // 8)
    mm_s, mm_flops = matmul_time(runner.model, args.batch)
    bandwidth = read_bandwidth(cfg.device_config.device)
    result = {
        "benchmark": "decode-roofline", "machine": machine_info(),
        "model": cfg.model_config.model_path, "dtype": str(cfg.model_config.dtype),
        "attention_backend": cfg.compilation_config.attention_backend,
        "batch": args.batch, "context_range": [lo, hi], "mean_context": mean_context,
        "step_ms": step * 1e3,
        "matmuls_alone_ms": mm_s * 1e3,
        "matmul_gflops_per_s": mm_flops / mm_s / 1e9,
        "matmuls_over_step": mm_s / step,
        "attention_ms": attention * 1e3,
        "attention_share_of_step": attention / step,
        "kv_bytes_per_step": kv_bytes,
        "attention_gb_per_s": kv_bytes / attention / 1e9,
        "read_bandwidth_gb_per_s": bandwidth / 1e9,
        "attention_over_read_bandwidth": kv_bytes / attention / bandwidth,
    }
    r = result
    print(f"batch {args.batch}, contexts {lo}-{hi} (mean {mean_context:.0f}), "
          f"{cfg.compilation_config.attention_backend} attention, {torch.get_num_threads()} threads")
    print(f"decode step        {r['step_ms']:8.1f} ms")
    print(f"matmuls alone      {r['matmuls_alone_ms']:8.1f} ms  ({r['matmul_gflops_per_s']:.1f} "
          f"GFLOP/s): {r['matmuls_over_step']:.0%} of the step")
    print(f"attention          {r['attention_ms']:8.1f} ms  ({r['attention_share_of_step']:.0%} of "
          f"the step): {r['attention_gb_per_s']:.1f} GB/s of K/V, "
          f"{r['attention_over_read_bandwidth']:.0%} of the {r['read_bandwidth_gb_per_s']:.1f} GB/s "
          "read bandwidth")
    write_json(args.json, result)
    return 0
