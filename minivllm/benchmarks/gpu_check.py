"""The GPU check: what the project measures on a GPU, in one run (docs/gpu.md).

``tools/gpu_check.sh`` runs the GPU-marked tests, then ``python -m minivllm.benchmarks.gpu_check``,
whose phases each add a section to ``$OUT/gpu_check.json`` (written after every phase, so a run
cut short keeps what it measured):

* ``kernels``      — decode attention GB/s vs HBM peak at 1k-32k context; prefill TFLOP/s vs SDPA
                     (``minivllm bench kernels``);
* ``e2e``          — offline throughput on a Qwen3-0.6B-shaped bf16 model with random weights:
                     256 requests, input and output lengths uniform in 100-1024, greedy,
                     minivllm with CUDA graphs, without (``enforce_eager``), and transformers'
                     ``generate`` on the same workload in the same process;
* ``decode_steps`` — median decode-step time at batch 1, 4, 8: eager vs CUDA graphs, and with
                     the fused kernels off (``custom_ops="none"``) or ``compile=True``;
* ``decode_roofline`` — ``minivllm bench decode-roofline`` on a SmolLM2-135M-shaped model
                     (eager, so attention can be timed): step time against the matmuls alone
                     and attention's bandwidth against the device's measured read bandwidth;
* ``overhead``     — ``minivllm bench overhead``: host time per decode step, part by part, at
                     batch 1/64/256 (CUDA graphs on);
* ``correctness``  — greedy tokens against transformers on the same weights: float32 (TF32 off)
                     must match exactly; bfloat16 is reported (matching prefix per prompt).

No model is downloaded: checkpoints are written with ``minivllm.testing.make_checkpoint``.
``--quick`` shrinks everything to tiny shapes so the whole script runs on a CPU in a minute or two
(the figures are then meaningless; it proves the script works).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback

PHASES = ("kernels", "e2e", "decode_steps", "decode_roofline", "overhead", "correctness")
# random-weight checkpoints (make_checkpoint presets) per mode: throughput model, exactness model
MODELS = {"full": ("qwen3-0.6b", "smollm2-135m"), "quick": ("qwen3", "llama")}
AVOID_IDS = {0, 1, 2}  # pad, bos, eos of make_checkpoint's configs: prompts never contain them


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Checkpoints:
    """Random-weight checkpoints written once per run into a scratch folder."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.paths: dict[tuple[str, str], str] = {}

    def get(self, preset: str, dtype: str) -> str:
        from minivllm.testing import make_checkpoint

        if (preset, dtype) not in self.paths:
            folder = os.path.join(self.root, f"{preset}-{dtype}")
            self.paths[preset, dtype] = make_checkpoint(folder, preset, dtype=dtype)
        return self.paths[preset, dtype]


def _engine_base(quick: bool, cuda: bool) -> dict:
    return dict(skip_tokenizer_init=True, show_progress=False, max_model_len=2048 if not quick else 256,
                dtype="bfloat16" if cuda else "float32")


