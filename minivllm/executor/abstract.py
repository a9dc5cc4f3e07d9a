"""Executors: how the engine core reaches its model (vLLM v1's ``vllm/v1/executor/``).

The engine core schedules once per step and hands the ``SchedulerOutput`` to an executor,
which runs it on every worker (one per tensor-parallel rank) and returns rank 0's
``ModelRunnerOutput``:

* ``UniProcExecutor`` (``distributed_executor_backend="uni"``): one worker, in the core's own
  process: today's model runner, called directly.
* ``MultiprocExecutor`` (``"mp"``): spawns ``tensor_parallel_size`` worker processes and
  broadcasts each step to them over ZMQ; the workers join a torch.distributed group and run
  their shards together.
* ``ExternalLauncherExecutor`` (``"external_launcher"``): the ranks were started by
  ``torchrun`` (one machine or several): rank 0 runs the engine with its worker in-process and
  broadcasts each step through torch.distributed; the other ranks run ``run_worker_loop``.
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process is gone (killed, crashed, out of memory): the engine cannot go on.
    The core-death path turns it into ``EngineDeadError`` for everyone waiting."""


class Executor:
    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        if config.parallel_config.distributed_executor_backend == "mp":
            from minivllm.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if config.parallel_config.distributed_executor_backend == "external_launcher":
            from minivllm.executor.external_launcher import ExternalLauncherExecutor

            return ExternalLauncherExecutor
        from minivllm.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config

    def collective_rpc(self, method: str, args: tuple = (), output_rank: int | None = None) -> list:
        """Call ``Worker.method(*args)`` on every rank; the answers of all ranks, or only
        ``output_rank``'s (a one-element list)."""
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        # the ranks agree on the smallest answer among themselves (Worker.determine_num_blocks)
        return self.collective_rpc("determine_num_blocks", output_rank=0)[0]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,), output_rank=0)[0]

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        pass
