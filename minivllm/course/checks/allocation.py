"""Checker for chapter 03's exercise 3.1: a request's block table growing, ``allocate_slots``.

The learner's ``KVCacheManager`` subclass writes ``allocate_slots`` (prefix caching off: the
last two arguments are 0 and empty). Small scenarios and random grow / free / run-out calls on
a bare manager are compared with the rule, with a hint for each classic mistake (rounding down,
allocating past the free blocks or partly before refusing, counting all the blocks instead of
the new ones); then the real engine with too few blocks (requests grow, finish, get preempted):
every step's block tables, the free blocks and every greedy output must be the package's. The
package's ``allocate_slots`` is refused (called, inherited or through ``super()``).
"""

from __future__ import annotations

import functools

import numpy as np

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.course.checks.common import Delegated, Exercise, check_engine, fail, passed
from minivllm.utils import cdiv

CONVENTION = (
    "Expected: after this step the request holds num_computed_tokens + num_new_computed_tokens "
    "+ num_new_tokens tokens, which need ceil(tokens / block_size) blocks; it needs that many "
    "minus the blocks it already holds (self.req_to_blocks[request.request_id]) new ones. If "
    "the pool has fewer free blocks than that (self.block_pool.get_num_free_blocks()), return "
    "None and take nothing; otherwise take them with self.block_pool.get_new_blocks(n), append "
    "them to the request's list and return the new blocks (an empty list when none are needed).")


ANSWER = ("minivllm.core.kv_cache_manager:KVCacheManager.allocate_slots",)
ALLOWED = ("self.req_to_blocks, self.block_size and self.block_pool (get_num_free_blocks, "
           "get_new_blocks)")


def check_allocate_slots(kv_cache_manager_cls: type, exercise: str = "3.1", seed: int = 0) -> None:
    """``kv_cache_manager_cls``: a ``KVCacheManager`` subclass with its own ``allocate_slots``."""
    kv_cache_manager_cls = Exercise(exercise, CONVENTION, ANSWER, ALLOWED,
                                    required=("allocate_slots",)).take(
        kv_cache_manager_cls, "allocate_slots")
    reference = _reference_run(seed)
    cases = _scenarios(kv_cache_manager_cls, exercise) + _random_calls(
        kv_cache_manager_cls, exercise, seed)
    got = _engine_run(kv_cache_manager_cls, exercise, seed)
    _compare_runs(exercise, reference, got)
    steps, preempted = len(reference["steps"]), reference["preemptions"]
    passed(exercise, f"allocate_slots follows the rule on {cases} calls, and the engine using it "
                     f"({steps} steps, {reference['num_blocks']} KV blocks, {preempted} "
                     f"preemptions) holds the package's blocks after every step and generates "
                     f"the reference tokens.")


# -- calls on a bare manager ---------------------------------------------------------------------

