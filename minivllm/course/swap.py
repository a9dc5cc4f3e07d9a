"""Give a loaded engine another scheduler, without loading the model again.

    with swapped_scheduler(llm, scheduler="v0", max_num_batched_tokens=2048):
        llm.generate(...)          # a fresh scheduler and KV cache manager, as LLM(...) builds
    # the LLM's own scheduler is back
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from minivllm.core.builder import build_scheduler_from_config
from minivllm.course.views import engine_core, replace_scheduler

# what a swap may change: how requests are scheduled, never the model or the cache's layout
SWAPPABLE = ("scheduler", "scheduler_cls", "kv_cache_manager_cls", "max_num_seqs",
             "max_num_batched_tokens", "enable_chunked_prefill", "long_prefill_token_threshold",
             "enable_prefix_caching", "num_kv_blocks")


@contextmanager
def swapped_scheduler(llm, **overrides):
    """Run ``llm`` with the scheduler these engine arguments (checked as ``LLM(...)`` does)
    describe; yields it. ``num_kv_blocks`` may shrink the KV cache, never grow it. On leaving,
    unfinished requests are aborted and the LLM's own scheduler and trace come back."""
    unknown = set(overrides) - set(SWAPPABLE)
    if unknown:
        raise ValueError(f"swapped_scheduler can change only {SWAPPABLE}, not {sorted(unknown)}")
    core = engine_core(llm)
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise ValueError("the engine still has unfinished requests: finish or abort them first")
    capacity = core.model_runner.kv_caches[0].shape[1]  # blocks the KV cache tensors hold
    num_blocks = overrides.get("num_kv_blocks") or capacity
    if num_blocks > capacity:
        raise ValueError(f"num_kv_blocks={num_blocks}: the KV cache holds only {capacity} blocks")
    config = dataclasses.replace(llm.engine_args, **overrides).create_config()
    asked, built = config.scheduler_config.max_num_seqs, core.config.scheduler_config.max_num_seqs
    if asked > built:
        raise ValueError(f"max_num_seqs={asked}: the engine was built for at most {built}")
    scheduler = build_scheduler_from_config(config, num_blocks)
    own = replace_scheduler(core, scheduler)  # (scheduler, step trace, step count)
    try:
        yield scheduler
    finally:
        try:
            left = list(engine.output_processor.requests)
            if left:
                engine.abort_request(left)
        finally:
            # always put the engine's own scheduler back, even if a failing one cannot abort
            replace_scheduler(core, *own, force=True)
