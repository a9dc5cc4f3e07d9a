"""Checkers for exercises 4.1 (v0) and 5.1 (v1): the learner's ``schedule()`` runs workloads in
the check engine, every step checked against the policy, every output equal to the package's."""

from __future__ import annotations

import functools
from collections import namedtuple

from minivllm.core.request import RequestStatus
from minivllm.core.sched_output import SchedulerOutput
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler
from minivllm.course.checks.common import ENGINE_PROMPTS, Exercise, check_engine

MAX_STEPS = 400
V0_CONVENTION = (
    "Expected (v0): every step is one phase. If the head of the waiting queue fits, it is a "
    "prefill step: whole prompts, first come first served, admitted while they fit "
    "(max_num_batched_tokens, max_num_seqs, KV blocks). Otherwise it is a decode step: one "
    "token for every running request. Waiting prompts take priority; no step mixes the two.")
V1_CONVENTION = (
    "Expected (v1): a step hands out at most max_num_batched_tokens tokens. Running requests "
    "come first, in order: a decode gets 1 token, a partial prefill its next chunk (at most "
    "long_prefill_token_threshold when that is set). When allocate_slots finds no room, "
    "preempt the latest-arrived running request (running[-1]) and retry, until the request "
    "fits or was itself preempted. Then, only if nobody was preempted, admit waiting requests "
    "in order with whatever budget is left.")
PREEMPT_CONVENTION = (
    "A preempted request gives back all its KV blocks (kv_cache_manager.free), restarts from "
    "num_computed_tokens = 0 (its K/V are gone: it is recomputed), is counted "
    "(request.num_preemptions and self.num_preemptions) and goes back to the FRONT of the "
    "waiting queue (it has waited longest).")
PROMPTS = (*ENGINE_PROMPTS, (
    "A serving engine runs one step after another. In each step the scheduler decides which "
    "requests run and how many of their tokens the model computes; the model runner turns that "
    "decision into one flat batch of tokens, runs the forward pass over the paged KV cache and "
    "samples one new token for every request whose known tokens are now all computed. A long "
    "prompt that arrives while many users are chatting is the hard case: computing it in one "
    "step makes every chat wait, so how should its tokens be shared out between steps?"))

# overrides: engine arguments ((name, value), ...); arrivals: ((step, request id, prompt index,
# max_tokens), ...); ample_kv: every request always fits in the KV cache (no preemption needed)
Workload = namedtuple("Workload", "name overrides arrivals ample_kv", defaults=(True,))
V0_WORKLOAD = Workload(
    "v0: chats decoding, prompts arriving, at most 3 running",
    (("scheduler", "v0"), ("max_num_batched_tokens", 1024), ("max_num_seqs", 3)),
    ((0, "chat-0", 0, 4), (0, "chat-1", 1, 10), (0, "chat-2", 2, 12), (0, "chat-3", 3, 8),
     (3, "long", 4, 4), (6, "chat-4", 2, 6)))
CHUNK_WORKLOAD = Workload(
    "v1: a budget of 24 tokens, chunks of at most 16, a long prompt arriving among chats",
    (("scheduler", "v1"), ("max_num_batched_tokens", 24), ("long_prefill_token_threshold", 16),
     ("max_num_seqs", 8)),
    ((0, "chat-0", 0, 12), (0, "chat-1", 1, 12), (0, "chat-2", 2, 12), (2, "long", 4, 4),
     (4, "chat-3", 3, 10)))
PREEMPT_WORKLOAD = Workload(
    "v1: 9 KV blocks of 8 tokens for 5 growing requests (preemption needed)",
    (("scheduler", "v1"), ("max_num_batched_tokens", 32), ("num_kv_blocks", 9),
     ("max_num_seqs", 8)),
    ((0, "chat-0", 0, 24), (0, "chat-1", 1, 24), (0, "chat-2", 2, 24), (0, "chat-3", 3, 24),
     (6, "chat-4", 2, 8)),
    ample_kv=False)

ALLOWED = "self.kv_cache_manager, self.record_admission, self.make_scheduler_output"
# the package's policy, refused; 4.1 is given preemption's state change (self._preempt)
V0_HELPERS = ("minivllm.core.scheduler:Scheduler.schedule",
              "minivllm.core.scheduler:Scheduler._try_admit",
              "minivllm.core.scheduler:Scheduler._allocate_or_preempt",
              "minivllm.core.scheduler_v0:PhaseSeparatedScheduler")
