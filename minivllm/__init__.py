"""minivllm: vLLM v1's design, rebuilt step by step in readable Python.

The public names are imported on first use, so ``import minivllm`` (and the ``minivllm``
command's first line of output) does not wait for torch and transformers to load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_PUBLIC = {
    "EngineArgs": "minivllm.config",
    "LLMEngine": "minivllm.engine.llm_engine",
    "LLM": "minivllm.entrypoints.llm",
    "CompletionOutput": "minivllm.outputs",
    "RequestMetrics": "minivllm.outputs",
    "RequestOutput": "minivllm.outputs",
    "SamplingParams": "minivllm.sampling_params",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "__version__",
]

if TYPE_CHECKING:
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.llm import LLM
    from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from minivllm.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
