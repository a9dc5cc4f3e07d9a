"""Linear layers on a CPU through oneDNN, with weights packed once at load time.

``F.linear`` on a CPU is slow for the few rows of a decode step (one per running request): on
the 2-core CPU this project is developed on, the 49,152 x 576 lm_head of SmolLM2-135M took
64-80 ms for 40 rows through ``F.linear`` and 22-26 ms through oneDNN with the weight packed
once into oneDNN's own layout (two runs of ``python -m minivllm.model.cpu_gemm``, which times
both ways on the bundled model's shapes on any machine). The gain is largest at 8-40 rows and
small at 256.

vLLM's CPU backend likewise hands its layers' weights to oneDNN once, after loading. Here the
packed copy sits beside the original weight, ``layer.packed_weight``; the layers' ``forward``
calls ``linear(layer, x)``, which uses it when it is there. Small weights stay with
``F.linear`` (``PACK_MIN_NUMEL``): below that size oneDNN's fixed cost per call outweighs the
gain. The copies cost memory (the bundled model: about 480 MiB more resident, measured before
its o_proj weights were packed too; those add 38 MiB). The results equal ``F.linear``'s up to
float rounding (another summation order), so greedy outputs could in principle differ in a
near tie; the equivalence tests against transformers run with it (``tests/test_cpu_gemm.py``
packs a tiny model's every weight).

Off (plain ``F.linear``) on other devices, for other dtypes than float32, without oneDNN, or
with ``MINIVLLM_CPU_GEMM=torch`` in the environment. (``compile=True`` compiles only the
elementwise ops, so it packs too.)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ENV = "MINIVLLM_CPU_GEMM"  # "onednn" (default) or "torch"
# a oneDNN call has a fixed cost of its own, so only weights of at least this many elements
# (1 MiB in float32) are packed: all of SmolLM2-135M's linear layers, not a tiny test model's.
# On the 2-core CPU above, 30 weights of 576 x 576 (o_proj) took 3.85 ms packed vs 4.48 ms
# through F.linear for 1 row, 4.82 vs 5.93 ms for 8 (about equal from 40 rows up), while
# 256 x 256 ones were 0.36-0.76x as fast packed below 256 rows.
PACK_MIN_NUMEL = 1 << 18


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ layer.weight.T (+ bias)``, through the packed weight when the layer has one."""
    bias = getattr(layer, "bias", None)
    packed = getattr(layer, "packed_weight", None)  # a plain nn.Linear has no slot
    if packed is None:
        return F.linear(x, layer.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine packs its linear weights (see the module docstring)."""
    return (device.type == "cpu" and dtype == torch.float32
            and os.environ.get(ENV, "onednn").lower() != "torch" and onednn_available())


@torch.no_grad()
def pack_linear_weights(model: nn.Module, min_numel: int | None = None) -> int:
    """Give every layer with a ``packed_weight`` slot and a weight of at least ``min_numel``
    elements (default ``PACK_MIN_NUMEL``) a oneDNN copy of its weight (after the weights are
    loaded: a later change to ``weight`` is not seen). Returns how many."""
    min_numel = PACK_MIN_NUMEL if min_numel is None else min_numel
    n = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and module.weight.numel() >= min_numel:
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), None)
            n += 1
    return n


def unpack_linear_weights(model: nn.Module) -> None:
    """Back to plain ``F.linear`` (e.g. after changing weights in place)."""
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = None


def _main() -> None:  # python -m minivllm.model.cpu_gemm: both ways, this machine's shapes
    import time

    def best_ms(fn, reps=10):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for rows, (n, k) in [(r, s) for s in ((49152, 576), (3072, 576), (576, 1536))
                         for r in (1, 8, 40, 256)]:
        w, x = torch.randn(n, k), torch.randn(rows, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        plain = best_ms(lambda: F.linear(x, w))
        fast = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        print(f"[{rows:>3} x {k}] @ [{k} x {n:>5}]:  F.linear {plain:8.3f} ms   "
              f"packed {fast:8.3f} ms   {plain / fast:5.2f}x")


if __name__ == "__main__":
    _main()
