"""Checkers for chapters 04 and 05: a learner's ``schedule()`` running the real engine.

The learner's ``Scheduler`` subclass is swapped into an engine on the check model
(``minivllm.course.swap``) and replays a workload whose requests arrive at fixed steps. A probe
subclass checks each step against the policy (phases mixed, budget exceeded, the wrong request
preempted, ...), naming the step and the rule; every greedy output must equal the package
scheduler's. The package's scheduling helpers (``_try_admit``, ``_allocate_or_preempt``, in 5.1
``_preempt``, its ``schedule()``, its v0 scheduler) are refused. Any implementation of the
policy passes; only what the engine can observe is checked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from minivllm.core.request import RequestStatus
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler
from minivllm.core.sched_output import SchedulerOutput
from minivllm.course.checks.common import (
    ENGINE_PROMPTS, Exercise, check_engine, fail, passed,
)

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

LONG_PROMPT = (
    "A serving engine runs one step after another. In each step the scheduler decides which "
    "requests run and how many of their tokens the model computes; the model runner turns that "
    "decision into one flat batch of tokens, runs the forward pass over the paged KV cache and "
    "samples one new token for every request whose known tokens are now all computed. A long "
    "prompt that arrives while many users are chatting is the hard case: computing it in one "
    "step makes every chat wait, so how should its tokens be shared out between steps?"
)


@dataclass(frozen=True)
class Workload:
    """Requests arriving at given steps of an engine configured by ``overrides``."""

    name: str
    overrides: tuple[tuple[str, object], ...]
    arrivals: tuple[tuple[int, str, int, int], ...]  # (step, request id, prompt index, max_tokens)
    ample_kv: bool = True  # every request always fits in the KV cache (no preemption needed)


PROMPTS = (*ENGINE_PROMPTS, LONG_PROMPT)

V0_WORKLOAD = Workload(
    "v0: chats decoding, prompts arriving, at most 3 running",
    (("scheduler", "v0"), ("max_num_batched_tokens", 1024), ("max_num_seqs", 3)),
    ((0, "chat-0", 0, 4), (0, "chat-1", 1, 10), (0, "chat-2", 2, 12), (0, "chat-3", 3, 8),
     (3, "long", 4, 4), (6, "chat-4", 2, 6)),
)

CHUNK_WORKLOAD = Workload(
    "v1: a budget of 24 tokens, chunks of at most 16, a long prompt arriving among chats",
    (("scheduler", "v1"), ("max_num_batched_tokens", 24), ("long_prefill_token_threshold", 16),
     ("max_num_seqs", 8)),
    ((0, "chat-0", 0, 12), (0, "chat-1", 1, 12), (0, "chat-2", 2, 12), (2, "long", 4, 4),
     (4, "chat-3", 3, 10)),
)

PREEMPT_WORKLOAD = Workload(
    "v1: 9 KV blocks of 8 tokens for 5 growing requests (preemption needed)",
    (("scheduler", "v1"), ("max_num_batched_tokens", 32), ("num_kv_blocks", 9),
     ("max_num_seqs", 8)),
    ((0, "chat-0", 0, 24), (0, "chat-1", 1, 24), (0, "chat-2", 2, 24), (0, "chat-3", 3, 24),
     (6, "chat-4", 2, 8)),
    ample_kv=False,
)


# -- the package's own policy, refused while the learner's class is graded -------------------

ALLOWED = "self.kv_cache_manager, self.record_admission, self.make_scheduler_output"
# 4.1 is given preemption's state change (self._preempt); 5.1 writes it (preempt_request)
V0_HELPERS = ("minivllm.core.scheduler:Scheduler.schedule",
              "minivllm.core.scheduler:Scheduler._try_admit",
              "minivllm.core.scheduler:Scheduler._allocate_or_preempt",
              "minivllm.core.scheduler_v0:PhaseSeparatedScheduler")
V1_HELPERS = V0_HELPERS + ("minivllm.core.scheduler:Scheduler._preempt",)


def _run_learner(scheduler_cls: type, watch: "Watch", check_step, helpers) -> dict:
    allowed = ALLOWED + ("" if "minivllm.core.scheduler:Scheduler._preempt" in helpers else
                         " and self._preempt (the preemption step the exercise gives)")
    scheduler_cls = Exercise(watch.exercise, answer=helpers, allowed=allowed,
                             required=("schedule",)).take(scheduler_cls, "scheduler")
    return run_workload(_probe(scheduler_cls, watch, check_step), watch.workload, watch.exercise)


# -- running a workload ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _prompt_ids(index: int) -> tuple[int, ...]:
    return tuple(check_engine().get_tokenizer().encode(PROMPTS[index]))


def run_workload(scheduler_cls: type, workload: Workload, exercise: str) -> dict[str, list[int]]:
    """Run ``workload`` with ``scheduler_cls`` in the check engine; return {request id: output
    token ids}. Fails if the requests do not all finish within MAX_STEPS steps."""
    from minivllm import SamplingParams
    from minivllm.course.swap import swapped_scheduler

    llm = check_engine()
    engine = llm.llm_engine
    outputs: dict[str, list[int]] = {}
    last_arrival = max(step for step, *_ in workload.arrivals)
    with swapped_scheduler(llm, scheduler_cls=scheduler_cls, **dict(workload.overrides)):
        for step in range(MAX_STEPS):
            for at, rid, prompt, max_tokens in workload.arrivals:
                if at == step:
                    engine.add_request(rid, {"prompt_token_ids": list(_prompt_ids(prompt))},
                                       SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True))
            if step > last_arrival and not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        else:
            unfinished = sorted(set(rid for _, rid, _, _ in workload.arrivals) - set(outputs))
            fail(exercise, f"workload '{workload.name}': after {MAX_STEPS} engine steps, requests "
                           f"{unfinished} are still unfinished: the scheduler stopped making "
                           f"progress (a step that schedules nothing, or a request never "
                           f"admitted).")
    return outputs


@functools.lru_cache(maxsize=None)
def reference_outputs(workload: Workload) -> dict:
    cls = PhaseSeparatedScheduler if dict(workload.overrides)["scheduler"] == "v0" else Scheduler
    return run_workload(cls, workload, "reference")


def _compare_outputs(exercise: str, workload: Workload, got: dict) -> None:
    expected = reference_outputs(workload)
    tok = check_engine().get_tokenizer()
    for rid, e in expected.items():
        g = got.get(rid)
        if g != e:
            fail(exercise, f"workload '{workload.name}': request {rid!r} generated "
                           f"{tok.decode(g or [])!r}, expected {tok.decode(e)!r} (what the "
                           f"package's scheduler produces). The schedule passed every per-step "
                           f"check, so look at how tokens are counted: a request must compute "
                           f"exactly the tokens from num_computed_tokens on.")


# -- watching the learner's scheduler step by step ---------------------------------------------

@dataclass
class Before:
    """The queues just before a ``schedule()`` call."""

    running: list[str]
    waiting: list[str]
    num_tokens: dict[str, int]


@dataclass
class Watch:
    """What the probe saw over a whole run."""

    exercise: str
    workload: Workload
    steps: int = 0
    mixed_steps: int = 0  # steps with a prefill chunk and a decode side by side
    preemptions: int = 0

    def fail(self, out, message: str) -> None:
        fail(self.exercise, f"workload '{self.workload.name}', step {self.steps}: the step "
                            f"scheduled {_show(out)}. {message}")


class Entry(NamedTuple):
    """One request's share of a step, as the checks read it."""

    request_id: str
    num_tokens: int  # tokens it computes this step
    num_computed_tokens: int  # before this step


