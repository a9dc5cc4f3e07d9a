"""Who am I among the tensor-parallel ranks, and the two collectives the model needs.

torch.distributed is the distributed engine: one process per rank, joined into a process
group initialised from the standard environment variables (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), the ones ``torchrun`` sets. On one machine the
multiprocess executor spawns the ranks and sets them itself; across machines ``torchrun``
does. The backend is ``gloo`` on a CPU and ``nccl`` on GPUs.

Without a process group (one rank: the single-process executor) the rank is 0 of 1 and both
collectives return their input: the parallel layers then run exactly the unsharded model.

Here the tensor-parallel group is the whole world (no pipeline or data parallelism), so the
collectives use the default group.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_CPU_GROUP = None  # a gloo group over the same ranks, for Python objects and small CPU tensors
# what this rank's model collectives sent: calls and bytes of the tensors it contributed
_COLLECTIVE_STATS = {"all_reduce_calls": 0, "all_reduce_bytes": 0,
                     "all_gather_calls": 0, "all_gather_bytes": 0}


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed_environment(
    backend: str | None = None,
    device: torch.device | None = None,
    timeout_s: float = 600.0,
) -> tuple[int, int]:
    """Join the process group described by the environment; return (rank, world size).

    ``RANK`` and ``WORLD_SIZE`` must be set (``torchrun`` or the multiprocess executor sets
    them); ``MASTER_ADDR`` / ``MASTER_PORT`` say where rank 0 listens.
    """
    global _TP_RANK, _TP_SIZE, _CPU_GROUP
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed needs the environment variables {missing} "
                           "(torchrun sets them; so does the multiprocess executor)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        backend = backend or default_backend(device or torch.device("cpu"))
        dist.init_process_group(backend=backend, init_method="env://", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
    _TP_RANK, _TP_SIZE = dist.get_rank(), dist.get_world_size()
    _CPU_GROUP = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return _TP_RANK, _TP_SIZE


def destroy_distributed_environment() -> None:
    global _TP_RANK, _TP_SIZE, _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _CPU_GROUP = 0, 1, None


@contextmanager
def patch_tensor_parallel_rank(rank: int, world_size: int):
    """Act as rank ``rank`` of ``world_size`` inside the block, without a process group: what
    building every rank's shard of a model in one process needs (layers read the rank when
    they are constructed). The collectives are not patched: running such shards together
    needs collectives of its own (the course's tensor-parallel checks bring them)."""
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    saved = _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, world_size
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE = saved


def cpu_group():
    return _CPU_GROUP


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value`` (ranks agree on the KV cache's size with it)."""
    if _TP_SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())


def broadcast_object(obj=None, src: int = 0):
    """Rank ``src``'s Python object, on every rank (pickled, over the CPU group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_CPU_GROUP)
    return box[0]


def collective_stats() -> dict:
    """Calls and bytes (this rank's tensor, per call) of the model's all-reduces and
    all-gathers so far; at size 1 there are none."""
    return dict(_COLLECTIVE_STATS)


def get_tensor_model_parallel_rank() -> int:
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (every rank gets the sum)."""
    if _TP_SIZE == 1:
        return x
    _COLLECTIVE_STATS["all_reduce_calls"] += 1
    _COLLECTIVE_STATS["all_reduce_bytes"] += x.numel() * x.element_size()
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (every rank gets the whole)."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    _COLLECTIVE_STATS["all_gather_calls"] += 1
    _COLLECTIVE_STATS["all_gather_bytes"] += x.numel() * x.element_size()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
