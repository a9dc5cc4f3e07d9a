"""One place that builds a scheduler over a fresh KV cache manager and block pool.

The engine core, the simulator and the course's scheduler swap all need the same three objects
wired together; they differ only in where the numbers come from (a resolved ``EngineConfig``, a
bare ``SchedulerConfig``) and in which classes a learner or a test plugs in.
"""

from __future__ import annotations

from minivllm.config import SchedulerConfig
from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler

SCHEDULER_CLASSES = {"v1": Scheduler, "v0": PhaseSeparatedScheduler}


def build_scheduler(
    scheduler_config: SchedulerConfig,
    num_blocks: int,
    block_size: int,
    *,
    scheduler: str = "v1",
    enable_caching: bool = True,
    hash_algo: str = "sha256",
    scheduler_cls: type | None = None,
    kv_cache_manager_cls: type | None = None,
    block_pool_cls: type | None = None,
) -> Scheduler:
    """A scheduler (``scheduler``: "v1" or "v0", or ``scheduler_cls``) over ``num_blocks`` blocks."""
    if scheduler_cls is None and scheduler not in SCHEDULER_CLASSES:
        raise ValueError(f"scheduler must be one of {tuple(SCHEDULER_CLASSES)}, got {scheduler!r}")
    kv_cache_manager = (kv_cache_manager_cls or KVCacheManager)(
        num_blocks, block_size, enable_caching=enable_caching, hash_algo=hash_algo,
        block_pool_cls=block_pool_cls or BlockPool,
    )
    return (scheduler_cls or SCHEDULER_CLASSES[scheduler])(scheduler_config, kv_cache_manager)


def build_scheduler_from_config(config, num_blocks: int) -> Scheduler:
    """The scheduler an ``EngineConfig`` describes, over ``num_blocks`` KV blocks."""
    return build_scheduler(
        config.scheduler_config, num_blocks, config.cache_config.block_size,
        scheduler=config.scheduler, enable_caching=config.cache_config.enable_prefix_caching,
        hash_algo=config.cache_config.prefix_caching_hash_algo, scheduler_cls=config.scheduler_cls,
        kv_cache_manager_cls=config.kv_cache_manager_cls, block_pool_cls=config.block_pool_cls,
    )