def _entries(sched: Scheduler, out) -> list[Entry]:
    """The step's entries, read right after ``schedule()`` (which already advanced each
    request's ``num_computed_tokens`` past them)."""
    return [Entry(rid, n, sched.requests[rid].num_computed_tokens - n)
            for rid, n in out.num_scheduled_tokens.items()]


def _show(out) -> str:
    shown = dict(out.num_scheduled_tokens)
    if out.preempted_req_ids:
        return f"{shown} and preempted {sorted(out.preempted_req_ids)}"
    return str(shown) if shown else "nothing"


def _is_decode(sched: Scheduler, s) -> bool:
    request = sched.requests[s.request_id]
    return s.num_tokens == 1 and s.num_computed_tokens >= request.num_prompt_tokens


def _probe(cls: type, watch: Watch, check_step) -> type:
    """A subclass of the learner's class that checks every ``schedule()`` as it returns."""

    class Probe(cls):
        def schedule(self):
            before = Before(
                running=[r.request_id for r in self.running],
                waiting=[r.request_id for r in self.waiting],
                num_tokens={rid: r.num_tokens for rid, r in self.requests.items()},
            )
            out = super().schedule()
            watch.steps += 1
            check_step(self, before, out, watch)
            return out

    Probe.__name__ = Probe.__qualname__ = cls.__name__
    return Probe


