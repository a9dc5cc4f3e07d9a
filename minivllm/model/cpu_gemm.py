"""Linear layers on a CPU: oneDNN with weights packed once at load time, and panels of
minivllm's own for a decode step's few rows.

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

A decode step's few rows (up to ``few_rows_max()``) take a kernel of minivllm's own instead
(``few_rows_linear`` in ``cpu_kernels.cpp``), over a third copy of each packed weight laid out
as panels of 16 outputs, ``layer.panel_weight``: a decode step's matmuls only stream the weights
from memory once, and that kernel keeps the stream going while it computes (it prefetches
ahead), where oneDNN's waits on it. On the 2-core CPU above, one run of ``python -m
minivllm.model.cpu_gemm`` (which prints each way on any machine), ms for the bundled model's 121
weights through the panels and through oneDNN: 1 row 15.6 and 25.8, 8 rows 22.9 and 39.0, 16
rows 31.8 and 39.5, 32 rows 85.7 and 92.6, 64 rows 106.1 and 129.8, 256 rows 441.4 and 393.2
(other runs put the two even from about 48 rows). With AVX-512 the kernel takes two panels at a
time, and on a 2-core Xeon the panels were faster up to about 128 rows (64 rows 66.6-68.3 ms
against oneDNN's 81.8-84.8, 128 rows 126.3 against 128.4), so ``few_rows_max()`` is 128 there
and 32 elsewhere. The panels cost as much memory as the weights
themselves again (the bundled model: 514 MiB more resident after ``LLM()``).

``MINIVLLM_CPU_GEMM``: ``auto`` (the default: oneDNN, and the panels for few rows when
minivllm's CPU kernels build), ``onednn`` (oneDNN only, no panels) or ``torch`` (plain
``F.linear``, nothing packed). Off on other devices, for other dtypes than float32, and
without oneDNN. (``compile=True`` compiles only the elementwise ops, so it packs too.)
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import cpu_kernels

ENV = "MINIVLLM_CPU_GEMM"  # "auto" (default), "onednn" or "torch"
# a oneDNN call has a fixed cost of its own, so only weights of at least this many elements
# (1 MiB in float32) are packed: all of SmolLM2-135M's linear layers, not a tiny test model's.
# On the 2-core CPU above, 30 weights of 576 x 576 (o_proj) took 3.85 ms packed vs 4.48 ms
# through F.linear for 1 row, 4.82 vs 5.93 ms for 8 (about equal from 40 rows up), while
# 256 x 256 ones were 0.36-0.76x as fast packed below 256 rows.
PACK_MIN_NUMEL = 1 << 18
# at most this many rows go through the panels (``few_rows_linear``), more through oneDNN,
# unless the library says otherwise for this CPU (``few_rows_max``)
FEW_ROWS_MAX = 32
_few_rows_max: int | None = None


def few_rows_max() -> int:
    """The most rows the panels take, more going to oneDNN: the library's figure for the CPU it
    was built for (where its two-panel tiles run, AVX-512, 128), else ``FEW_ROWS_MAX``."""
    global _few_rows_max
    if _few_rows_max is None:
        ops = cpu_kernels.library()
        _few_rows_max = int(ops.few_rows_max()) if ops is not None else FEW_ROWS_MAX
    return _few_rows_max


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ layer.weight.T (+ bias)``, through the packed weight when the layer has one: its
    panels for a few rows, else oneDNN's copy."""
    bias = getattr(layer, "bias", None)
    packed = getattr(layer, "packed_weight", None)  # a plain nn.Linear has no slot
    if packed is None:
        return F.linear(x, layer.weight, bias)
    panels = getattr(layer, "panel_weight", None)
    if (panels is not None and x.numel() <= few_rows_max() * x.shape[-1]
            and cpu_kernels.few_rows_fit(x) and (bias is None or cpu_kernels.few_rows_fit(bias))):
        return _few_rows_linear(x, panels, bias, layer.weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def mode() -> str:
    """``MINIVLLM_CPU_GEMM``, checked: "auto", "onednn" or "torch"."""
    value = os.environ.get(ENV, "auto").lower()
    if value not in ("auto", "onednn", "torch"):
        raise ValueError(f"{ENV}={value!r}: expected auto, onednn or torch")
    return value


def should_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine packs its linear weights (see the module docstring)."""
    return (device.type == "cpu" and dtype == torch.float32 and mode() != "torch"
            and onednn_available())


@torch.no_grad()
def pack_linear_weights(model: nn.Module, min_numel: int | None = None) -> int:
    """Give every layer with a ``packed_weight`` slot and a weight of at least ``min_numel``
    elements (default ``PACK_MIN_NUMEL``) a oneDNN copy of its weight and, unless
    ``MINIVLLM_CPU_GEMM=onednn`` or the CPU kernels are unavailable, its panels (after the
    weights are loaded: a later change to ``weight`` is not seen). Returns how many."""
    min_numel = PACK_MIN_NUMEL if min_numel is None else min_numel
    ops = cpu_kernels.library() if mode() == "auto" else None
    n = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and module.weight.numel() >= min_numel:
            weight = module.weight.detach()
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            if ops is not None and cpu_kernels.few_rows_fit(weight):
                module.panel_weight = ops.pack_panels.default(weight.contiguous())
            n += 1
    return n


def unpack_linear_weights(model: nn.Module) -> None:
    """Back to plain ``F.linear`` (e.g. after changing weights in place)."""
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = None
            module.panel_weight = None


def _few_rows_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    return torch.ops.minivllm_cpu.few_rows_linear.default(x, panels, bias, out_features)


def _main() -> None:  # python -m minivllm.model.cpu_gemm: each way, this machine
    """Times a decode step's worth of linear layers of the bundled model's shapes (30 layers of
    distinct weights and the lm_head, so the weights come from memory as in the engine) each
    way, at several row counts, interleaved so that a busy moment of the machine hits all."""
    import time

    ops = cpu_kernels.library()
    layers, vocab = 30, 49152
    shapes = [(960, 576, layers), (576, 576, layers), (3072, 576, layers), (576, 1536, layers),
              (vocab, 576, 1)]
    weights = [torch.randn(n, k) for n, k, count in shapes for _ in range(count)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    panels = [ops.pack_panels(w) for w in weights] if ops is not None else None
    ways = {"F.linear": lambda x, i: F.linear(x, weights[i]),
            "oneDNN": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None,
                                                                      "none", [], "")}
    if panels is not None:
        ways["panels"] = lambda x, i: ops.few_rows_linear(x, panels[i], None,
                                                          weights[i].shape[0])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms for the "
          f"{len(weights)} weights of {shapes}")
    for rows in (1, 4, 8, 16, 32, 64, 256):
        inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(5):
            for name, fn in ways.items():
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    fn(inputs[w.shape[1]], i)
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"{rows:>4} rows: "
              + "   ".join(f"{name} {t * 1e3:7.1f}" for name, t in best.items()))


if __name__ == "__main__":
    _main()
