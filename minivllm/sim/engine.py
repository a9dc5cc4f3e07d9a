"""A simulated engine: the real scheduler and block manager, a cost model instead of a model.

Everything that decides *who runs when* is the production code — ``Scheduler`` (or the v0
``PhaseSeparatedScheduler``), ``KVCacheManager``, ``BlockPool`` — so their behaviour at full
scale (16k-token prompts, 1000 sessions, 40k KV blocks) can be watched on a laptop in seconds.
Only the forward pass is replaced: a ``SimulatedRunner`` makes up the next token and a
``CostModel`` says how long the step would have taken; a virtual clock advances by that.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from minivllm.config import EngineArgs, SchedulerConfig
from minivllm.core.builder import build_scheduler
from minivllm.core.request import Request
from minivllm.engine.messages import EngineCoreRequest
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.sampling_params import SamplingParams
from minivllm.sim.cost_model import CostModel


class SimulatedRunner:
    """Stands in for the model runner: a made-up next token, and the step's simulated time."""

    def __init__(self, cost_model: CostModel, vocab_size: int = 32000) -> None:
        self.cost_model = cost_model
        self.vocab_size = vocab_size

    def next_token(self, request_id: str, position: int) -> int:
        # deterministic, spread over the vocabulary, never 0..9 (kept free for special ids)
        h = 2166136261
        for ch in f"{request_id}:{position}".encode():
            h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
        return 10 + h % (self.vocab_size - 10)

    def execute_model(self, out: SchedulerOutput,
                      requests: dict[str, Request]) -> tuple[ModelRunnerOutput, float]:
        result = ModelRunnerOutput()
        work = step_work(out, requests)
        for rid, num_new, seq_len in work:
            # the step reaches the end of the request's known tokens: it samples the next one
            done = seq_len >= requests[rid].num_tokens
            result.req_ids.append(rid)
            result.sampled_token_ids.append([self.next_token(rid, seq_len)] if done else [])
        return result, self.cost_model.step_time([(n, seq_len) for _, n, seq_len in work])


def step_work(out: SchedulerOutput, requests: dict[str, Request]) -> list[tuple[str, int, int]]:
    """(request id, tokens computed, context length after the step) of each scheduled request,
    read right after ``schedule()`` (which has already advanced ``num_computed_tokens``)."""
    return [(rid, n, requests[rid].num_computed_tokens) for rid, n in out.num_scheduled_tokens.items()]


@dataclass
class SimRequestRecord:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finished: bool = False

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None


class SimEngine:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = EngineArgs.block_size,
        scheduler: str = "v1",
        scheduler_config: SchedulerConfig | None = None,
        enable_prefix_caching: bool = True,
        cost_model: CostModel | None = None,
        scheduler_cls: type | None = None,
        block_pool_cls: type | None = None,
    ) -> None:
        self.config = scheduler_config or SchedulerConfig()
        self.scheduler = build_scheduler(
            self.config, num_blocks, block_size, scheduler=scheduler,
            enable_caching=enable_prefix_caching, scheduler_cls=scheduler_cls,
            block_pool_cls=block_pool_cls)
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        self.runner = SimulatedRunner(cost_model or CostModel())
        self.clock = 0.0
        self.records: dict[str, SimRequestRecord] = {}
        self.step_trace: list[dict] = []
        self.peak_blocks_used = 0
        # at the peak: how many block references the live requests hold (> blocks if shared)
        self.peak_block_references = 0
        self.peak_num_running = 0
        self._arrivals: list[tuple[float, int, EngineCoreRequest]] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
    ) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        req = EngineCoreRequest(request_id, prompt_token_ids, params, arrival_time=arrival_time,
                                cache_salt=cache_salt)
        heapq.heappush(self._arrivals, (arrival_time, len(self.records), req))
        self.records[request_id] = SimRequestRecord(request_id, arrival_time, len(prompt_token_ids))

    def abort(self, request_id: str) -> None:
        """End a request, whether it is still to arrive or already running."""
        pending = [a for a in self._arrivals if a[2].request_id != request_id]
        if len(pending) != len(self._arrivals):
            self._arrivals = pending
            heapq.heapify(self._arrivals)
        self.scheduler.finish_requests([request_id])
        if request_id in self.records:
            self.records[request_id].finished = True

    def _admit_arrivals(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.clock:
            _, _, req = heapq.heappop(self._arrivals)
            self.scheduler.add_request(Request(req))

    def step(self) -> bool:
        """One scheduler step on the virtual clock. Returns False when everything is done."""
        self._admit_arrivals()
        if not self.scheduler.has_unfinished_requests():
            if not self._arrivals:
                return False
            self.clock = self._arrivals[0][0]
            return True
        out = self.scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            if self._arrivals:  # nothing fits now: wait for the next arrival
                self.clock = max(self.clock, self._arrivals[0][0])
                return True
            raise RuntimeError("the scheduler can make no progress (KV cache too small?)")
        runner_output, duration = self.runner.execute_model(out, self.scheduler.requests)
        start = self.clock
        self.clock += duration
        for core_out in self.scheduler.update_from_output(out, runner_output):
            rec = self.records[core_out.request_id]
            rec.token_times.extend([self.clock] * len(core_out.new_token_ids))
            rec.num_cached_tokens = core_out.num_cached_tokens
            rec.num_preemptions = core_out.num_preemptions
            rec.finished = core_out.finished
        used = self.kv_cache_manager.num_blocks - self.kv_cache_manager.get_num_free_blocks()
        if used > self.peak_blocks_used:
            self.peak_blocks_used = used
            self.peak_num_running = len(self.scheduler.running)
            self.peak_block_references = sum(
                len(self.kv_cache_manager.get_blocks(r.request_id)) for r in self.scheduler.running
            )
        self.step_trace.append({
            "start_time": start,
            "duration_s": duration,
            "num_scheduled_tokens": out.total_num_scheduled_tokens,
            "scheduled": list(out.num_scheduled_tokens.items()),
            "kv_blocks_used": used,
        })
        return True

    def run(self, max_steps: int = 10_000_000) -> dict[str, SimRequestRecord]:
        for _ in range(max_steps):
            if not self.step():
                break
        return self.records