def _check_common(sched: Scheduler, before: Before, out, watch: Watch) -> None:
    """What any scheduler must respect: the budget, max_num_seqs, sane token counts."""
    if not isinstance(out, SchedulerOutput):
        fail(watch.exercise, f"schedule() returned {type(out).__name__}; expected a "
                             f"SchedulerOutput (build it with self.make_scheduler_output(entries, "
                             f"preempted)).")
    total = out.total_num_scheduled_tokens
    if total > sched.max_num_batched_tokens:
        watch.fail(out, f"That is {total} tokens, over the step's budget max_num_batched_tokens="
                        f"{sched.max_num_batched_tokens}: subtract what each request gets from "
                        f"the budget, and never give a request more than is left.")
    if len(sched.running) > sched.max_num_seqs:
        watch.fail(out, f"{len(sched.running)} requests are now running, over max_num_seqs="
                        f"{sched.max_num_seqs}: admit a waiting request only while "
                        f"len(self.running) < self.max_num_seqs.")


def _check_entries(sched: Scheduler, out, watch: Watch) -> None:
    """Every scheduled request is running and gets between 1 and what it has left."""
    for s in _entries(sched, out):
        request = sched.requests.get(s.request_id)
        if request is None or request not in sched.running:
            watch.fail(out, f"Request {s.request_id!r} was scheduled but is not in self.running: "
                            f"a scheduled request must be running (admitting moves it there).")
        left = request.num_tokens - s.num_computed_tokens
        if not 1 <= s.num_tokens <= left:
            watch.fail(out, f"Request {s.request_id!r} got {s.num_tokens} tokens with {left} "
                            f"left to compute: give each scheduled request between 1 and "
                            f"num_tokens - num_computed_tokens tokens.")


# -- Exercise 4.1: the phase-separated (v0) scheduler ------------------------------------------

def _check_v0_step(sched: Scheduler, before: Before, out, watch: Watch) -> None:
    _check_common(sched, before, out, watch)
    _check_entries(sched, out, watch)
    if out.preempted_req_ids:
        watch.fail(out, "Nothing needed preempting (the KV cache has room for every request). "
                        + V0_CONVENTION)
    entries = _entries(sched, out)
    decodes = [s.request_id for s in entries if _is_decode(sched, s)]
    prefills = [s for s in entries if not _is_decode(sched, s)]
    if decodes and prefills:
        watch.fail(out, f"It mixes the prefill of {[s.request_id for s in prefills]} with the "
                        f"decodes of {decodes}: in v0 a step is all-prefill or all-decode. "
                        + V0_CONVENTION)
    for s in prefills:
        request = sched.requests[s.request_id]
        if s.num_computed_tokens + s.num_tokens != request.num_tokens:
            watch.fail(out, f"Request {s.request_id!r} got {s.num_tokens} of its "
                            f"{request.num_tokens - s.num_computed_tokens} prompt tokens: v0 "
                            f"prefills whole prompts (no chunking: admit all of a request's "
                            f"uncached tokens, or none). " + V0_CONVENTION)
    head = before.waiting[0] if before.waiting else None
    head_fits = (head is not None and len(before.running) < sched.max_num_seqs
                 and before.num_tokens[head] <= sched.max_num_batched_tokens)
    if head_fits and head not in [s.request_id for s in prefills]:
        watch.fail(out, f"Request {head!r} was at the head of the waiting queue and fit, but the "
                        f"step did not prefill it: waiting prompts take priority over decodes. "
                        + V0_CONVENTION)
    admitted = [s.request_id for s in prefills]
    if admitted != before.waiting[:len(admitted)]:
        watch.fail(out, f"The waiting queue was {before.waiting}: admit from its head, in order "
                        f"(first come, first served). " + V0_CONVENTION)
    if prefills:
        left = sched.max_num_batched_tokens - sum(s.num_tokens for s in prefills)
        nxt = before.waiting[len(admitted)] if len(before.waiting) > len(admitted) else None
        room = len(sched.running) < sched.max_num_seqs
        if nxt is not None and room and before.num_tokens[nxt] <= left:
            watch.fail(out, f"Request {nxt!r} ({before.num_tokens[nxt]} tokens) was waiting next "
                            f"and still fit ({left} tokens of budget left, "
                            f"{len(sched.running)} < max_num_seqs={sched.max_num_seqs}): keep "
                            f"admitting while prompts fit. " + V0_CONVENTION)
    else:
        missing = [rid for rid in before.running if rid not in decodes]
        if missing:
            watch.fail(out, f"Requests {missing} were running but got no token in this decode "
                            f"step: a decode step gives every running request one token. "
                            + V0_CONVENTION)


