"""Read-only views into a running engine, for chapters that open it up.

The engine core runs in the notebook's process (``LLM(...)`` without ``multiprocess=True``), so
its scheduler, KV cache manager and model runner can be looked at directly between steps.
"""

from __future__ import annotations


def engine_core(llm):
    """The ``EngineCore`` behind an ``LLM`` (in-process engines only)."""
    client = llm.llm_engine.engine_core
    if not hasattr(client, "engine_core"):
        raise ValueError(
            "the engine core runs in another process: create the LLM with multiprocess=False")
    return client.engine_core


def block_tables(llm) -> dict[str, list[int]]:
    """request id -> the ids of the KV blocks it holds, in order (its block table)."""
    manager = engine_core(llm).scheduler.kv_cache_manager
    return {rid: ids for rid, ids in manager.block_ids_by_request().items() if ids}


def running_requests(llm) -> list:
    """The scheduler's running ``Request`` objects (prompt, outputs, ``num_computed_tokens``)."""
    return list(engine_core(llm).scheduler.running)


def kv_block_states(llm) -> dict:
    """Every KV block's state, for ``plots.draw_block_states`` (chapter 06).

    ``ref_cnt``: per block, how many running requests hold it; ``block_hash``: per block, the
    first 8 hex digits of its hash (None: no hash, not in the prefix cache); ``free_order``: the
    free queue from its head (the next block ``get_new_blocks`` takes) to its tail; ``tables``:
    request id -> its block ids.
    """
    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    return {
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "block_hash": [None if b.block_hash is None else b.block_hash.hex()[:8] for b in pool.blocks],
        "free_order": pool.free_block_ids(),
        "tables": block_tables(llm),
    }
