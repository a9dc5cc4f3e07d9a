"""minivllm: vLLM v1's design, rebuilt step by step in readable Python."""

from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.sampling_params import SamplingParams

__version__ = "0.1.0"

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
