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
    return {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items() if blocks}


def running_requests(llm) -> list:
    """The scheduler's running ``Request`` objects (prompt, outputs, ``num_computed_tokens``)."""
    return list(engine_core(llm).scheduler.running)
