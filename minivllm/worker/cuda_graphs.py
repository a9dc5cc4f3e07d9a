"""CUDA graphs for decode steps: record a step's kernel launches once, replay them every step.

A decode step of a small model is hundreds of tiny kernel launches; at small batch the GPU
waits on the CPU that issues them. A CUDA graph records the launches of one forward pass
(pointers and grid sizes baked in) and replays them with a single call. Three things follow:

* **fixed shapes**: one graph per batch size in ``cudagraph_batch_sizes`` (1, 2, 4, 8, then
  steps of 8 up to ``max_num_seqs``, at most 512). A batch of n decodes runs the graph of the
  next size up, padded: padding tokens have slot -1 (their K/V are not written) and a one-token
  context, and their outputs are dropped. Batches with a prefill chunk, or larger than the
  largest size, run eagerly.
* **fixed addresses**: inputs live in the model runner's step buffers, which ``prepare_inputs``
  writes every step (nothing is copied a second time); the output is the tensor the captured
  forward returned, overwritten by every replay.
* **no host sync, no data-dependent grid**: the attention backend must size its kernels from
  Python ints only (``AttentionBackend.supports_cuda_graph``); the decode kernel's grid is sized
  for ``max_model_len``, and each program reads its sequence's true length on the device.

``DecodeCudaGraphs(capture=False)`` keeps the buffers and the padding but runs the padded batch
eagerly: that is how the CPU tests check the padding without a GPU.
"""

from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionMetadata

MAX_CAPTURE_SIZE = 512


def cudagraph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... : the sizes to capture, the last one >= min(max_num_seqs, 512)."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    candidates = [1, 2, 4] + list(range(8, MAX_CAPTURE_SIZE + 1, 8))
    sizes = [s for s in candidates if s < cap]
    return sizes + [next(s for s in candidates if s >= cap)]


class DecodeCudaGraphs:
    """Decode-step graphs over the model runner's own step buffers (no second copy of the
    inputs: ``prepare_inputs`` writes the buffers every captured graph reads)."""

    def __init__(self, model, max_num_seqs: int, max_model_len: int, *, input_ids, positions,
                 slot_mapping, seq_lens, query_start_loc, block_tables,
                 capture: bool = True) -> None:
        self.model = model
        self.sizes = cudagraph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.capture_enabled = capture
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        self.seq_lens, self.query_start_loc, self.block_tables = seq_lens, query_start_loc, block_tables
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Only pure decode batches (one token per sequence) up to the largest captured size."""
        return meta.num_decodes == meta.num_seqs and self.padded_size(meta.num_seqs) is not None

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=size, num_decodes=size, max_query_len=1,
            max_seq_len=self.max_model_len,  # sizes the decode grid for any context length
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.metadata(size))

    def _pad(self, n: int, size: int) -> None:
        """Rows n..size-1 of the buffers become harmless padding: no K/V written (slot -1), a
        one-token context, token 0 at position 0."""
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.input_ids[n:size].fill_(0)
        self.positions[n:size].fill_(0)
        self.query_start_loc[n + 1 : size + 1].copy_(
            torch.arange(n + 1, size + 1, dtype=self.query_start_loc.dtype,
                         device=self.query_start_loc.device))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first (smaller ones reuse its memory pool)."""
        if not self.capture_enabled:
            return
        self._pad(0, self.sizes[-1])
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, torch.compile traces, caches fill
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Pad the step (already in the buffers: ``input_ids`` and ``positions`` are views of
        them) up to a captured size, replay; hidden states of the real rows."""
        n = meta.num_seqs
        size = self.padded_size(n)
        self._pad(n, size)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
