"""``minivllm bench throughput``: offline throughput on a fixed, seeded workload.

``--workload`` picks one (each flag below overrides a part of it):

* ``mixed`` (default): 48 requests, prompts of 8–400 tokens, outputs of 8–200 tokens — what a
  server sees; transformers gets the kindest batching it can use offline: requests sorted by
  prompt length, in groups of 16;
* ``uniform``: 64 prompts of 32 tokens, 128 new tokens each — transformers' best case, one
  batch of 64 with no padding and no early finishers.

Prompts are random ordinary tokens, greedy, ``ignore_eos`` (every request generates exactly its
length). With ``--compare-hf`` the same workload runs through transformers' batched
``generate`` (left padding, each batch generating to its longest output) in the same process,
and the ratio is printed. Throughput counts only the tokens requests asked for.
"""

from __future__ import annotations

import argparse
import random
import time

from minivllm.benchmarks.common import machine_info, random_token_prompts, write_json


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("throughput", help="offline tokens/s, optionally vs transformers")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--compare-hf", action="store_true", help="also run transformers' generate")
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--hf-sort", action=argparse.BooleanOptionalAction, default=None,
                   help="give transformers the requests sorted by prompt length")
    p.add_argument("--json", default=None, help="write the figures to this file")
    add_engine_args(p)
    p.set_defaults(func=main)


WORKLOADS = {
    "mixed": dict(num_prompts=48, input_len_range=[8, 400], output_len_range=[8, 200],
                  hf_batch_size=16, hf_sort=True),
    "uniform": dict(num_prompts=64, input_len_range=[32, 32], output_len_range=[128, 128],
                    hf_batch_size=64, hf_sort=False),
}


def resolve_workload(args) -> dict:
    """The named workload, with any flag given on the command line taking precedence."""
    spec = dict(WORKLOADS[args.workload])
    for key in spec:
        if getattr(args, key, None) is not None:
            spec[key] = getattr(args, key)
    return spec


def make_workload(num_prompts, input_range, output_range, vocab_size, avoid, seed=0):
    rng = random.Random(seed)
    in_lens = [rng.randint(*input_range) for _ in range(num_prompts)]
    out_lens = [rng.randint(*output_range) for _ in range(num_prompts)]
    prompts = random_token_prompts(rng, in_lens, vocab_size, avoid)
    return prompts, out_lens


def run_minivllm(llm, prompts, out_lens) -> float:
    from minivllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == out_lens
    return elapsed


def run_hf(model_path, prompts, out_lens, batch_size, device, dtype, pad_id,
           sort: bool = False) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i])) if sort else \
        list(range(len(prompts)))

    def batches():
        for i in range(0, len(order), batch_size):
            group = order[i : i + batch_size]
            yield [prompts[j] for j in group], [out_lens[j] for j in group]

    def run(batch, lens):
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):  # left padding: every prompt ends at the last column
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        n = max(lens)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=pad_id)

    run([prompts[0][:8]], [2])  # warm-up
    start = time.perf_counter()
    for batch, lens in batches():
        run(batch, lens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(args) -> int:
    from minivllm import LLM
    from minivllm.entrypoints.cli import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    cfg = llm.llm_engine.config
    tok = llm.get_tokenizer()
    avoid = set(tok.all_special_ids)
    spec = resolve_workload(args)
    prompts, out_lens = make_workload(
        spec["num_prompts"], spec["input_len_range"], spec["output_len_range"],
        cfg.model_config.hf_config.vocab_size, avoid, seed=args.seed,
    )
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(out_lens)
    run_minivllm(llm, [prompts[0][:8]], [2])  # warm-up
    elapsed = run_minivllm(llm, prompts, out_lens)
    result = {
        "benchmark": "throughput",
        "machine": machine_info(),
        "model": cfg.model_config.model_path if args.model else "bundled SmolLM2-135M-Instruct",
        "workload": args.workload,
        "workload_spec": spec,
        "num_prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "minivllm": _rates(elapsed, prompt_tokens, output_tokens),
    }
    print(f"minivllm:     {elapsed:8.2f} s  {output_tokens / elapsed:9.1f} output tok/s  "
          f"{(prompt_tokens + output_tokens) / elapsed:9.1f} total tok/s")
    if args.compare_hf:
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        hf_elapsed = run_hf(cfg.model_config.model_path, prompts, out_lens, spec["hf_batch_size"],
                            cfg.device_config.device, cfg.model_config.dtype, pad,
                            sort=spec["hf_sort"])
        result["transformers"] = _rates(hf_elapsed, prompt_tokens, output_tokens)
        result["transformers"]["batch_size"] = spec["hf_batch_size"]
        result["transformers"]["sorted_by_prompt_length"] = spec["hf_sort"]
        result["speedup_vs_transformers"] = hf_elapsed / elapsed
        print(f"transformers: {hf_elapsed:8.2f} s  {output_tokens / hf_elapsed:9.1f} output tok/s  "
              f"{(prompt_tokens + output_tokens) / hf_elapsed:9.1f} total tok/s")
        print(f"speedup: {hf_elapsed / elapsed:.2f}x transformers")
    write_json(args.json, result)
    return 0


def _rates(elapsed: float, prompt_tokens: int, output_tokens: int) -> dict:
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }
