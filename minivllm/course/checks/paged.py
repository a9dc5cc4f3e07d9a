"""Checkers for chapter 03 (the paged KV cache): slot mapping, attention over blocks.

Both components are compared with the package's reference on random block tables (shuffled,
non-contiguous, padded), then run inside the real engine (on the check model, ``common.check_model_path``) — small
blocks, chunked prefill, a shared prefix — whose greedy output must not change.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.attention.torch_backend import paged_decode_attention
from minivllm.course.checks.common import (
    ENGINE_PROMPTS, Exercise, check_engine, close, compare_generations, compare_tensors,
    decodes_through, fail, greedy_token_ids, passed,
)
from minivllm.course.checks.model import gqa_hint
from minivllm.worker.block_table import compute_slot_mapping as reference_slot_mapping

SLOT_ANSWER = ("minivllm.worker.block_table:compute_slot_mapping",
               "minivllm.worker.block_table:BlockTable")
PAGED_ANSWER = tuple(f"minivllm.attention.torch_backend:{name}" for name in (
    "paged_decode_attention", "paged_prefill_attention", "attend_group", "attend_decodes_by_rows",
    "gather_context", "gather_blocks", "TorchAttentionBackend"))
SLOT_CONVENTION = ("Expected: the token at position p lives in block block_table[p // block_size] "
                   "at offset p % block_size, so its slot is block_id * block_size + offset.")


# -- Exercise 3.1: slot mapping ------------------------------------------------------------------

def check_slot_mapping(compute_slot_mapping, exercise: str = "3.1", seed: int = 0) -> None:
    """``compute_slot_mapping(block_table, positions, block_size) -> slots`` (one per position)."""
    compute_slot_mapping = Exercise(exercise, answer=SLOT_ANSWER, allowed="numpy").take(
        compute_slot_mapping, "compute_slot_mapping")
    rng = np.random.default_rng(seed)
    cases = 0
    for block_size in (1, 2, 5, 16):
        for num_blocks in (1, 3, 8):
            capacity = num_blocks * block_size
            block_table = rng.permutation(64)[:num_blocks].tolist()  # any free blocks, any order
            for num_tokens in sorted({1, min(capacity, 3), capacity}):
                start = int(rng.integers(0, capacity - num_tokens + 1))
                positions = np.arange(start, start + num_tokens)
                expected = reference_slot_mapping(block_table, positions, block_size).tolist()
                got = compute_slot_mapping(list(block_table), positions.copy(), block_size)
                try:
                    got = [int(s) for s in np.asarray(got).reshape(-1)]
                except (TypeError, ValueError):
                    fail(exercise, f"expected a list (or array) of ints, got {type(got).__name__}")
                if got != expected:
                    fail(exercise, f"block_table={block_table}, block_size={block_size}, positions "
                                   f"{start}..{start + num_tokens - 1}: expected slots {expected}, got "
                                   f"{got}. {SLOT_CONVENTION}")
                cases += 1
    _check_in_engine(exercise, "compute_slot_mapping", slot_mapping=compute_slot_mapping)
    passed(exercise, f"compute_slot_mapping matches the reference on {cases} random block tables, and "
                     "the engine using it generates the reference text.")


# -- Exercise 3.2: attention over blocks ---------------------------------------------------------

PAGED_CONVENTION = ("Expected: the attention of one query q [heads, d] over the sequence's first "
                    "seq_len tokens, whose keys and values lie in the blocks block_table[0], "
                    "block_table[1], ... of kv_cache [2 (K, V), num_blocks, block_size, kv_heads, d]; "
                    "softmax(q k^T * scale) v, query head h using KV head h // (heads // kv_heads).")


def check_paged_attention(paged_attention, exercise: str = "3.2", seed: int = 0) -> None:
    """``paged_attention(q, kv_cache, block_table, seq_len, scale) -> [heads, d]``."""
    paged_attention = Exercise(exercise, answer=PAGED_ANSWER, allowed="torch").take(
        paged_attention, "paged_attention")
    g = torch.Generator().manual_seed(seed)
    cases = 0
    for heads, kv_heads, d in ((4, 4, 16), (9, 3, 64), (8, 2, 32), (6, 1, 8)):
        for block_size in (1, 4, 16):
            for seq_len in sorted({1, block_size, block_size + 1, 37}):
                num_blocks = 48
                cache = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=g)
                used = -(-seq_len // block_size)
                table = torch.randperm(num_blocks, generator=g)[: used + 2]  # 2 padding entries
                # slots past seq_len hold another request's values: reading them must show
                cache[1, table[used - 1], seq_len - (used - 1) * block_size:] += 25.0
                cache[1, table[used:]] += 25.0
                q = torch.randn(heads, d, generator=g)
                scale = d**-0.5
                expected = paged_decode_attention(
                    q[None], cache, table[None].to(torch.int32), torch.tensor([seq_len]), scale)[0]
                got = paged_attention(q.clone(), cache.clone(), table.clone(), seq_len, scale)
                what = (f"paged_attention({heads} query heads over {kv_heads} KV heads, d={d}, "
                        f"block_size={block_size}, seq_len={seq_len}, block_table={table.tolist()})")
                compare_tensors(exercise, what, got, expected, 1e-4, 1e-4, PAGED_CONVENTION,
                                _paged_hint(got, q, cache, table, seq_len, block_size, scale))
                cases += 1
    _check_in_engine(exercise, "paged_attention", attention=paged_attention)
    passed(exercise, f"paged_attention matches the reference on {cases} random block tables, and the "
                     "engine decoding with it generates the reference text.")


def _paged_hint(got, q, cache, table, seq_len, block_size, scale) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != q.shape:
        return None
    used = -(-seq_len // block_size)
    for blocks in (used, len(table)):
        too_far = paged_decode_attention(q[None], cache, table[None].to(torch.int32),
                                         torch.tensor([blocks * block_size]), scale)[0]
        if blocks * block_size != seq_len and close(got, too_far):
            return ("you attended to every slot of the blocks you read; only the first seq_len "
                    "tokens are the sequence's (the rest of its last block, and any entries of "
                    "block_table past it, hold other data).")
    pos = torch.arange(seq_len)
    k = cache[0, table[pos // block_size], pos % block_size]  # [seq_len, kv_heads, d]
    v = cache[1, table[pos // block_size], pos % block_size]
    return gqa_hint(got[None], q[None], k, v, scale, causal=False) if q.shape[0] != k.shape[1] else None


def _check_in_engine(exercise: str, what: str, slot_mapping=None, attention=None) -> None:
    llm = check_engine()
    expected = greedy_token_ids(llm, ENGINE_PROMPTS)

    def decode(q, kv_cache, meta, scale):
        out = torch.empty_like(q)
        for i in range(len(q)):
            out[i] = attention(q[i], kv_cache, meta.block_tables[i].long(), meta.seq_lens_cpu[i],
                               scale)
        return out

    with decodes_through(llm, decode if attention is not None else None) as runner:
        try:
            if slot_mapping is not None:
                runner.prepare_inputs = _with_slot_mapping(runner, slot_mapping)
            got = greedy_token_ids(llm, ENGINE_PROMPTS)
        finally:
            runner.__dict__.pop("prepare_inputs", None)
    compare_generations(exercise, f"with your {what}", llm, ENGINE_PROMPTS, got, expected)


def _with_slot_mapping(runner, compute_slot_mapping):
    """The runner's input preparation, with each request's slots recomputed by
    ``compute_slot_mapping(block_table, positions, block_size)`` before the forward uses them."""
    prepare = runner.prepare_inputs
    table = runner.input_batch.block_table

    def prepare_inputs(scheduler_output):
        input_ids, positions, meta, sample_rows, cu = prepare(scheduler_output)
        qsl = meta.query_start_loc_cpu
        for row in range(len(qsl) - 1):
            a, b = int(qsl[row]), int(qsl[row + 1])
            blocks = table.block_table_np[row, : table.num_blocks_per_row[row]].tolist()
            slots = compute_slot_mapping(blocks, positions[a:b].cpu().numpy(), runner.block_size)
            meta.slot_mapping[a:b] = torch.as_tensor(np.asarray(slots, dtype=np.int64))
        return input_ids, positions, meta, sample_rows, cu

    return prepare_inputs