V1_HELPERS = (*V0_HELPERS, "minivllm.core.scheduler:Scheduler._preempt")
# the queues just before a schedule() call: running and waiting ids, {id: num_tokens}
Before = namedtuple("Before", "running waiting num_tokens")


def run_arrivals(llm, arrivals, max_steps: int = MAX_STEPS, after_step=None) -> dict:
    """Greedy requests ``(step, id, prompt token ids, max_tokens)`` added at their steps, run for
    at most ``max_steps`` steps: {id: output token ids} of those that finished."""
    from minivllm import SamplingParams
    engine, outputs = llm.llm_engine, {}
    for step in range(max_steps):
        for at, rid, prompt, max_tokens in arrivals:
            if at == step:
                engine.add_request(rid, {"prompt_token_ids": list(prompt)}, SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True))
        if step > max(a[0] for a in arrivals) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if after_step is not None:
            after_step()
    return outputs


def run_workload(scheduler_cls: type, workload: Workload, ex: Exercise | None = None) -> dict:
    """{request id: output token ids} of ``workload`` run with ``scheduler_cls``."""
    from minivllm.course.swap import swapped_scheduler
    tok = check_engine().get_tokenizer()
    arrivals = [(at, rid, tok.encode(PROMPTS[p]), n) for at, rid, p, n in workload.arrivals]
    with swapped_scheduler(check_engine(), scheduler_cls=scheduler_cls, **dict(workload.overrides)):
        outputs = run_arrivals(check_engine(), arrivals)
    unfinished = sorted({a[1] for a in arrivals} - set(outputs))
    if unfinished:
        (ex or Exercise("reference")).fail(
            f"workload '{workload.name}': after {MAX_STEPS} engine steps, requests {unfinished} "
            "are still unfinished: the scheduler stopped making progress (a step that schedules "
            "nothing, or a request never admitted).")
    return outputs


@functools.cache
def reference_outputs(workload: Workload) -> dict:
    v0 = dict(workload.overrides)["scheduler"] == "v0"
    return run_workload(PhaseSeparatedScheduler if v0 else Scheduler, workload)


class _Watch:
    """Runs the learner's scheduler ``cls`` (as ``Exercise.take`` returned it) on ``workload``,
    each ``schedule()`` checked by ``check_step``; then every output must be the reference's."""

    def __init__(self, ex: Exercise, cls: type, workload: Workload, check_step) -> None:
        self.ex, self.workload = ex, workload
        self.steps = self.mixed_steps = self.preemptions = 0
        watch = self

        class Probe(cls):
            def schedule(self):
                before = Before([r.request_id for r in self.running],
                                [r.request_id for r in self.waiting],
                                {rid: r.num_tokens for rid, r in self.requests.items()})
                out = super().schedule()
                watch.steps += 1
                if not isinstance(out, SchedulerOutput):
                    watch.ex.fail(f"schedule() returned {type(out).__name__}; expected a "
                                  "SchedulerOutput (self.make_scheduler_output(entries, "
                                  "preempted)).")
                check_step(self, before, out, watch)
                return out

        Probe.__name__ = Probe.__qualname__ = cls.__name__
        got, tok = run_workload(Probe, workload, ex), check_engine().get_tokenizer()
        for rid, e in reference_outputs(workload).items():
            if got.get(rid) != e:
                ex.fail(f"workload '{workload.name}': request {rid!r} generated "
                        f"{tok.decode(got.get(rid) or [])!r}, expected {tok.decode(e)!r}. Every "
                        "step passed its checks: does each request compute exactly the tokens "
                        "from num_computed_tokens on?")

    def fail(self, out, message: str) -> None:
        shown = dict(out.num_scheduled_tokens) or "nothing"
        if out.preempted_req_ids:
            shown = f"{shown} and preempted {sorted(out.preempted_req_ids)}"
        self.ex.fail(f"workload '{self.workload.name}', step {self.steps}: the step scheduled "
                     f"{shown}. {message}")


