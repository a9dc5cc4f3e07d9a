"""The v0 scheduler, kept for contrast: a step is either all-prefill or all-decode.

vLLM v0 batched continuously too, but each step had one *phase*. Waiting prompts took
priority: while any prompt could be admitted, the step prefilled whole prompts only, and every
running request sat idle until the prefill finished. One 2k-token prompt arriving behind 16
chats freezes all 16 for the length of its prefill — the P99 time-per-output-token spike that
chapter 04 measures and v1's unified scheduler removes.

Same block manager, same model runner, same stopping rules as v1: only ``schedule()`` differs.
"""

from __future__ import annotations

from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler
from minivllm.core.sched_output import SchedulerOutput


class PhaseSeparatedScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        entries: list[tuple[Request, int]] = []

        # prefill phase: admit whole prompts (first come, first served) while they fit
        while self.waiting and len(self.running) < self.max_num_seqs:
            num_new = self._try_admit(self.waiting[0], budget, whole_only=True)
            if num_new == 0:
                break
            entries.append((self.running[-1], num_new))
            budget -= num_new
        if entries:
            return self.make_scheduler_output(entries, [])

        # decode phase: one token for every running request, preempting when blocks run out
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_tokens <= request.num_computed_tokens:
                i += 1  # its last token is not back from the runner yet: nothing to compute
                continue
            if not self._allocate_or_preempt(request, 1, preempted):
                break
            entries.append((request, 1))
            budget -= 1
            i += 1
        return self.make_scheduler_output(entries, preempted)
