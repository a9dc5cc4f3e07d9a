"""Graders for chapter 03 (the paged KV cache): slot mapping and attention over blocks, on random
shuffled, padded block tables, then inside the check engine, whose greedy output must not change."""

from __future__ import annotations

from itertools import product

import numpy as np
import torch

from minivllm.attention.torch_backend import paged_decode_attention
from minivllm.course.checks.common import (
    ENGINE_PROMPTS, Exercise, check_engine, close, compare_generations, decodes_through,
    greedy_token_ids, native_answer, reference_token_ids,
)
from minivllm.course.checks.model import ATTENTION_OPS, TORCH_ATTENTION, gqa_mistakes
from minivllm.worker.block_table import compute_slot_mapping as reference_slot_mapping

SLOT_ANSWER = ("minivllm.worker.block_table:compute_slot_mapping",
               "minivllm.worker.block_table:BlockTable")
SLOT_CONVENTION = ("Expected: the token at position p lives in block block_table[p // block_size] "
                   "at offset p % block_size, so its slot is block_id * block_size + offset.")
PAGED_CONVENTION = ("Expected: the attention of one query q [heads, d] over the sequence's first "
                    "seq_len tokens, whose keys and values lie in the blocks block_table[0], "
                    "block_table[1], ... of kv_cache [2 (K, V), num_blocks, block_size, kv_heads, "
                    "d]; softmax(q k^T * scale) v, query head h using KV head h // (heads // "
                    "kv_heads).")


def check_slot_mapping(compute_slot_mapping, exercise: str = "3.1", seed: int = 0) -> None:
    """``compute_slot_mapping(block_table, positions, block_size) -> slots`` (one per position)."""
    ex = Exercise(exercise, SLOT_CONVENTION, SLOT_ANSWER, "numpy")
    compute_slot_mapping = ex.take(compute_slot_mapping, "compute_slot_mapping")
    rng, cases = np.random.default_rng(seed), 0
    for block_size, num_blocks in product((1, 2, 5, 16), (1, 3, 8)):
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
                ex.fail(f"expected a list (or array) of ints, got {type(got).__name__}")
            if got != expected:
                ex.fail(f"block_table={block_table}, block_size={block_size}, positions {start}.."
                        f"{start + num_tokens - 1}: expected slots {expected}, got {got}.")
            cases += 1
    _in_engine(ex, "compute_slot_mapping", slot_mapping=compute_slot_mapping)
    ex.passed(f"compute_slot_mapping matches the reference on {cases} random block tables, and "
              "the engine using it generates the reference text.")


def check_paged_attention(paged_attention, exercise: str = "3.2", seed: int = 0) -> None:
    """``paged_attention(q, kv_cache, block_table, seq_len, scale) -> [heads, d]``."""
    ex = Exercise(exercise, PAGED_CONVENTION, native_answer(TORCH_ATTENTION, *ATTENTION_OPS),
                  "torch")
    paged_attention = ex.take(paged_attention, "paged_attention")
    g, cases = torch.Generator().manual_seed(seed), 0
    for (heads, kv_heads, d), block_size in product(
            ((4, 4, 16), (9, 3, 64), (8, 2, 32), (6, 1, 8)), (1, 4, 16)):
        for seq_len in sorted({1, block_size, block_size + 1, 37}):
            cache = torch.randn(2, 48, block_size, kv_heads, d, generator=g)
            used = -(-seq_len // block_size)
            table = torch.randperm(48, generator=g)[: used + 2]  # 2 padding entries
            # slots past seq_len hold another request's values: reading them must show
            cache[1, table[used - 1], seq_len - (used - 1) * block_size:] += 25.0
            cache[1, table[used:]] += 25.0
            q, scale = torch.randn(heads, d, generator=g), d ** -0.5

            def attend(n):  # the reference over the first n tokens
                return paged_decode_attention(q[None], cache, table[None].to(torch.int32),
                                              torch.tensor([n]), scale)[0]
            got = paged_attention(q.clone(), cache.clone(), table.clone(), seq_len, scale)
            too_far = [n for n in (used * block_size, len(table) * block_size) if n != seq_len]
            pos = torch.arange(seq_len)
            k, v = (cache[i, table[pos // block_size], pos % block_size] for i in (0, 1))
            mistakes = [(lambda y: any(close(y, attend(n)) for n in too_far),
                         "you attended to every slot of the blocks you read; only the first "
                         "seq_len tokens are the sequence's (the rest of its last block, and any "
                         "entries of block_table past it, hold other data).")]
            mistakes += [(lambda y, test=test: test(y[None]), text)
                         for test, text in gqa_mistakes(q[None], k, v, scale, causal=False)]
            ex.compare_tensors(f"paged_attention({heads} query heads over {kv_heads} KV heads, "
                               f"d={d}, block_size={block_size}, seq_len={seq_len}, block_table="
                               f"{table.tolist()})", got, attend(seq_len), 1e-4, 1e-4,
                               mistakes=mistakes)
            cases += 1
    _in_engine(ex, "paged_attention", attention=paged_attention)
    ex.passed(f"paged_attention matches the reference on {cases} random block tables, and the "
              "engine decoding with it generates the reference text.")


def _in_engine(ex: Exercise, what: str, slot_mapping=None, attention=None) -> None:
    """The check engine's greedy tokens with the learner's slot mapping or decode attention."""
    llm, expected = check_engine(), reference_token_ids()

    def decode(q, kv_cache, meta, scale):
        out = torch.empty_like(q)
        for i in range(len(q)):
            out[i] = attention(q[i], kv_cache, meta.block_tables[i].long(),
                               meta.seq_lens_cpu[i], scale)
        return out

    with decodes_through(llm, decode if attention is not None else None) as runner:
        prepare, table = runner.prepare_inputs, runner.input_batch.block_table

        def prepare_inputs(scheduler_output):  # each request's slots recomputed by the learner's
            input_ids, positions, meta, sample_rows, cu = prepare(scheduler_output)
            qsl = meta.query_start_loc_cpu
            for row in range(len(qsl) - 1):
                a, b = int(qsl[row]), int(qsl[row + 1])
                blocks = table.block_table_np[row, : table.num_blocks_per_row[row]].tolist()
                slots = slot_mapping(blocks, positions[a:b].cpu().numpy(), runner.block_size)
                meta.slot_mapping[a:b] = torch.as_tensor(np.asarray(slots, dtype=np.int64))
            return input_ids, positions, meta, sample_rows, cu
        try:
            if slot_mapping is not None:
                runner.prepare_inputs = prepare_inputs
            got = greedy_token_ids(llm, ENGINE_PROMPTS)
        finally:
            runner.__dict__.pop("prepare_inputs", None)
    compare_generations(ex.number, f"with your {what}", llm, ENGINE_PROMPTS, got, expected)
