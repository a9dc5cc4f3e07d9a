"""A worker: one tensor-parallel rank. It joins the process group, loads its shard of the
model into a ``ModelRunner`` and answers the executor's calls (vLLM v1's ``Worker``).

Every rank holds a persistent input batch of its own and applies the same diff-only
``SchedulerOutput`` to it, so every rank builds the same inputs; the parallel layers exchange
partial results inside the forward pass, the gathered logits are the same on every rank, and
every rank samples the same tokens (same seeds, same generators) and appends them to its own
batch. Only rank 0's ``ModelRunnerOutput`` travels back to the engine core.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from minivllm.config import DeviceConfig, EngineConfig
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.distributed import parallel_state


class Worker:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.rank, self.world_size = 0, 1
        device = config.device_config.device
        if device.type == "cuda" and device.index is not None:
            # cuda:N with one rank: make it the current device, or torch.cuda.synchronize(),
            # graph capture and new streams would work on device 0
            torch.cuda.set_device(device)
        if config.parallel_config.tensor_parallel_size > 1:
            local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
            if config.device_config.device.type == "cuda":
                device = torch.device("cuda", local_rank)
                torch.cuda.set_device(device)
                config = dataclasses.replace(config, device_config=DeviceConfig(device))
            self.rank, self.world_size = parallel_state.init_distributed_environment(
                device=config.device_config.device)
            if self.world_size != config.parallel_config.tensor_parallel_size:
                raise RuntimeError(f"the process group has {self.world_size} ranks, but "
                                   f"tensor_parallel_size is {config.parallel_config.tensor_parallel_size}")
        self.config = config
        # imported here: the runner's model reads the rank and the world size as it is built
        from minivllm.worker.model_runner import ModelRunner

        runner_cls = config.model_runner_cls or ModelRunner  # e.g. the course's paced runner
        self.model_runner = runner_cls(config, show_progress=show_progress and self.rank == 0)

    def determine_num_blocks(self) -> int:
        # every rank must fit the cache: the ranks agree on the smallest answer
        return parallel_state.all_reduce_min(self.model_runner.determine_num_blocks())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def ping(self, payload=None) -> int:
        """Answer at once (the executor's broadcast round trip is measured with it)."""
        return self.rank

    def collective_stats(self) -> dict:
        """What this rank's model collectives have sent so far (``parallel_state``)."""
        return parallel_state.collective_stats()

    def measure_all_reduce(self, num_tokens: int, repeats: int = 50, warmup: int = 5) -> dict:
        """Seconds of one all-reduce of ``[num_tokens, hidden]`` activations (median), as the
        row-parallel layers run it, and its bytes."""
        c = self.config.model_config.hf_config
        x = torch.ones(num_tokens, c.hidden_size, dtype=self.config.model_config.dtype,
                       device=self.config.device_config.device)
        times = []
        for _ in range(warmup + repeats):
            if self.config.device_config.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            parallel_state.tensor_model_parallel_all_reduce(x)
            if self.config.device_config.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        times = sorted(times[warmup:])
        return {"num_tokens": num_tokens, "bytes": x.numel() * x.element_size(),
                "seconds": times[len(times) // 2]}

    def shutdown(self) -> None:
        parallel_state.destroy_distributed_environment()
