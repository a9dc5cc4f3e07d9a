"""The multi-process executor: one worker process per tensor-parallel rank.

    engine core ──PUSH (one socket per rank)──▶ worker 0 … worker tp-1   (the step, pickled)
    engine core ◀──PULL─────────────────────── worker 0                   (sampled tokens)

Each step the core pickles the ``SchedulerOutput`` once and sends the same bytes to every
worker (ZMQ over IPC sockets); the workers run the step together (their collectives go through
torch.distributed, not through here) and only rank 0 answers with its ``ModelRunnerOutput``.
What one step costs to broadcast grows with what changed, not with the batch's history: the
scheduler output is a diff (``minivllm/core/sched_output.py``). ``broadcast_stats`` counts
the bytes and the time spent pickling and sending.

Failure: while it waits for an answer the executor checks that all its workers are alive
whenever its socket stays quiet for ``LIVENESS_POLL_MS`` (100 ms); a dead worker (killed,
crashed, out of memory) raises ``WorkerDiedError`` in the engine core, which takes the
core-death path (``EngineDeadError`` for every request in flight) instead of hanging. A worker
that raises sends its traceback instead of an answer. The workers are stopped on shutdown, when
the executor is garbage-collected or at exit (``owner_finalizer``), and each exits by itself if
the process that spawned it dies. The sockets, the spawn, the liveness rule and the resources to
release are ``minivllm.utils``' helpers, shared with the engine-core client
(``engine/core_client_mp.py``).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import threading
import time
import traceback

import zmq

from minivllm.config import EngineConfig
from minivllm.executor.abstract import Executor, WorkerDiedError
from minivllm.utils import (ProcessResources, child_process_setup, make_socket, owner_finalizer,
                            recv_while_alive)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        super().__init__(config, show_progress)
        self.world_size = config.parallel_config.tensor_parallel_size
        self.resources = ProcessResources(prefix="minivllm-tp-")
        self._finalizer = owner_finalizer(self, self.resources)
        self.broadcast_sockets = [self.resources.bind(zmq.PUSH, f"step{rank}")
                                  for rank in range(self.world_size)]
        self.result_socket = self.resources.bind(zmq.PULL, "result")
        self.broadcast_stats = {"steps": 0, "bytes": 0, "max_bytes": 0, "seconds": 0.0}

        # the engine core may itself run in a daemonic process, which multiprocessing forbids
        # to have children; this process stops its workers itself (the finalizer), and they
        # follow it if it dies, so the flag is not needed here
        current = multiprocessing.current_process()
        if current.daemon:
            current.daemon = False
        dist_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                    "WORLD_SIZE": str(self.world_size)}
        for rank in range(self.world_size):
            env = {**dist_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            self.resources.spawn(run_worker, (config, env, self.resources.address(f"step{rank}"),
                                              self.resources.address("result"), show_progress),
                                 f"TPWorker-{rank}")
        self.workers = self.resources.procs
        try:
            self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_ready(self) -> None:
        ready: set[int] = set()
        while len(ready) < self.world_size:
            rank, status, payload = self._recv()
            if status == "error":
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start:\n{payload}")
            ready.add(rank)

    def _recv(self):
        return pickle.loads(recv_while_alive(self.result_socket, self.workers, self._died))

    def _died(self, proc) -> WorkerDiedError:
        return WorkerDiedError(f"tensor-parallel worker {self.workers.index(proc)} (pid "
                               f"{proc.pid}) exited unexpectedly (exit code {proc.exitcode})")

    def check_health(self) -> None:
        for proc in self.workers:
            if not proc.is_alive():
                raise self._died(proc)

    def broadcast(self, message) -> int:
        """Pickle ``message`` once and send the bytes to every worker; returns their size."""
        start = time.perf_counter()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for s in self.broadcast_sockets:
            s.send(data, copy=False)
        st = self.broadcast_stats
        st["steps"] += 1
        st["bytes"] += len(data)
        st["max_bytes"] = max(st["max_bytes"], len(data))
        st["seconds"] += time.perf_counter() - start
        return len(data)

    def collective_rpc(self, method: str, args: tuple = (), output_rank: int | None = None) -> list:
        self.check_health()
        self.broadcast((method, args, output_rank))
        expected = list(range(self.world_size)) if output_rank is None else [output_rank]
        results: dict[int, object] = {}
        while len(results) < len(expected):
            rank, status, payload = self._recv()
            if status == "error":
                # a rank whose peer died fails in its collective (connection reset) a moment
                # before the dead process is reaped: name the death, not the symptom
                deadline = time.monotonic() + 0.2
                while True:
                    self.check_health()
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                raise RuntimeError(f"tensor-parallel worker {rank} raised in {method}:\n{payload}")
            results[rank] = payload
        return [results[r] for r in expected]

    def get_broadcast_stats(self) -> dict:
        return dict(self.broadcast_stats)

    def shutdown(self) -> None:
        for s in self.broadcast_sockets:
            try:
                s.send(pickle.dumps(("shutdown", (), None)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 2
        for proc in self.workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()


# -- the worker process -------------------------------------------------------------------------

def run_worker(config: EngineConfig, dist_env: dict, step_address: str, result_address: str,
               show_progress: bool) -> None:
    """Entry point of a worker process: load this rank's shard, then run what arrives."""
    child_process_setup("TPWorkerParentWatch")
    os.environ.update(dist_env)
    rank = int(dist_env["RANK"])
    import torch

    if config.device_config.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # the ranks share this machine's cores
        ranks = config.parallel_config.tensor_parallel_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))

    ctx = zmq.Context()
    steps = make_socket(ctx, zmq.PULL, step_address, bind=False)
    results = make_socket(ctx, zmq.PUSH, result_address, bind=False)

    def reply(status: str, payload) -> None:
        results.send(pickle.dumps((rank, status, payload), protocol=pickle.HIGHEST_PROTOCOL))

    from tqdm import std as tqdm_std

    # tqdm's default lock is a multiprocessing semaphore, which a worker that ends with
    # os._exit would leave to the resource tracker to complain about
    tqdm_std.tqdm.set_lock(threading.RLock())
    try:
        from minivllm.worker.worker import Worker

        worker = Worker(config, show_progress=show_progress)
    except Exception:
        reply("error", traceback.format_exc())
        results.close(linger=2000)
        os._exit(1)
    reply("ready", None)
    code = 0
    while True:
        method, args, output_rank = pickle.loads(steps.recv())
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args)
        except Exception:
            reply("error", traceback.format_exc())
            code = 1
            break
        if output_rank is None or output_rank == rank:
            reply("ok", result)
    results.close(linger=2000)
    steps.close(linger=0)
    # no teardown of the process group or the interpreter: a peer may already be gone (a
    # collective would hang) and torch's teardown takes seconds
    os._exit(code)
