"""The engine core: scheduler + model runner + the step loop. Token ids in, token ids out.

``EngineCore.step()`` is the heartbeat of the whole system:

    scheduler.schedule()  ->  model_executor.execute_model()  ->  scheduler.update_from_output()

The executor (``minivllm/executor/``) runs the step on the model: in this process (one rank),
or on one worker process per tensor-parallel rank, to which it broadcasts the scheduler output.

It knows nothing of text, HTTP or asyncio, which is what lets it run in a process of its own
(``core_proc.py``) while the front end tokenizes and streams.
"""

from __future__ import annotations

import time
from collections import deque

from minivllm.config import EngineConfig
from minivllm.core.builder import build_scheduler_from_config
from minivllm.core.request import Request
from minivllm.engine.messages import EngineCoreRequest
from minivllm.core.scheduler import Scheduler
from minivllm.engine.messages import EngineCoreOutput
from minivllm.executor import Executor
from minivllm.utils import cdiv


class EngineCore:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        self.model_executor = Executor.get_class(config)(config, show_progress=show_progress)
        # the runner itself, when it lives in this process (single-process executor)
        self.model_runner = getattr(self.model_executor, "model_runner", None)
        try:
            self._init_kv_cache_and_scheduler(config)
        except BaseException:
            self.model_executor.shutdown()
            raise

    def _init_kv_cache_and_scheduler(self, config: EngineConfig) -> None:
        num_blocks = self.model_executor.determine_num_blocks()
        max_model_len, block_size = config.model_config.max_model_len, config.cache_config.block_size
        needed = cdiv(max_model_len, block_size)
        if num_blocks < needed:
            raise ValueError(
                f"max_model_len ({max_model_len}) needs {needed} KV blocks of "
                f"{block_size} tokens, but the KV cache holds only {num_blocks}: lower "
                "max_model_len, or raise num_kv_blocks / kv_cache_memory_bytes"
            )
        self.model_executor.initialize_kv_cache(num_blocks)
        self.scheduler: Scheduler = build_scheduler_from_config(config, num_blocks)
        self.num_steps = 0
        self.step_trace: deque[dict] = deque(maxlen=config.trace_steps)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests() and not getattr(
                self.scheduler, "finished_req_ids", None):
            return []
        start = time.time()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.total_num_scheduled_tokens:
            if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                # nothing to compute, but the runner must still forget these requests (their
                # rows in its persistent batch), or it would hold them until a later step
                self.model_executor.execute_model(scheduler_output)
            return []
        # labelled before update_from_output, which forgets the requests that finish
        kinds = self._step_kinds(scheduler_output) if self.step_trace.maxlen else None
        runner_output = self.model_executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        end = time.time()
        for out in outputs:
            out.timestamp = end
        self.num_steps += 1
        if kinds is not None:
            self._record_step(scheduler_output, kinds, start, end)
        return outputs

    def _record_step(self, scheduler_output, kinds: list[str], start: float, end: float) -> None:
        self.step_trace.append(
            {
                "step": self.num_steps,
                "start_time": start,
                "duration_s": end - start,
                "token_budget": scheduler_output.token_budget,
                "num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
                "scheduled": [
                    (rid, n, kind)
                    for (rid, n), kind in zip(scheduler_output.num_scheduled_tokens.items(), kinds)
                ],
                "preempted": list(scheduler_output.preempted_req_ids),
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.scheduler.kv_cache_manager.num_blocks
                - self.scheduler.kv_cache_manager.get_num_free_blocks(),
            }
        )

    def _step_kinds(self, scheduler_output) -> list[str]:
        """Label each scheduled entry "decode" (one new output token) or "prefill" (a chunk)."""
        kinds = []
        requests = self.scheduler.requests
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            # num_computed_tokens has already moved past this step's tokens
            before = requests[rid].num_computed_tokens - n
            decoding = n == 1 and before >= requests[rid].num_prompt_tokens
            kinds.append("decode" if decoding else "prefill")
        return kinds

    def get_stats(self) -> dict:
        return {**self.scheduler.get_stats(), "num_steps": self.num_steps}

    def get_step_trace(self) -> list[dict]:
        """The engine's iteration statistics: one dict per recent step (the last
        ``trace_steps``; none with ``trace_steps=0``), oldest first. Each holds ``step`` (its
        number), ``start_time`` and ``duration_s`` (wall clock, schedule to update),
        ``token_budget``, ``num_scheduled_tokens``, ``scheduled`` ((request id, tokens,
        "prefill" or "decode") per request), ``preempted`` (request ids), ``num_running``,
        ``num_waiting`` and ``kv_blocks_used`` after the step. A public statistics API, as
        vLLM's scheduler and iteration stats: benchmarks, tests and the chapters read it through
        ``LLMEngine.get_step_trace`` / ``AsyncLLM.get_step_trace``."""
        return list(self.step_trace)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_broadcast_stats(self) -> dict:
        """Steps broadcast to the tensor-parallel workers, their bytes and the seconds spent
        pickling and sending them (empty with the single-process executor)."""
        get = getattr(self.model_executor, "get_broadcast_stats", None)
        return get() if get else {}

    def shutdown(self) -> None:
        self.model_executor.shutdown()
