"""The ``minivllm`` command: generate, serve, bench.

    minivllm generate "The capital of France is"
    minivllm generate --chat "Explain a KV cache in one paragraph."
    minivllm serve                     # OpenAI-compatible server on the bundled model
    minivllm bench throughput --compare-hf

Engine flags carry vLLM's names (``--max-num-seqs``, ``--max-num-batched-tokens``, ...).
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_PROMPT = "Explain in one short paragraph what a KV cache is in a language model."


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine arguments every subcommand shares: one flag per ``EngineArgs`` field."""
    from minivllm.config import EngineArgs

    EngineArgs.add_cli_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments set on a parsed command line, as keywords for ``LLM``."""
    from minivllm.config import EngineArgs

    return {f.name: getattr(args, f.name) for f in EngineArgs.cli_fields() if hasattr(args, f.name)}


def _generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed,
    )
    prompts = args.prompts or [DEFAULT_PROMPT]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for p, out in zip(prompts, outputs):
        print(f"\n>>> {p}\n{out.outputs[0].text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minivllm", description="minivllm: vLLM v1's design, rebuilt to learn from."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text offline (LLM.generate / LLM.chat)")
    gen.add_argument("prompts", nargs="*", help="one or more prompts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    from minivllm.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print figures (and write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    from minivllm.benchmarks import register_benchmarks

    register_benchmarks(bench_sub, add_engine_args)
    return parser


def _is_torchrun_worker(args: argparse.Namespace) -> bool:
    """Ranks 1.. of a torchrun launch run no command: they serve rank 0's engine."""
    import os

    return (getattr(args, "distributed_executor_backend", None) == "external_launcher"
            and int(os.environ.get("RANK", "0")) > 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        if _is_torchrun_worker(args):
            from minivllm.config import EngineArgs
            from minivllm.executor.external_launcher import run_worker_loop

            model = getattr(args, "model_tag", None) or args.model
            return run_worker_loop(EngineArgs(**{**engine_kwargs(args), "model": model})
                                   .create_config())
        return args.func(args) or 0
    except ValueError as e:
        print(f"minivllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