class _Ledger:
    """The learner's manager and what the rule says it should hold."""

    def __init__(self, cls: type, exercise: str, num_blocks: int, block_size: int) -> None:
        self.exercise, self.block_size = exercise, block_size
        self.manager = cls(num_blocks, block_size, enable_caching=False)
        if not isinstance(self.manager, KVCacheManager):
            fail(exercise, f"{cls.__name__} is not a KVCacheManager subclass: subclass it and "
                           f"write allocate_slots (the engine calls the rest of its methods).")
        self.held: dict[str, int] = {}  # request id -> blocks it should hold
        self.requests: dict[str, Request] = {}

    def free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def call(self, rid: str, num_computed: int, num_new: int, what: str, **extra) -> bool:
        """``allocate_slots`` for request ``rid`` with ``num_computed`` tokens already computed;
        False if it (rightly) refused."""
        request = self.requests.setdefault(rid, Request.from_prompt(rid, list(range(100, 100 + 1))))
        request.num_computed_tokens = num_computed
        bs, held, free = self.block_size, self.held.get(rid, 0), self.free_blocks()
        total = num_computed + num_new
        need = max(0, cdiv(total, bs) - held)
        refuse = need > free
        situation = (f"{what}: request {rid!r} holds {held} blocks of {bs} tokens, has "
                     f"{num_computed} computed tokens and asks for {num_new} more ({total} in "
                     f"all), and the pool has {free} free")
        try:
            got = self.manager.allocate_slots(request, num_new, **extra)
        except Delegated:
            raise
        except TypeError as e:
            if extra:
                fail(self.exercise, f"{situation}; allocate_slots(request, num_new_tokens, "
                                    f"num_new_computed_tokens=0, new_computed_blocks=[]) raised "
                                    f"{e!r}: accept those two arguments too (the scheduler names "
                                    f"them; with caching off they are 0 and empty).")
            raise
        except ValueError as e:
            if refuse:
                fail(self.exercise, f"{situation}: it needs {need} new blocks, more than are free, "
                                    f"and your allocate_slots raised {e!r}. Check the free blocks "
                                    f"first and return None, taking nothing. {CONVENTION}")
            raise
        now_held = len(self.manager.get_block_ids(rid))
        now_free = self.free_blocks()
        if refuse:
            if got is not None:
                fail(self.exercise, f"{situation}: it needs {need} new blocks, more than are free; "
                                    f"expected None, got {_shown(got)}. {CONVENTION}")
            if now_free != free or now_held != held:
                fail(self.exercise, f"{situation}: it needs {need} new blocks, more than are "
                                    f"free. Your allocate_slots returned None but took "
                                    f"{_blocks(free - now_free)} from the pool (the request now "
                                    f"holds {now_held}): a refusal takes nothing, or those "
                                    f"blocks leak. {CONVENTION}")
            return False
        if got is None:
            fail(self.exercise, f"{situation}: it needs {need} new blocks and they are free; "
                                f"expected them, got None. {CONVENTION}")
        if now_held != held + need or now_free != free - need:
            fail(self.exercise, f"{situation}: expected it to take {need} new blocks "
                                f"(ceil({total} / {bs}) = {cdiv(total, bs)} in all), it took "
                                f"{free - now_free} and the request now holds {now_held}. "
                                f"{_hint(held, total, bs, now_held)}{CONVENTION}")
        try:
            returned = len(got)
        except TypeError:
            returned = None
        if returned != need:
            fail(self.exercise, f"{situation}: allocate_slots took the right blocks but returned "
                                f"{_shown(got)}; expected the list of the {need} new blocks. "
                                f"{CONVENTION}")
        self.held[rid] = held + need
        return True

    def free(self, rid: str) -> None:
        self.manager.free(self.requests.pop(rid))
        self.held.pop(rid, None)


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _shown(got) -> str:
    try:
        return f"a list of {len(got)} blocks"
    except TypeError:
        return repr(got)


def _hint(held: int, total: int, bs: int, now_held: int) -> str:
    if total % bs and now_held == total // bs:
        return ("Hint: that is floor(tokens / block_size) blocks: a partly filled last block is "
                "a block too, round up. ")
    if held and now_held == held + cdiv(total, bs):
        return (f"Hint: that is {cdiv(total, bs)} new blocks on top of the {held} it held: the "
                f"blocks it already holds count. ")
    if total % bs == 0 and now_held == total // bs + 1:
        return ("Hint: that is tokens // block_size + 1 blocks, one too many when the tokens fill "
                "their last block exactly. ")
    return ""


def _scenarios(cls: type, exercise: str) -> int:
    """The classic cases, each with its hint."""
    led = _Ledger(cls, exercise, num_blocks=10, block_size=4)
    led.call("a", 0, 9, "a new request's 9-token prompt")  # 3 blocks (not 2: round up)
    led.call("a", 9, 1, "its first decode")  # 10 tokens in 3 blocks: nothing new
    led.call("a", 10, 2, "2 more tokens")  # 12 tokens fill 3 blocks exactly: nothing new
    led.call("a", 12, 1, "one more")  # the 13th token needs a 4th block
    led.call("b", 0, 8, "a prompt of exactly 2 blocks")  # 2, not 3
    led.call("c", 0, 12, "a prompt of 3 blocks", num_new_computed_tokens=0,
             new_computed_blocks=[])  # cache-hit arguments accepted; 9 of 10 blocks now held
    led.call("b", 8, 8, "no room (2 new blocks needed, 1 free)")  # refused, nothing taken
    led.call("d", 0, 5, "a new request with no room")  # refused
    led.call("c", 12, 4, "exactly enough room (1 needed, 1 free)")  # taken
    led.free("a")
    led.call("d", 0, 5, "a new request after another finished")  # 2 blocks
    return 10


