"""How long a step takes on a GPU, without a GPU: a roofline cost model.

A step reads every weight once and the K/V of every scheduled sequence (memory), and does
2 FLOPs per parameter per token plus the attention's FLOPs (compute). Whichever takes longer
bounds the step, plus a fixed per-step overhead (scheduling, launches):

    step_time = overhead + max(flops / (peak_flops * mfu), bytes / (bandwidth * mbu))

Defaults: Llama-3-8B in bf16 on one H100 SXM. The model's shape is Llama-3-8B's published one
(8.03 B parameters, 32 layers, 32 query heads and 8 KV heads of dimension 128); the hardware
figures are the H100 SXM datasheet's (3.35 TB/s HBM3, 989 TFLOP/s dense bf16), derated by
utilisation factors typical of a well-tuned engine (mfu 0.6, mbu 0.8) and a 2 ms step overhead.
Decoding one sequence then costs about 8 ms per token; the step stays memory-bound up to a
couple of hundred tokens (the ridge point) — which is why vLLM's chunks are hundreds of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostModel:
    name: str = "Llama-3-8B, bf16, 1x H100 SXM"
    num_params: float = 8.03e9
    weight_bytes: float = 16.06e9
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    peak_flops: float = 989e12
    mfu: float = 0.6
    mem_bandwidth: float = 3.35e12
    mbu: float = 0.8
    step_overhead_s: float = 0.002

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def ridge_tokens(self) -> float:
        """Tokens per step where weight-streaming time equals matmul time."""
        flops_per_s = self.peak_flops * self.mfu
        bytes_per_s = self.mem_bandwidth * self.mbu
        return self.weight_bytes / bytes_per_s * flops_per_s / (2 * self.num_params)

    def step_time(self, work: list[tuple[int, int]]) -> float:
        """``work``: (new tokens, context length after the step) per scheduled sequence."""
        if not work:
            return 0.0
        tokens = sum(n for n, _ in work)
        # attention: every new token attends to its context (causal within the new tokens)
        pairs = sum(n * (ctx - (n - 1) / 2) for n, ctx in work)
        flops = 2 * self.num_params * tokens + 4 * self.num_layers * self.num_heads * self.head_dim * pairs
        bytes_moved = self.weight_bytes + self.kv_bytes_per_token * sum(ctx for _, ctx in work)
        compute = flops / (self.peak_flops * self.mfu)
        memory = bytes_moved / (self.mem_bandwidth * self.mbu)
        return self.step_overhead_s + max(compute, memory)
