"""minivllm: vLLM v1's design, rebuilt step by step in readable Python.

The public names below resolve on first use (as vLLM's ``__init__`` does), so importing a
part of the package — ``minivllm.core`` for the scheduler, ``minivllm.sim`` for the simulator —
does not load torch, the model runner or the server's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "LLM": "minivllm.entrypoints.llm",
    "LLMEngine": "minivllm.engine.llm_engine",
    "EngineArgs": "minivllm.config",
    "SamplingParams": "minivllm.sampling_params",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "RequestMetrics": "minivllm.outputs",
}

__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.llm import LLM
    from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from minivllm.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # next time, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
