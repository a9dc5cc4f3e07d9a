"""Run the model over one sequence, outside the engine: logits for every position.

For checking the model against transformers (tests, chapter 01) and for opening up a single
forward pass. The sequence gets its own little paged KV cache (blocks 0, 1, 2, ... in order);
``chunk_size`` feeds the prompt in chunks, exactly as chunked prefill would.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend
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


@torch.inference_mode()
def sequence_logits(
    model,
    token_ids: list[int],
    chunk_size: int | None = None,
    block_size: int = 16,
    backend: str | AttentionBackend = "torch",
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of the model over one sequence (float32).

    ``backend``: a backend name, or an ``AttentionBackend`` instance (how the course's checkers
    run a learner's attention inside the real model).
    """
    config = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    num_blocks = cdiv(len(token_ids), block_size)
    impl = backend if isinstance(backend, AttentionBackend) else get_attention_backend(backend)
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    saved = [(layer.kv_cache, layer.backend) for layer in model.attention_layers()]
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.backend = impl
    try:
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
    finally:
        for layer, (cache, be) in zip(model.attention_layers(), saved):
            layer.kv_cache, layer.backend = cache, be


@torch.inference_mode()
def greedy_generate(
    model, prompt_ids: list[int], num_tokens: int, block_size: int = 16
) -> tuple[list[int], list[float]]:
    """Greedy generation of one sequence with a KV cache (chapter 02): the prompt is computed
    once (prefill), then each step feeds only the token just chosen (decode), its keys and
    values joining the cache. Returns the ``num_tokens`` new token ids and each step's seconds.

    The cache is the model's own paged layout with the sequence's blocks 0, 1, 2, ... in order:
    one contiguous buffer for this request, reserved up front for prompt + ``num_tokens``.
    """
    import time

    config = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    num_blocks = cdiv(len(prompt_ids) + num_tokens, block_size)
    block_table = list(range(num_blocks))
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    saved = [(layer.kv_cache, layer.backend) for layer in model.attention_layers()]
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.backend = get_attention_backend("torch")
    new_ids, seconds = [], []
    feed, start = list(prompt_ids), 0  # prefill: every prompt token
    try:
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
    finally:
        for layer, (cache, be) in zip(model.attention_layers(), saved):
            layer.kv_cache, layer.backend = cache, be
    return new_ids, seconds
