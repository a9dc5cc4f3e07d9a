"""Read-only views into a running engine, for chapters that open it up, and the scheduler swap.

The engine core runs in the notebook's process (``LLM(...)`` without ``multiprocess=True``), so
its scheduler, KV cache manager and model runner can be looked at directly between steps. What
the chapters read is assembled here from the engine's own API (``KVCacheManager.get_block_ids``,
the block pool's ``blocks`` and ``free_block_queue``); the engine carries no view of its own.
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
        "free_order": [b.block_id for b in pool.free_block_queue],
        "tables": block_tables(llm),
    }


def replace_scheduler(core, scheduler, step_trace: deque | None = None, num_steps: int = 0,
                      *, force: bool = False) -> tuple:
    """Put ``scheduler`` in charge of ``core``'s next steps; return what it replaces.

    Only between requests (none unfinished). Requests that ended but whose end the model runner
    has not been told yet are handed to the new scheduler, which tells it on its first step.
    The step trace and the step count start over (or take the given ones). Returns the old
    scheduler, trace and step count, which a second call puts back (``course.swap`` runs one
    loaded model under several schedulers this way).

    ``force`` replaces even a scheduler that still holds requests (a learner's scheduler that
    failed mid-run, whose requests the front end has aborted): they are dropped, and the runner
    is told they finished, so no row of its persistent batch outlives them.
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
