"""The attention backend interface: one model code path, many attention implementations.

The model never touches the KV cache layout itself. Each attention layer hands its new q/k/v,
its slice of the paged KV cache and the step's ``AttentionMetadata`` to a backend, which
(1) writes the new K/V into the cache at ``slot_mapping`` and (2) attends every query token to
its sequence's context, read back from the blocks in ``block_tables``.

Batch layout (vLLM v1's): the scheduled sequences' tokens are concatenated, decodes first.
Sequence i owns query tokens ``query_start_loc[i]:query_start_loc[i+1]``; its context is
``seq_lens[i]`` tokens long, of which the last ``query_len`` are the new ones (so the first
``seq_lens[i] - query_len`` were computed in earlier steps or came from the prefix cache).

KV cache tensor of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K at index 0, V at 1). Token at position p of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its *slot* is
``block_id * block_size + offset``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # real tokens in the batch (CUDA graphs may pad beyond it)
    num_decodes: int  # sequences with a single query token; they come first
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_seqs] int32, on the device
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 marks a padding token (not written)
    # host copies (numpy), for backends that plan their work on the host once per step
    query_start_loc_cpu: np.ndarray | None = None
    seq_lens_cpu: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes


class AttentionBackend(ABC):
    """Implement ``forward``; ``name`` is what ``LLM(attention_backend=...)`` selects.

    ``supports_cuda_graph``: True if ``forward`` never syncs with the host and sizes its work
    only from the metadata's Python ints, so the model runner may capture decode steps in CUDA
    graphs (replayed later with new tensor contents).
    """

    name: str = "abstract"
    supports_cuda_graph: bool = False

    def build_metadata(self, metadata: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """Called once per step, before the layers run: a backend may plan its work here (on
        the host, from the numpy copies) so that ``forward``, called once per layer, does not
        repeat it. The default plans nothing."""
        return metadata

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    """The one place that maps a backend name to its implementation."""
    if name == "torch":
        from minivllm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from minivllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be 'torch' or 'triton', got {name!r}")
