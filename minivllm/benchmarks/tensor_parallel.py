"""``minivllm bench tp``: what tensor parallelism moves per step, and what that costs here.

One workload (``--num-prompts`` greedy requests) runs at tensor-parallel size 1 (the
single-process executor) and at ``--tensor-parallel-size`` (one worker process per rank), in
one run, and the greedy tokens are compared. Then:

* **broadcast**: every step's ``SchedulerOutput`` of the sharded run was recorded; its pickled
  size (mean, max over the steps), the pickling time, and the round trip of each one through
  the executor's sockets to every worker (pickle, send, unpickle on each rank, a one-word
  answer back) replayed after the run, median over the steps;
* **all-reduce**: the bytes summed per token: the row-parallel layers' two per layer and the
  vocabulary-parallel embedding's one, each ``hidden x dtype size``, computed and counted on
  rank 0 during the workload (``Worker.collective_stats``), and the time of one all-reduce of
  ``[tokens, hidden]`` on the workers' process group (gloo on a CPU, NCCL on GPUs), at a few
  token counts. At size 1 there is no all-reduce at all.

The default model has the shapes of Qwen3-0.6B's layers (hidden 1024, 16 heads over 8 KV
heads, its vocabulary), with ``--num-layers`` of them and random weights: the sizes on the
wire are those of the real model per layer.
"""

from __future__ import annotations

import copy
import pickle
import statistics
import tempfile
import time
from contextlib import contextmanager

from minivllm.benchmarks.common import machine_info, write_json


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("tp", help="tensor parallelism: broadcast and all-reduce cost")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=4,
                   help="layers of the default random-weight model (ignored with --model)")
    p.add_argument("--all-reduce-tokens", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--json", default=None, help="write the figures to this file")
    add_engine_args(p)
    p.set_defaults(func=main, tensor_parallel_size=2)


def _run(llm, prompts, params) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def executor_of(llm):
    """The executor of an ``LLM`` whose engine core runs in this process."""
    from minivllm.testing import engine_core

    return engine_core(llm).model_executor


@contextmanager
def recorded_steps(executor):
    """While inside, every ``SchedulerOutput`` the executor runs is copied into the list
    yielded (the engine core hands each step to ``execute_model``)."""
    recorded = []
    inner = executor.execute_model

    def recording(so):
        recorded.append(copy.deepcopy(so))
        return inner(so)

    executor.execute_model = recording
    try:
        yield recorded
    finally:
        executor.execute_model = inner


def broadcast_figures(executor, recorded: list) -> dict:
    """What broadcasting the recorded steps costs: each one's pickled size, the pickling time,
    and its round trip through the executor's sockets to every worker and back (a ``ping``
    that carries the step: pickle, send, unpickle on each rank, a one-word answer), replayed
    now; and the round trip of an empty message."""
    sizes = [len(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL)) for so in recorded]
    pickle_s, round_trip_s = [], []
    for so in recorded:
        start = time.perf_counter()
        pickle.dumps(("execute_model", (so,), 0), protocol=pickle.HIGHEST_PROTOCOL)
        pickle_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        executor.collective_rpc("ping", (so,))
        round_trip_s.append(time.perf_counter() - start)
    empty = []
    for _ in range(len(recorded)):
        start = time.perf_counter()
        executor.collective_rpc("ping", (None,))
        empty.append(time.perf_counter() - start)
    return {
        "steps": len(recorded),
        "bytes_per_step": sizes,
        "bytes_mean": statistics.mean(sizes), "bytes_max": max(sizes),
        "bytes_first_step": sizes[0],
        "pickle_s_median": statistics.median(pickle_s),
        "round_trip_s_median": statistics.median(round_trip_s),
        "round_trip_empty_s": statistics.median(empty),
    }


def collective_figures(before: dict, after: dict, recorded: list) -> dict:
    """Rank 0's model collectives between two ``Worker.collective_stats`` snapshots, per token
    the recorded steps scheduled and per step."""
    tokens = sum(so.total_num_scheduled_tokens for so in recorded)
    diff = {k: after[k] - before[k] for k in after}
    return {**diff, "tokens": tokens, "steps": len(recorded),
            "all_reduce_bytes_per_token": diff["all_reduce_bytes"] / max(1, tokens),
            "all_reduce_calls_per_step": diff["all_reduce_calls"] / max(1, len(recorded))}


def all_reduce_seconds(executor, token_counts) -> list[dict]:
    """The time of one all-reduce of ``[tokens, hidden]`` on the workers' group (median)."""
    return [executor.collective_rpc("measure_all_reduce", (n,), output_rank=0)[0]
            for n in token_counts]