def _config_summary(llm) -> dict:
    c = llm.llm_engine.config
    k, s = c.compilation_config, c.scheduler_config
    return {"attention_backend": k.attention_backend, "use_custom_ops": k.use_custom_ops,
            "use_cuda_graph": k.use_cuda_graph, "compile": k.compile,
            "dtype": str(c.model_config.dtype),
            "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens}


# -- phases --------------------------------------------------------------------------------------
def phase_kernels(args, ckpts) -> dict:
    from minivllm.benchmarks.kernels import run

    return run(quick=args.quick)


def phase_e2e(args, ckpts) -> dict:
    import torch

    from minivllm import LLM
    from minivllm.benchmarks.throughput import make_workload, run_hf, run_minivllm

    cuda = torch.cuda.is_available()
    preset = MODELS["quick" if args.quick else "full"][0]
    path = ckpts.get(preset, "bfloat16" if cuda else "float32")
    n = args.num_prompts or (6 if args.quick else 256)
    lens = (8, 32) if args.quick else (100, 1024)
    base = _engine_base(args.quick, cuda)
    from minivllm.model.config import ModelConfig

    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts, out_lens = make_workload(n, lens, lens, vocab, AVOID_IDS, seed=0)
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(out_lens)
    result = {"model": f"{preset} (random weights)", "num_prompts": n, "length_range": lens,
              "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "runs": {}}

    def rates(elapsed):
        return {"elapsed_s": elapsed, "output_tokens_per_s": output_tokens / elapsed,
                "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed}

    for name, extra in (("cuda_graphs", {}), ("eager", {"enforce_eager": True})):
        start = time.perf_counter()
        llm = LLM(path, **base, **extra)
        startup = time.perf_counter() - start
        run_minivllm(llm, [prompts[0][:8]], [2])  # warm-up
        elapsed = run_minivllm(llm, prompts, out_lens)
        result["runs"][name] = {**rates(elapsed), "startup_s": startup, "config": _config_summary(llm),
                                "num_steps": llm.llm_engine.get_stats()["num_steps"]}
        print(f"e2e {name}: {elapsed:.1f} s, {output_tokens / elapsed:.0f} output tok/s", flush=True)
        del llm
        _free_memory()
    runs = result["runs"]
    runs_graph_speedup = runs["eager"]["elapsed_s"] / runs["cuda_graphs"]["elapsed_s"]
    result["cuda_graphs_speedup_end_to_end"] = runs_graph_speedup
    if not args.skip_hf:
        device = torch.device("cuda" if cuda else "cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        hf = run_hf(path, prompts, out_lens, args.hf_batch_size, device, dtype, pad_id=0)
        runs["transformers"] = {**rates(hf), "batch_size": args.hf_batch_size}
        result["speedup_vs_transformers"] = {k: hf / runs[k]["elapsed_s"]
                                             for k in ("cuda_graphs", "eager")}
        print(f"e2e transformers: {hf:.1f} s; minivllm is "
              f"{result['speedup_vs_transformers']['cuda_graphs']:.1f}x faster", flush=True)
        _free_memory()
    return result


def phase_decode_steps(args, ckpts) -> dict:
    import torch

    from minivllm import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    preset = MODELS["quick" if args.quick else "full"][0]
    path = ckpts.get(preset, "bfloat16" if cuda else "float32")
    batches = (1, 2) if args.quick else (1, 4, 8)
    steps = 8 if args.quick else 128
    configs = {"eager": {"enforce_eager": True}, "cuda_graphs": {},
               "cuda_graphs_custom_ops_none": {"custom_ops": "none"},
               "cuda_graphs_compile": {"compile": True}}
    if args.quick:
        del configs["cuda_graphs_compile"]  # inductor on a CPU takes most of a minute
    rng = random.Random(1)
    base = {**_engine_base(args.quick, cuda), "max_num_seqs": max(batches), "max_model_len": 512}
    result = {"model": f"{preset} (random weights)", "decode_steps_per_run": steps, "runs": {}}
    for name, extra in configs.items():
        llm = LLM(path, **base, **extra)
        per_batch = {}
        for b in batches:
            prompts = [{"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(16)]}
                       for _ in range(b)]
            params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            first = llm.llm_engine.get_stats()["num_steps"]
            llm.generate(prompts, params, use_tqdm=False)
            trace = [s for s in llm.llm_engine.get_step_trace() if s["step"] > first]
            decode = [s["duration_s"] for s in trace
                      if all(kind == "decode" for _, _, kind in s["scheduled"])]
            per_batch[b] = {"median_decode_step_ms": 1e3 * statistics.median(decode),
                            "decode_steps": len(decode)}
        result["runs"][name] = {"config": _config_summary(llm), "by_batch": per_batch}
        print(f"decode steps {name}: " + ", ".join(
            f"b={b} {v['median_decode_step_ms']:.2f} ms" for b, v in per_batch.items()), flush=True)
        del llm
        _free_memory()
    eager = result["runs"]["eager"]["by_batch"]
    result["cuda_graphs_speedup_by_batch"] = {
        b: eager[b]["median_decode_step_ms"] / v["median_decode_step_ms"]
        for b, v in result["runs"]["cuda_graphs"]["by_batch"].items()}
    return result


def _hf_greedy(path, dtype, device, prompts, max_new_tokens) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            # no min_new_tokens: like the engine, stop after an EOS (and return it)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    del model
    return outs


def phase_correctness(args, ckpts) -> dict:
    import torch

    from minivllm import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rng = random.Random(2)
    lens = (7, 33) if args.quick else (7, 33, 100, 250)  # quick: proves the phase, no figures
    prompts = [[rng.randrange(3, 30000) for _ in range(n)] for n in lens]
    new = 8 if args.quick else 32
    exact_preset, big_preset = MODELS["quick" if args.quick else "full"][1], \
        MODELS["quick" if args.quick else "full"][0]
    cases = [("float32", exact_preset, torch.float32)]
    if cuda:
        cases.append(("bfloat16", big_preset, torch.bfloat16))
    result = {}
    for dtype_name, preset, dtype in cases:
        path = ckpts.get(preset, dtype_name)
        llm = LLM(path, skip_tokenizer_init=True, show_progress=False, dtype=dtype_name,
                  max_model_len=512)
        ours = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=new), use_tqdm=False)]
        config = _config_summary(llm)
        del llm
        _free_memory()
        ref = _hf_greedy(path, dtype, device, prompts, new)
        _free_memory()
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                  for x, y in zip(ours, ref)]
        result[dtype_name] = {"model": f"{preset} (random weights)", "config": config,
                              "prompt_lens": [len(p) for p in prompts], "new_tokens": new,
                              "matching_prefix": prefix, "all_match": ours == ref}
        print(f"correctness {dtype_name}: matching prefix {prefix} of {new}", flush=True)
    # float32 on the same weights must give the very same tokens; bfloat16 is only reported
    result["ok"] = result["float32"]["all_match"]
    return result


def _run_bench(argv: list[str]) -> dict:
    """Run a ``minivllm bench ...`` command in this process; its JSON result."""
    import json

    from minivllm.entrypoints.cli import main as cli_main

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        if cli_main(["bench", *argv, "--json", f.name]) != 0:
            raise RuntimeError(f"minivllm bench {' '.join(argv)} failed")
        with open(f.name) as g:
            return json.load(g)


def phase_decode_roofline(args, ckpts) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    preset = "llama" if args.quick else "smollm2-135m"
    dtype = "bfloat16" if cuda else "float32"
    argv = ["decode-roofline", "--model", ckpts.get(preset, dtype), "--skip-tokenizer-init",
            "--dtype", dtype, "--enforce-eager"]
    if args.quick:
        argv += ["--batch", "4", "--context-range", "8", "64", "--steps", "2"]
    return _run_bench(argv)


def phase_overhead(args, ckpts) -> dict:
    argv = ["overhead"]
    if args.quick:
        argv += ["--batch-sizes", "1", "8", "--steps", "3"]
    return _run_bench(argv)


PHASE_FUNCS = {"kernels": phase_kernels, "e2e": phase_e2e, "decode_steps": phase_decode_steps,
               "decode_roofline": phase_decode_roofline, "overhead": phase_overhead,
               "correctness": phase_correctness}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.benchmarks.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes: runs on a CPU")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-results")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {PHASES}")
    p.add_argument("--num-prompts", type=int, default=None, help="e2e requests (default 256)")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true", help="no transformers run in e2e")
    args = p.parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    unknown = set(phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}")

    import torch

    if not torch.cuda.is_available():  # kernels then run in Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from minivllm.benchmarks.common import machine_info, write_json

    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, "gpu_check.json")
    result = {"command": " ".join([os.path.basename(sys.executable), "-m",
                                   "minivllm.benchmarks.gpu_check", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "quick": args.quick, "phases": {}}
    scratch = tempfile.mkdtemp(prefix="minivllm-gpu-check-")
    ckpts = Checkpoints(scratch)
    failed = False
    try:
        for name in phases:
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                section = PHASE_FUNCS[name](args, ckpts)
            except Exception as e:  # record it and go on: later phases are independent
                traceback.print_exc()
                section = {"error": repr(e), "traceback": traceback.format_exc()}
                failed = True
            failed = failed or section.get("ok") is False
            section["wall_s"] = time.perf_counter() - start
            result["phases"][name] = section
            write_json(out_file, result)
            _free_memory()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
