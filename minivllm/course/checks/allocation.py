"""Checker for exercise 3.1, ``KVCacheManager.allocate_slots`` (caching off): scenarios and random
calls on a bare manager, then the engine with too few blocks, step by step beside the package's."""

from __future__ import annotations

import functools
from collections import namedtuple

import numpy as np

from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.course.checks.common import Exercise, check_engine
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
# blocks held before a call, tokens after it, the block size, blocks the learner's manager holds
_Grown = namedtuple("_Grown", "held tokens block_size now")
MISTAKES = [
    (lambda g: g.tokens % g.block_size and g.now == g.tokens // g.block_size,
     ("that is floor(tokens / block_size) blocks: a partly filled last block is a block too, "
      "round up.")),
    (lambda g: g.held and g.now == g.held + cdiv(g.tokens, g.block_size),
     ("that is ceil(tokens / block_size) new blocks on top of those it held: the blocks it "
      "already holds count.")),
    (lambda g: g.tokens % g.block_size == 0 and g.now == g.tokens // g.block_size + 1,
     ("that is tokens // block_size + 1 blocks, one too many when the tokens fill their last "
      "block exactly.")),
]
# (request, computed tokens, new tokens, what[, pass the cache-hit arguments]); None: "a" finishes
SCENARIOS = [
    ("a", 0, 9, "a new request's 9-token prompt"),  # 3 blocks (not 2: round up)
    ("a", 9, 1, "its first decode"),  # 10 tokens in 3 blocks: nothing new
    ("a", 10, 2, "2 more tokens"),  # 12 tokens fill 3 blocks exactly: nothing new
    ("a", 12, 1, "one more"),  # the 13th token needs a 4th block
    ("b", 0, 8, "a prompt of exactly 2 blocks"),  # 2, not 3
    ("c", 0, 12, "a prompt of 3 blocks", True),  # 9 of 10 blocks now held
    ("b", 8, 8, "no room (2 new blocks needed, 1 free)"),  # refused, nothing taken
    ("d", 0, 5, "a new request with no room"),  # refused
    ("c", 12, 4, "exactly enough room (1 needed, 1 free)"),  # taken
    None,
    ("d", 0, 5, "a new request after another finished"),  # 2 blocks
]
NUM_RANDOM_CALLS = 300
ENGINE_SETTINGS = {"enable_prefix_caching": False, "num_kv_blocks": 14,
                   "max_num_batched_tokens": 32, "max_num_seqs": 8, "scheduler": "v1"}


def check_allocate_slots(kv_cache_manager_cls: type, exercise: str = "3.1", seed: int = 0) -> None:
    """``kv_cache_manager_cls``: a ``KVCacheManager`` subclass with its own ``allocate_slots``."""
    ex = Exercise(exercise, CONVENTION, ANSWER, ALLOWED, required=("allocate_slots",))
    cls = ex.take(kv_cache_manager_cls, "allocate_slots")
    led = _Ledger(ex, cls, num_blocks=10, block_size=4)
    for row in SCENARIOS:
        if row is None:
            led.free("a")
        else:
            led.call(*row)
    _random_calls(ex, cls, seed)
    expected, got = _reference_run(seed), _engine_run(cls, seed)
    if len(got["outputs"]) < len(expected["outputs"]):
        ex.fail("the engine did not finish the workload in 400 steps with your allocate_slots: "
                "requests never got their blocks.")
    blocks = ENGINE_SETTINGS["num_kv_blocks"]
    where = (f"in the engine ({blocks} KV blocks of 8 tokens, caching off, a workload that "
             "outgrows them)")
    ex.compare_lists(f"{where}, ({{request: blocks it holds}}, free blocks) after each step "
                     "(item i: after step i + 1)", got["steps"], expected["steps"])
    bad = sorted(r for r, t in expected["outputs"].items() if got["outputs"].get(r) != t)
    if bad:
        ex.fail(f"{where}: requests {bad} generated other tokens than with the package's "
                "allocate_slots.")
    ex.passed(f"allocate_slots follows the rule on {len(SCENARIOS) - 1 + NUM_RANDOM_CALLS} calls, "
              f"and the engine using it ({len(expected['steps'])} steps, {blocks} KV blocks, "
              f"{expected['preemptions']} preemptions) holds the package's blocks after every "
              "step and generates the reference tokens.")