def main(args) -> int:
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.entrypoints.cli import engine_kwargs
    from minivllm.testing import REAL_SHAPES, make_checkpoint

    tp = args.tensor_parallel_size
    if tp < 2:
        raise ValueError("bench tp compares size 1 with --tensor-parallel-size >= 2")
    kwargs = engine_kwargs(args)
    kwargs.pop("tensor_parallel_size")
    kwargs.pop("distributed_executor_backend")
    if kwargs.get("max_model_len") is None:
        kwargs["max_model_len"] = args.prompt_len + args.output_len + 16
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="minivllm-tp-bench-")
        shape = {**REAL_SHAPES["qwen3-0.6b"], "num_hidden_layers": args.num_layers}
        kwargs["model"] = make_checkpoint(tmp.name, shape)
        kwargs["skip_tokenizer_init"] = True
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 10000, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    llm1 = LLM(show_progress=False, **kwargs)
    c = llm1.llm_engine.config
    tokens1, seconds1 = _run(llm1, prompts, params)
    llm1.llm_engine.shutdown()
    del llm1

    llm = LLM(show_progress=False, tensor_parallel_size=tp, distributed_executor_backend="mp",
              **kwargs)
    executor = executor_of(llm)
    before = executor.collective_rpc("collective_stats", output_rank=0)[0]
    with recorded_steps(executor) as recorded:
        tokens2, seconds2 = _run(llm, prompts, params)
    after = executor.collective_rpc("collective_stats", output_rank=0)[0]
    stats = executor.get_broadcast_stats()
    broadcast = broadcast_figures(executor, recorded)
    collectives = collective_figures(before, after, recorded)

    elem = torch.tensor([], dtype=c.model_config.dtype).element_size()
    m = c.model_config.hf_config
    all_reduce = all_reduce_seconds(executor, args.all_reduce_tokens)
    llm.llm_engine.shutdown()

    result = {
        "machine": machine_info(),
        "model": {"hidden_size": m.hidden_size, "num_layers": m.num_hidden_layers,
                  "heads": m.num_attention_heads, "kv_heads": m.num_key_value_heads,
                  "vocab": m.vocab_size, "dtype": str(c.model_config.dtype).replace("torch.", ""),
                  "random_weights": args.model is None},
        "tensor_parallel_size": tp,
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                     "output_len": args.output_len},
        "greedy_tokens_identical": tokens1 == tokens2,
        "seconds": {"size_1": seconds1, f"size_{tp}": seconds2},
        "broadcast": {**broadcast, "executor_stats": stats},
        "all_reduce": {
            # the row-parallel layers' two per layer, and the vocabulary-parallel embedding's
            "bytes_per_token": (2 * m.num_hidden_layers + 1) * m.hidden_size * elem,
            "measured": collectives,
            "per_call": all_reduce,
        },
    }
    _print(result)
    write_json(args.json, result)
    if tmp is not None:
        tmp.cleanup()
    return 0


def _print(r: dict) -> None:
    m, b, a, tp = r["model"], r["broadcast"], r["all_reduce"], r["tensor_parallel_size"]
    print(f"model: hidden {m['hidden_size']}, {m['num_layers']} layers, {m['heads']} heads / "
          f"{m['kv_heads']} KV heads, vocab {m['vocab']}, {m['dtype']}")
    print(f"greedy tokens identical at size 1 and {tp}: {r['greedy_tokens_identical']}")
    s = r["seconds"]
    print(f"workload: size 1 {s['size_1']:.2f} s, size {tp} {s[f'size_{tp}']:.2f} s")
    print(f"broadcast per step ({b['steps']} steps): {b['bytes_mean']:.0f} B mean, "
          f"{b['bytes_max']} B max (first step {b['bytes_first_step']} B); pickling "
          f"{b['pickle_s_median'] * 1e6:.0f} us; round trip to {tp} workers "
          f"{b['round_trip_s_median'] * 1e6:.0f} us median (an empty message: "
          f"{b['round_trip_empty_s'] * 1e6:.0f} us)")
    me = a["measured"]
    print(f"all-reduce: {a['bytes_per_token']} B per token per forward pass "
          f"((2 per layer + 1 for the embedding) x hidden x dtype); at size 1 none")
    print(f"  counted on rank 0 during the workload: {me['all_reduce_calls']} all-reduces, "
          f"{me['all_reduce_bytes']} B for {me['tokens']} tokens: "
          f"{me['all_reduce_bytes_per_token']:.0f} B per token; "
          f"{me['all_gather_calls']} all-gathers of logits, {me['all_gather_bytes']} B")
    for x in a["per_call"]:
        print(f"  one all-reduce of {x['num_tokens']:>4} tokens ({x['bytes']:>8} B): "
              f"{x['seconds'] * 1e6:8.0f} us")
