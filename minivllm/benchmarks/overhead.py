"""``minivllm bench overhead``: the host's share of a decode step, part by part.

A 2-layer model with a 512-token vocabulary does about a millisecond of arithmetic per decode
step even at batch 256, so what a step costs beyond that is the engine's own work around the
forward pass. The step is timed in the parts vLLM's engine has (each instrumented in place on
the running engine, so the same script measures any version of it):

* schedule            — ``Scheduler.schedule()``;
* prepare inputs      — the model runner's work outside the model: applying the scheduler's
                        output, building inputs and metadata, reading back the sampled tokens;
* forward             — the model's forward pass (embedding to final norm);
* sample              — the lm_head and the sampler;
* update              — ``Scheduler.update_from_output()`` (appending tokens, stop checks);
* output processing   — the front end's detokenization and ``RequestOutput`` building.

Batches of 1, 64 and 256 requests (``--batch-sizes``) decode together; every part is averaged
over ``--steps`` pure decode steps after a warm-up. Each request's outputs are of
``--output-kind`` (default ``delta``: what ``minivllm serve`` streams; ``final_only`` is what
``LLM.generate`` and a non-streaming response use, ``cumulative`` the engine's step API).

The same run times a fixed pure-Python loop and a small torch op (``host_speed``) and prints
them first: this machine's host speed drifts by more than an engine change moves a step, so two
runs' figures compare only next to those.
"""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict

from minivllm.benchmarks.common import host_speed, machine_info, write_json
from minivllm.entrypoints.openai.cli_args import SERVER_ENGINE_DEFAULTS
from minivllm.testing import engine_core

PARTS = ("schedule", "prepare_inputs", "forward", "sample", "update", "output_processing")
OVERHEAD_MODEL = dict(model_type="llama", hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True)


def add_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("overhead", help="host time per decode step, part by part")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-kind", choices=["delta", "cumulative", "final_only"],
                   default="delta", help="what each step's outputs carry (default: delta, "
                   "what the server streams)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    add_engine_args(p)
    p.set_defaults(func=main)


class StepClock:
    """Accumulates wall time per part by wrapping methods of the running engine's objects."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj, method: str, part: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(obj, method, timed)

    def reset(self) -> None:
        self.seconds.clear()


def instrument(llm) -> StepClock:
    """Wrap the engine's parts (an in-process engine: ``multiprocess=False``)."""
    engine = llm.llm_engine
    core = engine_core(llm)
    runner = core.model_runner
    clock = StepClock()
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "update")
    clock.wrap(runner, "execute_model", "execute_model")
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(runner.model, "compute_logits", "sample")
    clock.wrap(runner.sampler, "forward", "sample")
    clock.wrap(engine.output_processor, "process_outputs", "output_processing")
    clock.wrap(engine, "step", "step")
    return clock


def measure_batch(llm, clock: StepClock, batch: int, steps: int, warmup: int,
                  prompt_len: int, seed: int, output_kind: str = "delta") -> dict:
    import random

    from minivllm import SamplingParams
    from minivllm.outputs import RequestOutputKind

    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.config.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 4, ignore_eos=True,
                            output_kind=RequestOutputKind[output_kind.upper()])
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(warmup):  # prefills, then a few decodes
        engine.step()
    stats = engine.get_stats()
    if stats["num_running"] != batch or stats["num_waiting"]:
        raise RuntimeError(f"expected {batch} requests decoding, got {stats}: raise "
                           "--max-num-batched-tokens or --warmup-steps")
    clock.reset()
    for _ in range(steps):
        engine.step()
    s = clock.seconds
    per_step = {part: s[part] / steps for part in ("schedule", "update", "output_processing",
                                                    "forward", "sample")}
    per_step["prepare_inputs"] = (s["execute_model"] - s["forward"] - s["sample"]) / steps
    per_step["step"] = s["step"] / steps
    per_step["other"] = per_step["step"] - sum(per_step[p] for p in PARTS)
    engine.abort_request([f"b{batch}-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    return {k: v * 1e3 for k, v in per_step.items()}  # milliseconds


def main(args) -> int:
    from minivllm import LLM
    from minivllm.entrypoints.cli import engine_kwargs
    from minivllm.model_hub import bundled_model_path
    from minivllm.testing import make_checkpoint

    kwargs = engine_kwargs(args)
    folder = None
    if kwargs.get("model") is None:
        folder = tempfile.mkdtemp(prefix="minivllm-overhead-")
        try:  # the bundled model's tokenizer, so output processing detokenizes for real
            tokenizer = bundled_model_path()
        except Exception as e:  # e.g. a GPU machine without the bundled model's packages
            print(f"no tokenizer ({e}): measuring without detokenization")
            tokenizer, kwargs["skip_tokenizer_init"] = None, True
        kwargs["model"] = make_checkpoint(folder, OVERHEAD_MODEL, tokenizer_from=tokenizer)
    biggest = max(args.batch_sizes)
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 0, biggest)
    kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or 0,
                                           biggest * args.prompt_len)
    kwargs.setdefault("max_model_len", 1024)
    kwargs["trace_steps"] = SERVER_ENGINE_DEFAULTS["trace_steps"]  # what a server runs with
    llm = LLM(show_progress=False, **kwargs)
    clock = instrument(llm)
    result = {"benchmark": "overhead", "machine": machine_info(),
              "model": "2-layer llama, hidden 64, vocab 512 (random weights)" if folder
              else kwargs["model"], "steps": args.steps, "output_kind": args.output_kind,
              "by_batch": {}}
    speed = host_speed()
    result["host_speed"] = speed
    print(f"outputs: {args.output_kind}; this machine now: {speed['python_ms']:.2f} ms for the "
          f"reference Python loop, {speed['torch_op_us']:.2f} us per small torch op")
    print(f"{'batch':>6} {'step':>8} " + " ".join(f"{p:>17}" for p in PARTS) + "   (ms per step)")
    for batch in args.batch_sizes:
        r = measure_batch(llm, clock, batch, args.steps, args.warmup_steps, args.prompt_len,
                          args.seed, args.output_kind)
        result["by_batch"][str(batch)] = r
        print(f"{batch:>6} {r['step']:8.2f} " + " ".join(f"{r[p]:17.2f}" for p in PARTS),
              flush=True)
    write_json(args.json, result)
    return 0
