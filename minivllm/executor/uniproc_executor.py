"""The single-process executor: one worker, in the engine core's process, called directly."""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.executor.abstract import Executor
from minivllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        super().__init__(config, show_progress)
        self.driver_worker = Worker(config, show_progress=show_progress)
        self.model_runner = self.driver_worker.model_runner

    def collective_rpc(self, method: str, args: tuple = (), output_rank: int | None = None) -> list:
        return [getattr(self.driver_worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
