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
    """The engine arguments every subcommand shares, named as vLLM names them."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder or hub name (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="token ids in, token ids out (no tokenizer is loaded)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--scheduler", default="v1", choices=["v1", "v0"])
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--compile", action="store_true", help="torch.compile the model's elementwise parts")
    g.add_argument("--custom-ops", default="auto", choices=["auto", "all", "none"],
                   help="fused Triton kernels for RMSNorm, rotary, SiLU-and-mul (auto: with the "
                        "Triton attention backend, unless --compile)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    from minivllm.config import EngineArgs

    names = EngineArgs.field_names()
    return {k: v for k, v in vars(args).items() if k in names}


def resolve_model_folder(args: argparse.Namespace, command: str) -> str:
    """Find (on first use: convert) the model's folder and say where it is, on every start,
    so a user can point transformers or other tools at it."""
    from minivllm.model_hub import BUNDLED_NAME, resolve_model

    folder = resolve_model(args.model, revision=getattr(args, "revision", None))
    print(f"minivllm {command}: model {args.model or BUNDLED_NAME} in {folder}", flush=True)
    args.model = folder
    return folder


def _generate(args: argparse.Namespace) -> int:
    print("minivllm generate: starting (importing torch and transformers)", flush=True)
    from minivllm import LLM, SamplingParams

    resolve_model_folder(args, "generate")
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

    add_serve_parser(sub, add_engine_args)

    bench = sub.add_parser("bench", help="benchmarks that print figures (and write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    from minivllm.benchmarks import register_benchmarks

    register_benchmarks(bench_sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"minivllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