def _check_common(sched: Scheduler, out, watch: _Watch) -> list[tuple[str, int, int, bool]]:
    """Any scheduler: the budget, max_num_seqs; each scheduled request is running and gets from 1
    to what it has left, at most the chunk cap. Returns (request id, tokens this step, tokens
    computed before it, is a decode) per entry."""
    total, running, cap = (out.total_num_scheduled_tokens, len(sched.running),
                           sched.long_prefill_token_threshold)
    if total > sched.max_num_batched_tokens:
        watch.fail(out, f"That is {total} tokens, over the step's budget max_num_batched_tokens="
                        f"{sched.max_num_batched_tokens}: never give more than is left.")
    if running > sched.max_num_seqs:
        watch.fail(out, f"{running} requests are now running, over max_num_seqs="
                        f"{sched.max_num_seqs}.")
    entries = []
    for rid, n in out.num_scheduled_tokens.items():
        request = sched.requests[rid]
        done = request.num_computed_tokens - n  # schedule() advanced it
        entries.append((rid, n, done, n == 1 and done >= request.num_prompt_tokens))
        if cap and n > cap:
            watch.fail(out, f"Request {rid!r} got a chunk of {n} tokens, over "
                            f"long_prefill_token_threshold={cap}.")
        if request not in sched.running:
            watch.fail(out, f"Request {rid!r} was scheduled but is not in self.running.")
        if not 1 <= n <= request.num_tokens - done:
            watch.fail(out, f"Request {rid!r} got {n} tokens with {request.num_tokens - done} "
                            "left to compute (give 1 to num_tokens - num_computed_tokens).")
    return entries


def _check_v0_step(sched: Scheduler, before: Before, out, watch: _Watch) -> None:
    entries = _check_common(sched, out, watch)
    decodes = [rid for rid, _, _, decode in entries if decode]
    prefills = [(rid, n, done) for rid, n, done, decode in entries if not decode]
    admitted = [rid for rid, _, _ in prefills]
    if out.preempted_req_ids:
        watch.fail(out, "Nothing needed preempting (the KV cache has room for every request).")
    if decodes and prefills:
        watch.fail(out, f"It mixes the prefill of {admitted} with the decodes of {decodes}: in "
                        "v0 a step is all-prefill or all-decode.")
    for rid, n, done in prefills:
        left = sched.requests[rid].num_tokens - done
        if n != left:
            watch.fail(out, f"Request {rid!r} got {n} of its {left} prompt tokens: v0 prefills "
                            "whole prompts.")
    head = before.waiting[0] if before.waiting else None
    if (head is not None and len(before.running) < sched.max_num_seqs and head not in admitted
            and before.num_tokens[head] <= sched.max_num_batched_tokens):
        watch.fail(out, f"Request {head!r} was at the head of the waiting queue and fit, but was "
                        "not prefilled: waiting prompts take priority over decodes.")
    if admitted != before.waiting[:len(admitted)]:
        watch.fail(out, f"The waiting queue was {before.waiting}: admit from its head, in order.")
    left = sched.max_num_batched_tokens - sum(n for _, n, _ in prefills)
    nxt = before.waiting[len(admitted)] if len(before.waiting) > len(admitted) else None
    if (prefills and nxt is not None and len(sched.running) < sched.max_num_seqs
            and before.num_tokens[nxt] <= left):
        watch.fail(out, f"Request {nxt!r} ({before.num_tokens[nxt]} tokens) was waiting next and "
                        f"still fit ({left} tokens left): keep admitting while prompts fit.")
    missing = [rid for rid in before.running if rid not in decodes]
    if not prefills and missing:
        watch.fail(out, f"Requests {missing} were running but got no token in this decode step.")


def check_phase_separated_scheduler(scheduler_cls: type, exercise: str = "4.1") -> None:
    """``scheduler_cls``: a ``Scheduler`` subclass whose ``schedule()`` is the v0 policy."""
    ex, cls = _scheduler_exercise(scheduler_cls, exercise, V0_CONVENTION, V0_HELPERS)
    watch = _Watch(ex, cls, V0_WORKLOAD, _check_v0_step)
    ex.passed(f"{scheduler_cls.__name__} kept every one of {watch.steps} steps to a single "
              "phase, gave waiting prompts priority, and the engine's outputs equal the "
              f"reference scheduler's for all {len(V0_WORKLOAD.arrivals)} requests.")


def _check_v1_step(sched: Scheduler, before: Before, out, watch: _Watch) -> None:
    scheduled, preempted = list(out.num_scheduled_tokens), sorted(out.preempted_req_ids)
    if preempted:  # first: a preempted request's problems explain the others
        _check_preemptions(sched, before, out, watch, preempted, scheduled)
    entries = _check_common(sched, out, watch)
    watch.mixed_steps += {decode for _, _, _, decode in entries} == {True, False}
    budget_left = sched.max_num_batched_tokens - out.total_num_scheduled_tokens
    admitted = [rid for rid in scheduled if rid not in before.running]
    if admitted and preempted:
        watch.fail(out, f"It admitted {admitted} in a step that had to preempt: admit nobody new "
                        "then.")
    if admitted != before.waiting[:len(admitted)]:
        watch.fail(out, f"The waiting queue was {before.waiting}: admit from its head, in order.")
    skipped = [rid for rid in before.running if rid not in scheduled and rid not in preempted]
    if skipped and (admitted or budget_left > 0):
        though = f"{admitted} were admitted" if admitted else f"{budget_left} tokens were left"
        watch.fail(out, f"Requests {skipped} were running and got no tokens though {though}: "
                        "running requests come first (a decode stalls otherwise).")
    if (watch.workload.ample_kv and not preempted and budget_left > 0 and sched.waiting
            and len(sched.running) < sched.max_num_seqs):
        watch.fail(out, f"{budget_left} tokens of budget were left and request "
                        f"{sched.waiting[0].request_id!r} was waiting, with room for it: a "
                        "waiting prompt gets whatever budget is left, even part of its prompt.")


