"""The Triton attention backend: the whole step — decodes and prefill chunks — in Triton kernels.

Per layer and step, three launches at most (``minivllm.kernels``):

1. ``reshape_and_cache`` writes every new token's K/V into its slot (padding slots -1 skipped);
2. ``paged_decode_attention`` serves the leading single-token queries (the runner puts decodes
   first), split across the context (flash-decoding);
3. ``paged_prefill_attention`` serves the prefill chunks that follow, reading earlier context —
   a cached prefix or earlier chunks — from the blocks.

Nothing here reads a tensor back to the host or loops over sequences in Python: only the
metadata's Python ints (``num_decodes``, ``num_actual_tokens``, ``max_query_len``,
``max_seq_len``) size the grids. That is what lets a decode step be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.kernels import HAS_TRITON

if not HAS_TRITON:
    raise ImportError(
        "attention_backend='triton' needs the triton package, which is not installed "
        "(Triton ships Linux wheels only: `pip install triton` on Linux). "
        "Use attention_backend='torch', which serves every model in plain torch."
    )

from minivllm.kernels.decode_attention import paged_decode_attention  # noqa: E402
from minivllm.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from minivllm.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None):
        reshape_and_cache(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            paged_decode_attention(
                q[:nd], kv_cache, metadata.block_tables[:nd], metadata.seq_lens[:nd], scale,
                max_seq_len=metadata.max_seq_len, out=out[:nd], sliding_window=sliding_window,
            )
        if metadata.num_prefills:
            end = metadata.num_actual_tokens
            # decodes hold one token each, so the prefill chunks start at token nd
            paged_prefill_attention(
                q[nd:end], kv_cache, metadata.query_start_loc[nd:] - nd, metadata.seq_lens[nd:],
                metadata.block_tables[nd:], scale, max_query_len=metadata.max_query_len,
                out=out[nd:end], sliding_window=sliding_window,
            )
        return out
