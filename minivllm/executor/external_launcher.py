"""Ranks started by ``torchrun``, on one machine or across several.

Every rank runs the same command with ``--distributed-executor-backend external_launcher``;
``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``,
from which each rank joins the process group. Rank 0 is the engine (it schedules, and serves
when the command is ``serve``) with its own worker in its engine core's process; it broadcasts
each step's ``SchedulerOutput`` to the other ranks through torch.distributed (pickled, over a
gloo group, since the ranks may be on other machines). Ranks 1.. run ``run_worker_loop``:
receive a call, run it on their shard, repeat, until rank 0 says stop.

(vLLM's ``external_launcher`` runs a whole engine on every rank instead, each with the same
requests; here only rank 0 schedules, as with the multiprocess executor.)

A rank that dies breaks the collectives: rank 0's next step raises, and the engine core takes
its death path; ``torchrun`` stops the other ranks.
"""

from __future__ import annotations

import os
import time
import weakref

from minivllm.config import EngineConfig
from minivllm.distributed import parallel_state
from minivllm.executor.abstract import Executor
from minivllm.worker.worker import Worker


def _stop_workers(state: dict) -> None:
    if state["running"]:
        state["running"] = False
        try:
            parallel_state.broadcast_object(("shutdown", (), None))
        except Exception:
            pass  # a rank is gone already
        # leave the process group before the interpreter exits: a gloo group still alive at
        # exit can abort the process ("terminate called without an active exception")
        parallel_state.destroy_distributed_environment()


class ExternalLauncherExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        super().__init__(config, show_progress)
        if int(os.environ.get("RANK", "0")) != 0:
            raise RuntimeError("the engine runs on rank 0; other ranks run run_worker_loop")
        self.driver_worker = Worker(config, show_progress=show_progress)
        self.broadcast_stats = {"steps": 0, "bytes": 0, "max_bytes": 0, "seconds": 0.0}
        self._state = {"running": True}
        self._finalizer = weakref.finalize(self, _stop_workers, self._state)

    def collective_rpc(self, method: str, args: tuple = (), output_rank: int | None = None) -> list:
        start = time.perf_counter()
        parallel_state.broadcast_object((method, args, output_rank))
        self.broadcast_stats["steps"] += 1
        self.broadcast_stats["seconds"] += time.perf_counter() - start
        result = getattr(self.driver_worker, method)(*args)
        if output_rank not in (None, 0):
            raise ValueError("only rank 0 answers with the external launcher")
        return [result]

    def get_broadcast_stats(self) -> dict:
        return dict(self.broadcast_stats)

    def shutdown(self) -> None:
        self._finalizer()


def run_worker_loop(config: EngineConfig) -> int:
    """Ranks 1..: join the group, load this rank's shard, run what rank 0 broadcasts."""
    import signal

    # torchrun passes Ctrl-C to every rank: rank 0 owns the shutdown and will say stop (if it
    # dies instead, the next broadcast raises and this rank exits)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = Worker(config, show_progress=False)
    while True:
        method, args, _ = parallel_state.broadcast_object()
        if method == "shutdown":
            worker.shutdown()  # leaves the process group
            return 0
        getattr(worker, method)(*args)