def _check_preemptions(sched, before: Before, out, watch: _Watch, preempted, scheduled) -> None:
    watch.preemptions += len(preempted)
    strangers = [rid for rid in preempted if rid not in before.running]
    if strangers:
        watch.fail(out, f"It preempted {strangers}, which were not running when the step began.")
    latest = before.running[len(before.running) - len(preempted):]
    if set(preempted) != set(latest):
        watch.fail(out, f"The running queue was {before.running} and it preempted {preempted}; "
                        f"expected the {len(preempted)} latest arrival(s) {latest}: the victim "
                        "is the latest-arrived running request, self.running.pop().")
    for rid in preempted:  # (broken, what is wrong) rows: the first broken one fails
        request, blocks = sched.requests[rid], len(sched.kv_cache_manager.get_blocks(rid))
        for broken, wrong in (
                (rid in scheduled, "was both preempted and scheduled in this step"),
                (request in sched.running, "was preempted but is still in self.running"),
                (blocks, f"was preempted but still holds {blocks} KV blocks"),
                (request.num_computed_tokens, ("was preempted but its num_computed_tokens is "
                 f"still {request.num_computed_tokens}: reset num_computed_tokens to 0")),
                (request.status not in (RequestStatus.PREEMPTED, RequestStatus.WAITING),
                 f"was preempted but its status is {request.status.name}")):
            if broken:
                watch.fail(out, f"Request {rid!r} {wrong}. {PREEMPT_CONVENTION}")
    front = [r.request_id for r in list(sched.waiting)[:len(preempted)]]
    in_order = sorted(preempted, key=before.running.index)
    if front != in_order:
        watch.fail(out, f"After the step the waiting queue begins {front}; expected {in_order} "
                        f"(self.waiting.appendleft(request)). {PREEMPT_CONVENTION}")
    if sched.num_preemptions != watch.preemptions:
        watch.fail(out, f"{watch.preemptions} preemption(s) so far, but self.num_preemptions is "
                        f"{sched.num_preemptions}. {PREEMPT_CONVENTION}")


def check_unified_scheduler(scheduler_cls: type, exercise: str = "5.1") -> None:
    """``scheduler_cls``: a ``Scheduler`` subclass whose ``schedule()`` is the v1 policy."""
    ex, cls = _scheduler_exercise(scheduler_cls, exercise, V1_CONVENTION, V1_HELPERS)
    steps = 0
    for workload in (CHUNK_WORKLOAD, PREEMPT_WORKLOAD):
        watch = _Watch(ex, cls, workload, _check_v1_step)
        if workload is CHUNK_WORKLOAD and not watch.mixed_steps:
            ex.fail(f"workload '{workload.name}': no step ran a prefill chunk beside a decode.")
        if not workload.ample_kv and not watch.preemptions:
            ex.fail(f"workload '{workload.name}': the KV cache is too small for all the requests "
                    "at once, yet nothing was preempted.")
        steps += watch.steps
    ex.passed(f"{scheduler_cls.__name__} respected the token budget in all {steps} steps, "
              "ran prefill chunks beside decodes, preempted the latest arrivals and requeued "
              "them first, and the engine's outputs equal the reference scheduler's on both "
              "workloads.")


def _scheduler_exercise(cls, exercise: str, convention: str, helpers) -> tuple[Exercise, type]:
    """The exercise, and the learner's class taken (the package's policy refused)."""
    allowed = ALLOWED + ("" if helpers is V1_HELPERS else
                         " and self._preempt (the preemption step the exercise gives)")
    ex = Exercise(exercise, convention, helpers, allowed, required=("schedule",))
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        ex.fail("expected a subclass of minivllm.core.scheduler.Scheduler (the class, not an "
                f"instance), got {cls!r}")
    return ex, ex.take(cls, "scheduler")
