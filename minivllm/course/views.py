"""Read-only views into an in-process engine (``LLM(...)`` without ``multiprocess=True``), for
chapters that open it up between steps, built from the engine's own API; and the scheduler swap.
"""

from __future__ import annotations

from collections import deque


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
    tables = {rid: manager.get_block_ids(rid) for rid in manager.req_to_blocks}
    return {rid: ids for rid, ids in tables.items() if ids}


def running_requests(llm) -> list:
    """The scheduler's running ``Request`` objects (prompt, outputs, ``num_computed_tokens``)."""
    return list(engine_core(llm).scheduler.running)


def kv_block_states(llm) -> dict:
    """Every KV block's state, for ``plots.draw_block_states``: ``ref_cnt`` and ``block_hash``
    (first 8 hex digits, None: not cached) per block, ``free_order`` (the free queue, head
    first) and ``tables`` (request id -> block ids)."""
    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    return {
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "block_hash": [None if b.block_hash is None else b.block_hash.hex()[:8] for b in pool.blocks],
        "free_order": [b.block_id for b in pool.free_block_queue],
        "tables": block_tables(llm),
    }


def replace_scheduler(core, scheduler, step_trace: deque | None = None, num_steps: int = 0,
                      *, force: bool = False) -> tuple:
    """Put ``scheduler`` in charge of ``core``'s next steps, between requests; return the old
    (scheduler, trace, step count), which a second call puts back.

    Ended requests the model runner has not been told of yet pass to the new scheduler. The trace
    and step count start over (or take the given ones). ``force`` replaces even a scheduler that
    still holds requests (a learner's that failed mid-run): the runner is told they finished.
    """
    if not force and core.scheduler.has_unfinished_requests():
        raise ValueError("the engine still has unfinished requests: finish or abort them first")
    old = core.scheduler, core.step_trace, core.num_steps
    scheduler.finished_req_ids |= old[0].finished_req_ids
    if force:
        scheduler.finished_req_ids |= set(getattr(old[0], "requests", {}))
    old[0].finished_req_ids = set()
    core.scheduler = scheduler
    core.step_trace = step_trace if step_trace is not None else deque(maxlen=old[1].maxlen)
    core.num_steps = num_steps
    return old