def _random_calls(cls: type, exercise: str, seed: int, num_calls: int = 300) -> int:
    """Requests growing by prefill chunks and decodes, finishing, and running out of blocks."""
    rng = np.random.default_rng(seed)
    led = _Ledger(cls, exercise, num_blocks=24, block_size=int(rng.choice([2, 4, 8])))
    computed: dict[str, int] = {}
    next_id = 0
    for _ in range(num_calls):
        op = rng.random()
        if computed and op < 0.12:
            rid = str(rng.choice(sorted(computed)))
            led.free(rid)
            del computed[rid]
            continue
        if not computed or op < 0.3:
            rid = f"r{next_id}"
            next_id += 1
            computed[rid] = 0
        else:
            rid = str(rng.choice(sorted(computed)))
        n = 1 if rng.random() < 0.5 else int(rng.integers(1, 40))
        if led.call(rid, computed[rid], n, "a random call"):
            computed[rid] += n  # granted: those tokens are computed in this step
        elif computed[rid] == 0:
            led.free(rid)  # refused at admission: it holds nothing and waits
            del computed[rid]
    return num_calls


# -- the real engine ------------------------------------------------------------------------------

ENGINE_SETTINGS = dict(enable_prefix_caching=False, num_kv_blocks=14, max_num_batched_tokens=32,
                       max_num_seqs=8, scheduler="v1")


def _workload(seed: int):
    """(step, request id, prompt token ids, max_tokens): more than 14 blocks of 8 tokens hold."""
    rng = np.random.default_rng(seed)
    vocab = check_engine().llm_engine.config.model_config.hf_config.vocab_size
    arrivals, step = [], 0
    for i in range(8):
        prompt = rng.integers(10, vocab, int(rng.integers(3, 40))).tolist()
        arrivals.append((step, f"r{i}", prompt, int(rng.integers(4, 24))))
        step += int(rng.integers(0, 4))
    return arrivals


@functools.lru_cache(maxsize=None)
def _reference_run(seed: int) -> dict:
    return _engine_run(None, "reference", seed)


def _engine_run(cls: type | None, exercise: str, seed: int) -> dict:
    """Run the workload with ``cls`` (None: the package's manager) as the KV cache manager;
    after each step record the blocks each request holds and the free blocks."""
    from minivllm import SamplingParams
    from minivllm.course.swap import swapped_scheduler

    llm = check_engine()
    engine = llm.llm_engine
    arrivals = _workload(seed)
    last = max(a[0] for a in arrivals)
    steps, outputs = [], {}
    with swapped_scheduler(llm, kv_cache_manager_cls=cls, **ENGINE_SETTINGS) as scheduler:
        manager = scheduler.kv_cache_manager
        for step in range(400):
            for at, rid, prompt, max_tokens in arrivals:
                if at == step:
                    engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(
                        temperature=0, max_tokens=max_tokens, ignore_eos=True))
            if step > last and not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            held = {rid: len(manager.get_block_ids(rid)) for rid in scheduler.requests}
            steps.append(({k: v for k, v in held.items() if v}, manager.get_num_free_blocks()))
        else:
            fail(exercise, "the engine did not finish the workload in 400 steps with your "
                           "allocate_slots: requests never got their blocks. " + CONVENTION)
        preemptions = scheduler.num_preemptions
    return dict(steps=steps, outputs=outputs, preemptions=preemptions,
                num_blocks=ENGINE_SETTINGS["num_kv_blocks"])


def _compare_runs(exercise: str, expected: dict, got: dict) -> None:
    where = (f"in the engine ({expected['num_blocks']} KV blocks of 8 tokens, caching off, "
             f"a workload that outgrows them)")
    for i, ((e_held, e_free), (g_held, g_free)) in enumerate(zip(expected["steps"], got["steps"])):
        if g_held != e_held or g_free != e_free:
            fail(exercise, f"{where}, after step {i + 1}: the requests hold {g_held} blocks and "
                           f"{g_free} are free; expected {e_held} and {e_free} free (the "
                           f"package's allocate_slots). {CONVENTION}")
    if len(got["steps"]) != len(expected["steps"]):
        fail(exercise, f"{where}: the workload took {len(got['steps'])} steps, expected "
                       f"{len(expected['steps'])}. {CONVENTION}")
    if got["outputs"] != expected["outputs"]:
        bad = sorted(r for r, tokens in expected["outputs"].items()
                     if got["outputs"].get(r) != tokens)
        fail(exercise, f"{where}: requests {bad} generated other tokens than with the package's "
                       f"allocate_slots. {CONVENTION}")