def check_phase_separated_scheduler(scheduler_cls: type, exercise: str = "4.1") -> None:
    """``scheduler_cls``: a ``Scheduler`` subclass whose ``schedule()`` is the v0 policy."""
    _check_is_scheduler(scheduler_cls, exercise)
    watch = Watch(exercise, V0_WORKLOAD)
    got = _run_learner(scheduler_cls, watch, _check_v0_step, V0_HELPERS)
    _compare_outputs(exercise, V0_WORKLOAD, got)
    passed(exercise, f"{scheduler_cls.__name__} kept every one of {watch.steps} steps to a single "
                     f"phase, gave waiting prompts priority, and the engine's outputs equal the "
                     f"reference scheduler's for all {len(got)} requests.")


# -- Exercise 5.1: the unified (v1) scheduler --------------------------------------------------

def _check_v1_step(sched: Scheduler, before: Before, out, watch: Watch) -> None:
    _check_common(sched, before, out, watch)
    entries = _entries(sched, out)
    scheduled = {s.request_id: s for s in entries}
    threshold = sched.long_prefill_token_threshold
    for s in entries:
        if threshold and s.num_tokens > threshold:
            watch.fail(out, f"Request {s.request_id!r} got a chunk of {s.num_tokens} tokens, over "
                            f"long_prefill_token_threshold={threshold}. " + V1_CONVENTION)
    preempted = sorted(out.preempted_req_ids)
    if preempted:
        _check_preemptions(sched, before, out, watch, preempted, scheduled)
    _check_entries(sched, out, watch)
    watch.mixed_steps += {_is_decode(sched, s) for s in entries} == {True, False}
    budget_left = sched.max_num_batched_tokens - out.total_num_scheduled_tokens
    admitted = [rid for rid in scheduled if rid not in before.running]
    if admitted and preempted:
        watch.fail(out, f"It admitted {admitted} from the waiting queue in a step that had to "
                        f"preempt: when the KV cache is that full, admit nobody new this step. "
                        + V1_CONVENTION)
    if admitted != before.waiting[:len(admitted)]:
        watch.fail(out, f"The waiting queue was {before.waiting}: admit from its head, in order. "
                        + V1_CONVENTION)
    skipped = [rid for rid in before.running if rid not in scheduled and rid not in preempted]
    if skipped and (admitted or budget_left > 0):
        watch.fail(out, f"Requests {skipped} were running and got no tokens though "
                        + (f"{admitted} were admitted" if admitted else
                           f"{budget_left} tokens of budget were left")
                        + ": running requests come first, each gets its share while budget is "
                          "left (a decode stalls otherwise). " + V1_CONVENTION)
    if (watch.workload.ample_kv and not preempted and budget_left > 0 and sched.waiting
            and len(sched.running) < sched.max_num_seqs):
        watch.fail(out, f"{budget_left} tokens of budget were left and request "
                        f"{sched.waiting[0].request_id!r} was waiting, with room for it: with "
                        f"chunked prefill a waiting prompt gets whatever budget is left, even a "
                        f"part of its prompt. " + V1_CONVENTION)


