"""Triton kernels, each beside the plain-torch reference it is tested against.

Imported as ``minivllm.kernels``. Every module here pairs a Triton kernel with a plain-torch
reference of the same signature that the tests compare it to; the references live where the
engine uses them (``minivllm.attention.torch_backend`` and ``minivllm.model.layers``), and each
module's docstring names its own. The kernels import nothing from the rest of the package:

| module                 | kernel                     | what it does                                   |
|------------------------|----------------------------|------------------------------------------------|
| ``reshape_and_cache``  | ``reshape_and_cache``      | write new K/V into the paged cache by slot     |
| ``decode_attention``   | ``paged_decode_attention`` | one query per sequence, context split across   |
|                        |                            | programs (flash-decoding), then a reduce       |
| ``prefill_attention``  | ``paged_prefill_attention``| variable-length chunks, causal among the new   |
|                        |                            | tokens, earlier context read from the blocks   |
| ``rms_norm``           | ``rms_norm``               | RMSNorm, optionally fused with the residual add|
| ``rotary_embedding``   | ``rotary_embedding``       | RoPE (neox layout) from a cos/sin table        |
| ``activation``         | ``silu_and_mul``           | SwiGLU's silu(gate) * up                       |

``attention_tile`` holds what both attention kernels do for each tile of context: the paged read
of its K/V and the online-softmax update (Triton inlines them).

Importing this package never needs triton (Triton ships Linux wheels only): ``HAS_TRITON`` says
whether the kernels can run, ``triton_unavailable_reason`` says why not. The kernel modules
themselves import triton.

Without a GPU the kernels still run, slowly and exactly, in Triton's interpreter: set
``TRITON_INTERPRET=1`` before triton is first imported (the test configuration does).
"""

from __future__ import annotations

import importlib.util
import os


def _give_the_name_kernels_back() -> None:
    """This folder is ``minivllm.kernels``. Python started in the repository root (``python -m
    pytest``, a REPL) has the root on ``sys.path``, and there this folder would answer to
    ``import kernels``, hiding the PyPI package of that name, which transformers imports (from
    5.x on, a dependency of it). Imported under that name, hand it to the installed package, or
    be absent as it is."""
    import importlib.machinery
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels' (the repository's kernels/ folder "
                                  "is minivllm.kernels)", name="kernels")
    real = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = real  # what the import statement returns
    spec.loader.exec_module(real)


if __name__ == "kernels":
    _give_the_name_kernels_back()

HAS_TRITON = importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device_type: str) -> str | None:
    """None if Triton kernels can run on ``device_type`` ("cuda" or "cpu"), else what is missing."""
    if not HAS_TRITON:
        return ("the triton package is not installed (Triton ships Linux wheels only: "
                "`pip install triton` on Linux); use attention_backend='torch' and "
                "custom_ops='none', which serve everything in plain torch")
    if device_type != "cuda" and not interpreter_enabled():
        return ("Triton kernels run on a CUDA device, or on the CPU only in Triton's interpreter "
                "(set TRITON_INTERPRET=1 before triton is imported; slow, meant for tests); "
                "on a CPU use attention_backend='torch' and custom_ops='none'")
    return None


def triton_elementwise_ops() -> dict:
    """The fused elementwise kernels, keyed like ``minivllm.model.layers.NATIVE_OPS``."""
    from minivllm.kernels.activation import silu_and_mul
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.rotary_embedding import rotary_embedding

    return {"rms_norm": rms_norm, "rotary_embedding": rotary_embedding,
            "silu_and_mul": silu_and_mul}
