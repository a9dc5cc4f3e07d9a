"""The v1 unified scheduler: one token budget per step, prefill chunks and decodes side by side.

There is no "prefill phase" and no "decode phase". Every request just has some tokens whose
K/V are not computed yet (``num_tokens - num_computed_tokens``): a whole prompt, the rest of a
prompt, or the single token sampled last step. Each step hands out at most
``max_num_batched_tokens`` of them:

1. running requests first, in arrival order: a decode takes 1 token, a half-prefilled prompt
   its next chunk. When the KV pool is full, the latest-arrived running request is preempted
   (its blocks freed, recomputed later) until the earlier one fits;
2. then waiting requests, each given min(what it needs, what is left of the budget,
   ``long_prefill_token_threshold``), after its cached prefix is subtracted.

A 16k-token prompt therefore enters as a series of chunks while every running request keeps
getting its token each step: decodes never stall (chapter 05).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus, check_stop
from minivllm.engine.messages import EngineCoreOutput
from minivllm.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    """The v1 scheduler. Subclasses (and the course's exercises) override ``schedule()``."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # what the model runner holds of each request it has seen: (how many of its blocks it
        # has been sent, the request's num_preemptions then) — the basis of each step's diff
        self._runner_blocks: dict[str, tuple[int, int]] = {}
        # counters behind get_stats()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found

    # -- the request set ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """End requests from outside (abort); unknown or already finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            ended.append(request)
        return ended

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self._runner_blocks.pop(request.request_id, None)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- shared steps of any scheduling policy ----------------------------------------------
    def _preempt(self, request: Request) -> None:
        """Take a running request's blocks away; it will be recomputed from the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, preempted: list[Request]
    ) -> bool:
        """Allocate for a running request, preempting the latest arrivals until it fits.

        Returns False if the request itself had to be preempted.
        """
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            victim = self.running.pop()  # lowest priority under FCFS: the latest arrival
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _try_admit(
        self, request: Request, token_budget: int, whole_only: bool
    ) -> int:
        """Try to move the head of the waiting queue into running. Returns tokens scheduled (0: no).

        ``whole_only``: the request must get all its remaining tokens in this step (no chunking).
        """
        computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_cached
        if self.long_prefill_token_threshold and not whole_only:
            num_new = min(num_new, self.long_prefill_token_threshold)
        if whole_only and num_new > token_budget:
            return 0
        num_new = min(num_new, token_budget)
        if self.kv_cache_manager.allocate_slots(request, num_new, num_cached, computed_blocks) is None:
            return 0
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        self.record_admission(request, num_cached)
        return num_new

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        """The statistics of admitting ``request`` with a prefix-cache hit of
        ``num_cached_tokens``: the hit-rate counters (only with prefix caching on: off, the hit
        rate has no data, as vLLM's, rather than a misleading 0%), and (first admission only)
        when it was first scheduled and how much of it was cached, which its outputs report. Any
        policy that admits a request itself (the course's exercises) calls this."""
        if getattr(self.kv_cache_manager, "enable_caching", True):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
            request.num_cached_tokens = num_cached_tokens

    def make_scheduler_output(
        self, scheduled: list[tuple[Request, int]], preempted: list[Request]
    ) -> SchedulerOutput:
        """The step's output for ``(request, num_new_tokens)`` pairs and the requests preempted
        this step; then advances each scheduled request's ``num_computed_tokens``.

        Every scheduling policy ends its ``schedule()`` here (the course's exercises too). The
        output is a diff against what the model runner already holds: a request it has never
        seen is sent whole (``NewRequestData``), one it holds gets only its new block ids, one
        that was preempted since comes back with its whole new block table.
        """
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids,
                              preempted_req_ids={r.request_id for r in preempted},
                              token_budget=self.max_num_batched_tokens)
        self.finished_req_ids = set()
        cached: CachedRequestData = out.scheduled_cached_reqs
        total = 0
        for request, num_new in scheduled:
            if num_new <= 0:
                continue  # nothing to compute for it in this step
            rid = request.request_id
            blocks = self.kv_cache_manager.get_blocks(rid)
            known = self._runner_blocks.get(rid)
            if known is None:
                out.scheduled_new_reqs.append(NewRequestData(
                    req_id=rid, prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=[b.block_id for b in blocks],
                    num_computed_tokens=request.num_computed_tokens))
                self._runner_blocks[rid] = (len(blocks), request.num_preemptions)
            else:
                num_sent, num_preemptions = known
                resumed = num_preemptions != request.num_preemptions
                cached.req_ids.append(rid)
                cached.resumed_from_preemption.append(resumed)
                cached.num_computed_tokens.append(request.num_computed_tokens)
                if resumed or num_sent != len(blocks):
                    new_blocks = blocks if resumed else blocks[num_sent:]
                    cached.new_block_ids.append([b.block_id for b in new_blocks])
                    self._runner_blocks[rid] = (len(blocks), request.num_preemptions)
                else:  # most decode steps: no new block
                    cached.new_block_ids.append([])
            out.num_scheduled_tokens[rid] = num_new
            total += num_new
            request.num_computed_tokens += num_new
        out.total_num_scheduled_tokens = total
        return out

    # -- the policy ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        entries: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        # 1. running requests: decodes and the next chunks of partial prefills
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if self.long_prefill_token_threshold:
                num_new = min(num_new, self.long_prefill_token_threshold)
            num_new = min(num_new, budget)
            if num_new <= 0:
                # nothing left to compute (schedule() ran again before the runner's output came
                # back, or the runner sampled nothing for it): skip it this step, as vLLM does
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_new, preempted):
                break
            entries.append((request, num_new))
            budget -= num_new
            i += 1

        # 2. waiting requests, only if nobody had to be preempted this step
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                num_new = self._try_admit(request, budget, whole_only=not self.enable_chunked_prefill)
                if num_new == 0:
                    break
                entries.append((request, num_new))
                budget -= num_new

        return self.make_scheduler_output(entries, preempted)

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = []
        stopped = False
        for req_id, new_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            if not new_ids:
                continue  # a prefill chunk that sampled nothing
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted meanwhile
            request.append_output_token_ids(new_ids)
            done = check_stop(request, self.max_model_len)
            if done:
                stopped = True
                self._free_request(request)
            # positional (EngineCoreOutput's field order): once per request per step
            outputs.append(EngineCoreOutput(
                req_id, new_ids, request.status.finish_reason, request.stop_reason,
                max(request.num_cached_tokens, 0), request.num_preemptions,
                request.first_scheduled_time))
        if stopped:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    # -- introspection ---------------------------------------------------------------------
    def get_stats(self) -> dict:
        pool = self.kv_cache_manager.block_pool
        total = pool.num_blocks
        return {
            "kv_blocks_total": total,
            "kv_blocks_used": total - pool.get_num_free_blocks(),
            "kv_blocks_cached": pool.get_num_cached_free_blocks(),
            "kv_cache_usage": pool.get_usage(),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
        }
