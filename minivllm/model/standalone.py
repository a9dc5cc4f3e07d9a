"""Run the model over one sequence, outside the engine: logits for every position.

For checking the model against transformers (tests, chapter 01) and for opening up a single
forward pass. The sequence gets its own little paged KV cache (blocks 0, 1, 2, ... in order);
``chunk_size`` feeds the prompt in chunks, exactly as chunked prefill would.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from minivllm.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend
from minivllm.config import EngineArgs
from minivllm.utils import cdiv


def single_sequence_metadata(
    start: int, end: int, block_table: list[int], block_size: int, device
) -> AttentionMetadata:
    """Metadata for computing positions [start, end) of one sequence whose blocks are given."""
    n = end - start
    pos = torch.arange(start, end)
    table = torch.tensor(block_table, dtype=torch.long)
    slots = table[pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(
        num_actual_tokens=n,
        num_decodes=1 if n == 1 else 0,
        max_query_len=n,
        max_seq_len=end,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        block_tables=table.to(torch.int32).unsqueeze(0).to(device),
        slot_mapping=slots.to(device),
        query_start_loc_cpu=np.array([0, n]),
        seq_lens_cpu=np.array([end]),
    )


@contextmanager
def own_kv_cache(model, num_blocks: int, block_size: int, backend: AttentionBackend):
    """While inside, every attention layer of ``model`` has a KV cache of its own of
    ``num_blocks`` blocks (sized by the layer's own KV heads: a tensor-parallel rank's share)
    and uses ``backend``; the layers' caches and backends are put back afterwards."""
    param = next(model.parameters())
    layers = model.attention_layers()
    saved = [(layer.kv_cache, layer.backend) for layer in layers]
    for layer in layers:
        layer.kv_cache = torch.zeros(2, num_blocks, block_size, layer.num_kv_heads,
                                     layer.head_dim, dtype=param.dtype, device=param.device)
        layer.backend = backend
    try:
        yield
    finally:
        for layer, (cache, be) in zip(layers, saved):
            layer.kv_cache, layer.backend = cache, be


@torch.inference_mode()
def sequence_logits(
    model,
    token_ids: list[int],
    chunk_size: int | None = None,
    block_size: int = EngineArgs.block_size,
    backend: str | AttentionBackend = "torch",
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of the model over one sequence (float32).

    ``backend``: a backend name, or an ``AttentionBackend`` instance (how the course's checkers
    run a learner's attention inside the real model).
    """
    device = next(model.parameters()).device
    num_blocks = cdiv(len(token_ids), block_size)
    impl = backend if isinstance(backend, AttentionBackend) else get_attention_backend(backend)
    with own_kv_cache(model, num_blocks, block_size, impl):
        chunk = chunk_size or len(token_ids)
        logits = []
        for start in range(0, len(token_ids), chunk):
            end = min(start + chunk, len(token_ids))
            meta = single_sequence_metadata(start, end, list(range(num_blocks)), block_size, device)
            meta = impl.build_metadata(meta, block_size)
            ids = torch.tensor(token_ids[start:end], device=device)
            hidden = model(ids, torch.arange(start, end, device=device), meta)
            logits.append(model.compute_logits(hidden))
        return torch.cat(logits)


@torch.inference_mode()
def greedy_generate(
    model, prompt_ids: list[int], num_tokens: int, block_size: int = EngineArgs.block_size
) -> tuple[list[int], list[float]]:
    """Greedy generation of one sequence with a KV cache (chapter 02): the prompt is computed
    once (prefill), then each step feeds only the token just chosen (decode), its keys and
    values joining the cache. Returns the ``num_tokens`` new token ids and each step's seconds.

    The cache is the model's own paged layout with the sequence's blocks 0, 1, 2, ... in order:
    one contiguous buffer for this request, reserved up front for prompt + ``num_tokens``.
    """
    import time

    device = next(model.parameters()).device
    num_blocks = cdiv(len(prompt_ids) + num_tokens, block_size)
    block_table = list(range(num_blocks))
    new_ids, seconds = [], []
    feed, start = list(prompt_ids), 0  # prefill: every prompt token
    with own_kv_cache(model, num_blocks, block_size, get_attention_backend("torch")):
        for _ in range(num_tokens):
            t0 = time.perf_counter()
            end = start + len(feed)
            meta = single_sequence_metadata(start, end, block_table, block_size, device)
            ids = torch.tensor(feed, device=device)
            hidden = model(ids, torch.arange(start, end, device=device), meta)
            next_id = int(model.compute_logits(hidden[-1:]).argmax())
            seconds.append(time.perf_counter() - t0)
            new_ids.append(next_id)
            feed, start = [next_id], end  # decode: only the token just chosen
    return new_ids, seconds