class _Ledger:
    """The learner's manager, and the blocks the rule says each request holds."""

    def __init__(self, ex: Exercise, cls: type, num_blocks: int, block_size: int) -> None:
        self.ex, self.bs, self.held, self.requests = ex, block_size, {}, {}
        self.manager = cls(num_blocks, block_size, enable_caching=False)
        if not isinstance(self.manager, KVCacheManager):
            ex.fail(f"{cls.__name__} is not a KVCacheManager subclass: subclass it and write "
                    "allocate_slots (the engine calls the rest of its methods).")

    def call(self, rid: str, computed: int, new: int, what: str, hit_args: bool = False) -> bool:
        """``allocate_slots`` for ``new`` tokens after ``computed``; False if rightly refused."""
        request = self.requests.setdefault(rid, Request.from_prompt(rid, [100]))
        request.num_computed_tokens = computed
        pool, ex, bs = self.manager.block_pool, self.ex, self.bs
        held, free, total = self.held.get(rid, 0), pool.get_num_free_blocks(), computed + new
        need = max(0, cdiv(total, bs) - held)
        where = (f"{what}: request {rid!r} holds {held} blocks of {bs} tokens, has {computed} "
                 f"computed tokens and asks for {new} more ({total} in all), and the pool has "
                 f"{free} free")
        no_room = f"{where}: it needs {need} new blocks, more than are free"
        extra = {"num_new_computed_tokens": 0, "new_computed_blocks": []} if hit_args else {}
        try:
            got = self.manager.allocate_slots(request, new, **extra)
        except TypeError as e:
            if hit_args:
                ex.fail(f"{where}, with num_new_computed_tokens=0, new_computed_blocks=[]: "
                        f"allocate_slots raised {e!r}: accept those arguments too.")
            raise
        except ValueError as e:
            if need > free:
                ex.fail(f"{no_room}, and your allocate_slots raised {e!r}. Check the free blocks "
                        "first and return None, taking nothing.")
            raise
        now, now_free = len(self.manager.get_block_ids(rid)), pool.get_num_free_blocks()
        shown = f"a list of {len(got)} blocks" if hasattr(got, "__len__") else repr(got)
        if need > free:
            if got is not None:
                ex.fail(f"{no_room}; expected None, got {shown}.")
            if (now, now_free) != (held, free):
                taken = free - now_free
                ex.fail(f"{no_room}. Your allocate_slots returned None but took {taken} "
                        f"block{'s' * (taken != 1)} from the pool (the request now holds {now}): "
                        "a refusal takes nothing, or those blocks leak.")
            return False
        if got is None:
            ex.fail(f"{where}: it needs {need} new blocks and they are free; it returned None.")
        if (now, now_free) != (held + need, free - need):
            ex.fail(f"{where}: expected it to take {need} new blocks (ceil({total} / {bs}) = "
                    f"{cdiv(total, bs)} in all), it took {free - now_free} and the request now "
                    f"holds {now}.", ex.hint(_Grown(held, total, bs, now), MISTAKES))
        if not hasattr(got, "__len__") or len(got) != need:
            ex.fail(f"{where}: allocate_slots took the right blocks but returned {shown}; "
                    f"expected the list of the {need} new blocks.")
        self.held[rid] = held + need
        return True

    def free(self, rid: str) -> None:
        self.manager.free(self.requests.pop(rid))
        self.held.pop(rid, None)


def _random_calls(ex: Exercise, cls: type, seed: int) -> None:
    """Requests growing by prefill chunks and decodes, finishing, and running out of blocks."""
    rng = np.random.default_rng(seed)
    led = _Ledger(ex, cls, num_blocks=24, block_size=int(rng.choice([2, 4, 8])))
    computed: dict[str, int] = {}
    next_id = 0
    for _ in range(NUM_RANDOM_CALLS):
        op = rng.random()
        if computed and op < 0.12:
            rid = str(rng.choice(sorted(computed)))
            led.free(rid)
            del computed[rid]
            continue
        if not computed or op < 0.3:
            rid, next_id = f"r{next_id}", next_id + 1
            computed[rid] = 0
        else:
            rid = str(rng.choice(sorted(computed)))
        n = 1 if rng.random() < 0.5 else int(rng.integers(1, 40))
        if led.call(rid, computed[rid], n, "a random call"):
            computed[rid] += n  # granted: those tokens are computed in this step
        elif computed[rid] == 0:
            led.free(rid)  # refused at admission: it holds nothing and waits
            del computed[rid]


@functools.cache
def _reference_run(seed: int) -> dict:
    return _engine_run(None, seed)


def _engine_run(cls: type | None, seed: int) -> dict:
    """Eight requests arriving over more than 14 blocks of 8 tokens hold, with ``cls`` (None: the
    package's) as the KV cache manager: (blocks held, free blocks) after each step, outputs."""
    from minivllm.course.checks.scheduler import run_arrivals
    from minivllm.course.swap import swapped_scheduler
    llm, rng = check_engine(), np.random.default_rng(seed)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    arrivals, at, steps = [], 0, []
    for i in range(8):
        prompt = rng.integers(10, vocab, int(rng.integers(3, 40))).tolist()
        arrivals.append((at, f"r{i}", prompt, int(rng.integers(4, 24))))
        at += int(rng.integers(0, 4))
    with swapped_scheduler(llm, kv_cache_manager_cls=cls, **ENGINE_SETTINGS) as scheduler:
        manager = scheduler.kv_cache_manager

        def record() -> None:
            held = {rid: len(manager.get_block_ids(rid)) for rid in scheduler.requests}
            steps.append(({k: v for k, v in held.items() if v}, manager.get_num_free_blocks()))

        outputs = run_arrivals(llm, arrivals, 400, record)
        return {"steps": steps, "outputs": outputs, "preemptions": scheduler.num_preemptions}
