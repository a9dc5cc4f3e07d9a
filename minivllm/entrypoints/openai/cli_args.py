"""``minivllm serve`` flags (vLLM's names and defaults). Only argparse here: ``minivllm --help``
works without the server's packages installed."""

from __future__ import annotations

import argparse
import sys

# the engine arguments a server defaults differently: it runs its engine core in its own
# process, and keeps no step trace (its memory must not grow with its uptime)
SERVER_ENGINE_DEFAULTS = {"multiprocess": True, "trace_steps": 0}


def add_serve_parser(subparsers) -> None:
    from minivllm.config import EngineArgs

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (pip install 'minivllm[serve]')",
        description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics.",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="local Hugging Face folder or hub name (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts (default: MODEL)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 endpoints")
    p.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20,
                   help="refuse a larger request body with 413, before reading it whole "
                        "(default 16 MiB)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineArgs.add_cli_args(p, defaults=SERVER_ENGINE_DEFAULTS)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    print("minivllm serve: starting (importing torch, transformers and the server)", flush=True)
    try:
        from minivllm.entrypoints.openai.api_server import run_server
    except ImportError as e:
        print(f"minivllm serve: needs the server packages ({e.name} is missing): "
              "pip install 'minivllm[serve]'", file=sys.stderr)
        return 2
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"model: given twice ({args.model_tag!r} and --model {args.model!r})")
        args.model = args.model_tag
    return run_server(args)
