"""Benchmarks behind ``minivllm bench ...``: each prints its figures and can write JSON.

Figures are measured side by side in one run (e.g. minivllm and transformers on the same
workload, same process, same machine), never compared against numbers from another day.
"""

from __future__ import annotations

import importlib

# subcommand -> module in this package that defines add_parser(subparsers, add_engine_args)
BENCHMARKS = {
    "throughput": "minivllm.benchmarks.throughput",
    "sim": "minivllm.benchmarks.sim",
    "long-prompt": "minivllm.benchmarks.long_prompt",
    "shared-prefix": "minivllm.benchmarks.shared_prefix",
    "kernels": "minivllm.benchmarks.kernels",
    "serve": "minivllm.benchmarks.serve",
    "serve-compare": "minivllm.benchmarks.serve_compare",
    "decode-roofline": "minivllm.benchmarks.decode_roofline",
    "overhead": "minivllm.benchmarks.overhead",
    "soak": "minivllm.benchmarks.soak",
    "tp": "minivllm.benchmarks.tensor_parallel",
    "vs-vllm": "minivllm.benchmarks.vs_vllm",
}


def register_benchmarks(subparsers, add_engine_args) -> None:
    for module in BENCHMARKS.values():
        importlib.import_module(module).add_parser(subparsers, add_engine_args)