def _check_preemptions(sched, before: Before, out, watch: Watch, preempted, scheduled) -> None:
    watch.preemptions += len(preempted)
    strangers = [rid for rid in preempted if rid not in before.running]
    if strangers:
        watch.fail(out, f"It preempted {strangers}, which were not running when the step began: "
                        f"only running requests hold blocks to give back. " + V1_CONVENTION)
    latest = before.running[len(before.running) - len(preempted):]
    if set(preempted) != set(latest):
        watch.fail(out, f"The running queue was {before.running} (in arrival order) and it "
                        f"preempted {preempted}; expected the {len(preempted)} latest arrival(s) "
                        f"{latest}: under first-come-first-served the victim is always the "
                        f"latest-arrived running request, self.running.pop(). " + V1_CONVENTION)
    for rid in preempted:
        request = sched.requests[rid]
        if rid in scheduled:
            watch.fail(out, f"Request {rid!r} was both preempted and scheduled in this step: once "
                            f"preempted, it waits. " + PREEMPT_CONVENTION)
        if request in sched.running:
            watch.fail(out, f"Request {rid!r} was preempted but is still in self.running. "
                            + PREEMPT_CONVENTION)
        if sched.kv_cache_manager.get_blocks(rid):
            watch.fail(out, f"Request {rid!r} was preempted but still holds "
                            f"{len(sched.kv_cache_manager.get_blocks(rid))} KV blocks. "
                            + PREEMPT_CONVENTION)
        if request.num_computed_tokens != 0:
            watch.fail(out, f"Request {rid!r} was preempted but its num_computed_tokens is still "
                            f"{request.num_computed_tokens}: its K/V were freed, so nothing of it "
                            f"is computed any more; reset num_computed_tokens to 0. "
                            + PREEMPT_CONVENTION)
        if request.status not in (RequestStatus.PREEMPTED, RequestStatus.WAITING):
            watch.fail(out, f"Request {rid!r} was preempted but its status is "
                            f"{request.status.name}: set it to RequestStatus.PREEMPTED. "
                            + PREEMPT_CONVENTION)
    front = [r.request_id for r in list(sched.waiting)[:len(preempted)]]
    in_order = sorted(preempted, key=before.running.index)
    if front != in_order:
        watch.fail(out, f"After the step the waiting queue begins {front}; expected the "
                        f"preempted requests first, in arrival order: {in_order}. "
                        f"Use self.waiting.appendleft(request) as each is preempted. "
                        + PREEMPT_CONVENTION)
    if sched.num_preemptions != watch.preemptions:
        watch.fail(out, f"{watch.preemptions} preemption(s) so far, but self.num_preemptions is "
                        f"{sched.num_preemptions}: count each one. " + PREEMPT_CONVENTION)


def check_unified_scheduler(scheduler_cls: type, exercise: str = "5.1") -> None:
    """``scheduler_cls``: a ``Scheduler`` subclass whose ``schedule()`` is the v1 policy."""
    _check_is_scheduler(scheduler_cls, exercise)
    steps = 0
    for workload in (CHUNK_WORKLOAD, PREEMPT_WORKLOAD):
        watch = Watch(exercise, workload)
        got = _run_learner(scheduler_cls, watch, _check_v1_step, V1_HELPERS)
        if workload is CHUNK_WORKLOAD and not watch.mixed_steps:
            fail(exercise, f"workload '{workload.name}': no step ran a prefill chunk beside a "
                           f"decode. The point of the unified scheduler is that decodes and "
                           f"prefill chunks share a step. " + V1_CONVENTION)
        if not workload.ample_kv and not watch.preemptions:
            fail(exercise, f"workload '{workload.name}': the KV cache is too small for all the "
                           f"requests at once, yet nothing was preempted. When allocate_slots "
                           f"returns None for a running request, preempt. " + V1_CONVENTION)
        _compare_outputs(exercise, workload, got)
        steps += watch.steps
    passed(exercise, f"{scheduler_cls.__name__} respected the token budget in all {steps} steps, "
                     f"ran prefill chunks beside decodes, preempted the latest arrivals and "
                     f"requeued them first, and the engine's outputs equal the reference "
                     f"scheduler's on both workloads.")


def _check_is_scheduler(cls, exercise: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        fail(exercise, f"expected a subclass of minivllm.core.scheduler.Scheduler (the class, "
                       f"not an instance), got {cls!r}")

