"""Checkers for chapter 06 (prefix caching): the block hash chain, the block pool.

6.1 ``check_block_hashes``: deterministic across processes (not Python's ``hash()``), covering
the parent's hash, the tokens and the extra keys, the cache salt in block 0 only; then the
engine's prefix-cache hits and greedy outputs with it must be the reference's.
6.2 ``check_block_pool``: scenarios with a hint for each classic mistake, random workloads on
the simulated engine beside the reference pool (every step checked against the KV cache rules
of ``minivllm.testing``), then the real engine built with ``LLM(block_pool_cls=...)``.
"""

from __future__ import annotations

import contextlib

import numpy as np

from minivllm.config import SchedulerConfig
from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.core.request import Request
from minivllm.testing import all_free_violations, checked_block_pool_cls, kv_cache_violations
from minivllm.course.checks.common import (
    CheckFailed, Exercise, check_engine, check_model_path, compare_generations, fail, passed,
)

# -- Exercise 6.1: the block hash chain -----------------------------------------------------------

CHAIN_CONVENTION = ("Expected: block i's hash = hash_block_tokens(parent, token_ids[i*block_size:"
                    "(i+1)*block_size], extra_keys), where parent is block i-1's hash (None for "
                    "block 0) and extra_keys is [cache_salt] for block 0 of a salted request, [] "
                    "otherwise.")


HASH_ANSWER = ("minivllm.core.kv_cache_utils:hash_block_tokens",
               "minivllm.core.kv_cache_utils:update_block_hashes",
               "minivllm.core.kv_cache_utils:encode_block",
               "minivllm.core.kv_cache_utils:block_extra_keys")
PYTHON_HASH = {"hash": (
    "which is salted per process for str and bytes (PYTHONHASHSEED), changes between Python "
    "versions and has only 64 bits: the API server and the engine core, or a restarted server, "
    "would name the same block differently. Encode the parent hash, the token ids and the extra "
    "keys as bytes and hash them with a fixed function (hashlib.sha256).")}
POOL_ANSWER = ("minivllm.core.block_pool:BlockPool",)


def _no_extra(hash_block_tokens, parent, tokens):
    """The hashes a block without extra keys may have: [] is the convention; None or () too."""
    return {hash_block_tokens(parent, list(tokens), extra) for extra in ([], None, ())}


def check_block_hashes(hash_block_tokens, update_block_hashes, exercise: str = "6.1",
                       seed: int = 0) -> None:
    """``hash_block_tokens(parent_block_hash, token_ids, extra_keys) -> bytes`` and
    ``update_block_hashes(request, block_size) -> request.block_hashes`` (extended in place)."""
    ex = Exercise(exercise, answer=HASH_ANSWER, builtin=PYTHON_HASH,
                  allowed="hashlib, struct, json and the request's fields")
    hash_block_tokens = ex.take(hash_block_tokens, "hash_block_tokens")
    update_block_hashes = ex.take(update_block_hashes, "update_block_hashes")
    rng = np.random.default_rng(seed)
    _check_block_hash(hash_block_tokens, exercise, rng)
    cases = _check_chain(hash_block_tokens, update_block_hashes, exercise, rng)
    _check_hasher_in_engine(update_block_hashes, exercise)
    passed(exercise, f"your hashes are deterministic across processes and chained, the salt names "
                     f"the first block only ({cases} random requests), and the engine using them "
                     "finds the reference's prefix-cache hits and generates the reference text.")


def _check_block_hash(h, exercise: str, rng) -> None:
    tokens = [int(t) for t in rng.integers(0, 50_000, 16)]
    first = h(None, list(tokens), [])
    if not isinstance(first, bytes):
        fail(exercise, f"hash_block_tokens returned a {type(first).__name__}; expected bytes (a digest, "
                       "e.g. hashlib.sha256(...).digest())")
    if h(None, list(tokens), []) != first:
        fail(exercise, "hash_block_tokens returned two different hashes for the same block: a block's "
                       "name must depend on its contents only")
    parent = h(None, [1, 2, 3], [])
    pairs = [
        ("parent_block_hash", (None, tokens, []), (parent, tokens, [])),
        ("parent_block_hash", (parent, tokens, []), (h(None, [1, 2, 4], []), tokens, [])),
        ("token_ids", (None, [1, 23], []), (None, [12, 3], [])),
        ("token_ids", (None, [1, 2, 3], []), (None, [3, 2, 1], [])),
        ("token_ids", (parent, tokens, []), (parent, tokens[:-1] + [tokens[-1] + 1], [])),
        ("extra_keys", (None, tokens, []), (None, tokens, ["tenant-a"])),
        ("extra_keys", (None, tokens, ["tenant-a"]), (None, tokens, ["tenant-b"])),
    ]
    for what, a, b in pairs:
        if h(a[0], list(a[1]), list(a[2])) == h(b[0], list(b[1]), list(b[2])):
            fail(exercise, f"hash_block_tokens gives the same hash for {what} {_show(what, a)} and "
                           f"{_show(what, b)}: {SENSITIVE[what]}.")


SENSITIVE = {
    "parent_block_hash": "a block's hash must cover its parent's hash, so that equal blocks after "
                         "different prefixes get different names",
    "token_ids": "every token id, in order, must count (encode them unambiguously, e.g. each as 4 "
                 "bytes)",
    "extra_keys": "the extra keys (the cache salt) must count",
}


def _show(what: str, args: tuple) -> str:
    parent, tokens, extra = args
    if what == "parent_block_hash":
        return "None" if parent is None else parent.hex()[:8] + "..."
    if what == "token_ids":
        return str(tokens[:6])[:-1] + (", ...]" if len(tokens) > 6 else "]")
    return str(extra)


def _random_request(rng, rid: str, block_size: int, salt: str | None) -> Request:
    tokens = [int(t) for t in rng.integers(0, 50_000, int(rng.integers(0, 5 * block_size)))]
    return Request.from_prompt(rid, tokens, cache_salt=salt)


def _check_chain(h, update, exercise: str, rng) -> int:
    cases = 0
    for block_size in (1, 4, 16):
        for salt in (None, "tenant-a"):
            for _ in range(4):
                request = _random_request(rng, f"r{cases}", block_size, salt)
                _check_one_chain(h, update, request, block_size, exercise)
                cases += 1
    # the engine calls update_block_hashes again after every step, as tokens are appended
    request = Request.from_prompt("growing", [int(t) for t in rng.integers(0, 50_000, 5)],
                                  cache_salt="tenant-a")
    seen: list[bytes] = []
    for t in rng.integers(0, 50_000, 23):
        update(request, 4)
        hashes = request.block_hashes
        if hashes[: len(seen)] != seen or len(hashes) != request.num_tokens // 4:
            fail(exercise, f"called again after each new token (as the engine does), "
                           f"update_block_hashes left {len(hashes)} hashes for {request.num_tokens} "
                           f"tokens in blocks of 4 (expected {request.num_tokens // 4}), or changed "
                           "hashes it had already computed: extend request.block_hashes from "
                           "len(request.block_hashes) on, one hash per new full block")
        seen = list(request.block_hashes)
        request.append_output_token_ids([int(t)])
    update(request, 4)
    fresh = Request.from_prompt("fresh", request.all_token_ids, cache_salt="tenant-a")
    update(fresh, 4)
    if request.block_hashes != fresh.block_hashes:
        fail(exercise, "hashes computed step by step as tokens were appended differ from hashes of the "
                       "same tokens computed at once")

    # prefixes: shared blocks, shared names; a different block 0 renames every later block
    base = [int(t) for t in rng.integers(0, 50_000, 12)]
    same = Request.from_prompt("a", base + [1, 2, 3, 4]), Request.from_prompt("b", base + [5, 6, 7, 8])
    other = Request.from_prompt("c", [base[0] + 1] + base[1:] + [1, 2, 3, 4])
    salted = Request.from_prompt("d", base + [1, 2, 3, 4], cache_salt="tenant-a")
    salted_too = Request.from_prompt("e", base + [1, 2, 3, 4], cache_salt="tenant-a")
    for r in (*same, other, salted, salted_too):
        update(r, 4)
    a, b, c, d, e = (r.block_hashes for r in (*same, other, salted, salted_too))
    if a[:3] != b[:3]:
        fail(exercise, "two requests with the same first 12 tokens got different hashes for their first "
                       "3 blocks of 4: equal prefixes must get equal names")
    if any(x == y for x, y in zip(a[1:], c[1:])):
        fail(exercise, "two requests that differ only in their first token got the same hash for a "
                       "later block: each block's hash must cover its parent's hash (the chain), or a "
                       "block would be reused after a different prefix. " + CHAIN_CONVENTION)
    if any(x == y for x, y in zip(a, d)) or d != e:
        fail(exercise, "the same tokens with cache_salt='tenant-a' and without must differ in every "
                       "block, and two requests with the same salt must agree. " + CHAIN_CONVENTION)
    return cases


def _check_one_chain(h, update, request: Request, block_size: int, exercise: str) -> None:
    got = update(request, block_size)
    hashes = request.block_hashes
    what = (f"update_block_hashes(request with {request.num_tokens} tokens, cache_salt="
            f"{request.cache_salt!r}, block_size={block_size})")
    if got is not hashes and (not isinstance(got, list) or got != hashes):
        fail(exercise, f"{what} returned {'None' if got is None else 'something else'} instead of "
                       "request.block_hashes: extend request.block_hashes in place and return it (the "
                       "engine looks blocks up by the list it returns)")
    if len(hashes) != request.num_tokens // block_size:
        fail(exercise, f"{what} left {len(hashes)} hashes; expected {request.num_tokens // block_size}, "
                       "one per full block (a partial last block is never hashed: it will still change)")
    tokens, salt = request.all_token_ids, request.cache_salt
    parent = None
    for i, got_hash in enumerate(hashes):
        block = tokens[i * block_size:(i + 1) * block_size]
        expected = ({h(parent, list(block), [salt]), h(parent, list(block), (salt,))} if salt and i == 0
                    else _no_extra(h, parent, block))
        if got_hash not in expected:
            hint = ""
            if i > 0 and got_hash in _no_extra(h, None, block) | {h(None, list(block), [salt])}:
                hint = " Your block's hash ignores its parent: chain each block to block i-1's hash."
            elif i > 0 and salt and got_hash == h(parent, list(block), [salt]):
                hint = (" You put the cache salt in every block's extra keys: it belongs to block 0 "
                        "only; the chain carries it into every later block's hash.")
            elif i == 0 and salt and got_hash in _no_extra(h, None, block):
                hint = " The cache salt is missing from block 0's extra keys."
            fail(exercise, f"{what}: block {i}'s hash is not hash_block_tokens(parent, its tokens, "
                           f"extra_keys).{hint} {CHAIN_CONVENTION}")
        parent = got_hash


# the engine workload: one system prompt, requests in waves, two tenants with their own salt
SYSTEM = ("You are the help desk of a public library. Answer questions about opening hours, "
          "loans and events in one short, friendly sentence.")
QUESTIONS = ["When do you open on Sunday?", "How long can I keep a book?",
             "Is there a reading club this month?", "Can I renew a loan online?",
             "Do you have a quiet room for studying?"]


def _hasher_waves(tokenizer):
    system = tokenizer.encode(SYSTEM)
    first = system + tokenizer.encode(" " + QUESTIONS[0])
    shuffled = first[8:16] + first[0:8] + first[16:]  # the same blocks of 8 in another order
    ask = [system + tokenizer.encode(" " + q) for q in QUESTIONS]
    return [
        [("plain-1", ask[0], None, "the first request")],
        [("plain-2", ask[1], None, "the same system prompt as plain-1, no salt"),
         ("tenant-a-1", ask[2], "tenant-a", "the same system prompt, salted 'tenant-a'")],
        [("tenant-a-2", ask[3], "tenant-a", "the same system prompt and salt as tenant-a-1"),
         ("tenant-b-1", ask[4], "tenant-b", "the same system prompt, salt 'tenant-b' (new)"),
         ("shuffled", shuffled, None, "plain-1's first blocks swapped")],
    ]


def run_waves(llm, waves, max_tokens: int = 3) -> dict[str, tuple[list[int], int]]:
    """Run each wave of (id, token ids, cache salt, ...) to the end, one after the other.

    Returns request id -> (greedy output token ids, prompt tokens served from the prefix cache).
    """
    from minivllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for wave in waves:
        for rid, token_ids, salt, *_ in wave:
            engine.add_request(rid, {"prompt_token_ids": token_ids}, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
    return results


def _check_hasher_in_engine(update_block_hashes, exercise: str) -> None:
    from minivllm.course.views import engine_core

    llm = check_engine()
    manager = engine_core(llm).scheduler.kv_cache_manager
    waves = _hasher_waves(llm.get_tokenizer())
    llm.llm_engine.reset_prefix_cache()
    expected = run_waves(llm, waves)
    llm.llm_engine.reset_prefix_cache()
    saved = manager.block_hasher
    try:
        manager.block_hasher = update_block_hashes
        got = run_waves(llm, waves)
    finally:
        manager.block_hasher = saved
        llm.llm_engine.reset_prefix_cache()
    descs = {rid: f" ({desc})" for wave in waves for rid, _, _, desc in wave}
    _same_runs(exercise, llm, "with your hash chain (blocks of 8 tokens)", got, expected, descs,
               CHAIN_CONVENTION)


def _same_runs(exercise: str, llm, what: str, got: dict, expected: dict, descs: dict,
               convention: str = "") -> None:
    """The same prefix-cache hits and greedy tokens for every request (``run_waves``)."""
    for rid in expected:
        if got[rid][1] != expected[rid][1]:
            fail(exercise, f"in the engine {what}, request {rid!r}{descs.get(rid, '')} found "
                           f"{got[rid][1]} prompt tokens in the prefix cache; with the "
                           f"reference's, {expected[rid][1]}. {convention}".rstrip())
    labels = list(expected)
    compare_generations(exercise, what, llm, labels, [got[r][0] for r in labels],
                        [expected[r][0] for r in labels])


# -- Exercise 6.2: the block pool -----------------------------------------------------------------

POOL_CONVENTION = ("Expected: get_new_blocks takes blocks from the head of the free queue (LRU), "
                   "evicting any hash they carry; touch adds a reference and takes a free block out "
                   "of the queue; free_blocks drops a reference and queues blocks that reach 0 at "
                   "the tail, in the order given, keeping their hash; cache_full_blocks names blocks "
                   "[num_cached_blocks, num_full_blocks) unless named already, and the map keeps every block of "
                   "a hash.")


def _failing(exercise: str):
    """A broken pool rule fails the exercise (``minivllm.testing.CheckedBlockPool``)."""
    def on_violation(message: str) -> None:
        fail(exercise, message)
    return on_violation


def check_block_pool(block_pool_cls, exercise: str = "6.2", seed: int = 0) -> None:
    """``block_pool_cls(num_blocks, enable_caching)``, with the API of ``core.block_pool.BlockPool``."""
    block_pool_cls = Exercise(
        exercise, answer=POOL_ANSWER,
        allowed="KVCacheBlock and FreeKVCacheBlockQueue (the blocks and the free queue)",
    ).take(block_pool_cls, "block pool")
    _pool_scenarios(block_pool_cls, exercise)
    steps = _check_pool_in_sim(block_pool_cls, exercise, seed)
    _check_pool_in_engine(block_pool_cls, exercise)
    passed(exercise, f"your block pool keeps every rule in the scenarios and on {steps} steps of "
                     "random workloads beside the reference, and the engine built with it "
                     "(block_pool_cls) finds the same prefix-cache hits and generates the reference "
                     "text.")


@contextlib.contextmanager
def _where(exercise: str, where: str):
    """Say where a rule broke inside the engine (the pool's checks do not know)."""
    try:
        yield
    except CheckFailed as e:
        prefix = f"Exercise {exercise}: "
        raise CheckFailed(prefix + where + ": " + str(e).removeprefix(prefix)) from None


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _pool_scenarios(cls, exercise: str) -> None:
    def need(condition: bool, message: str) -> None:
        if not condition:
            fail(exercise, message + " " + POOL_CONVENTION)

    h = [bytes([i]) * 32 for i in range(8)]
    pool = cls(8, True)
    blocks = pool.get_new_blocks(3)
    need(len(blocks) == 3 and all(isinstance(b, KVCacheBlock) for b in blocks)
         and len(set(_ids(blocks))) == 3, "get_new_blocks(3) must return 3 different KVCacheBlocks.")
    need([b.ref_cnt for b in blocks] == [1, 1, 1] and pool.get_num_free_blocks() == 5,
         f"after get_new_blocks(3) from 8 free blocks: ref counts {[b.ref_cnt for b in blocks]} and "
         f"{pool.get_num_free_blocks()} free; expected [1, 1, 1] and 5.")
    pool.cache_full_blocks(blocks, h[:3], 0, 2)
    need(pool.get_cached_block(h[0]) is blocks[0] and pool.get_cached_block(h[1]) is blocks[1]
         and blocks[0].block_hash == h[0] and pool.get_cached_block(h[2]) is None
         and blocks[2].block_hash is None,
         "cache_full_blocks(blocks, hashes, 0, 2) must give blocks 0 and 1 (only) their hashes, "
         "and get_cached_block(hash) must find them.")
    pool.free_blocks([blocks[2], blocks[1], blocks[0]])
    need(pool.get_num_free_blocks() == 8 and [b.ref_cnt for b in blocks] == [0, 0, 0],
         f"after freeing all 3: {pool.get_num_free_blocks()} free, ref counts "
         f"{[b.ref_cnt for b in blocks]}; expected 8 and [0, 0, 0].")
    need(blocks[0].block_hash == h[0] and pool.get_cached_block(h[0]) is blocks[0],
         "a freed block keeps its hash, and get_cached_block still finds it (cached-free) until "
         "get_new_blocks evicts it.")
    pool.touch([blocks[0]])
    need(blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 7,
         f"touch([cached-free block]) must make its ref_cnt 1 and take it out of the free queue: got "
         f"ref_cnt {blocks[0].ref_cnt} and {pool.get_num_free_blocks()} free (expected 7).")
    rest = pool.get_new_blocks(7)
    need(blocks[0] not in rest, "get_new_blocks handed out a block that touch() had revived: touch "
                                "must remove a free block from the free queue.")
    need(blocks[1].block_hash is None and pool.get_cached_block(h[1]) is None,
         f"get_new_blocks reused cached-free block {blocks[1].block_id} but its old hash survived "
         f"(block.block_hash={'None' if blocks[1].block_hash is None else 'still set'}, "
         f"get_cached_block(old hash) "
         f"{'None' if pool.get_cached_block(h[1]) is None else 'still finds it'}):"
         " evict it, deleting the map entry and clearing block.block_hash.")

    # LRU: blocks leave the free queue in the order free_blocks put them there
    pool = cls(6, True)
    a = pool.get_new_blocks(6)
    pool.free_blocks([a[3], a[1], a[5]])
    first = pool.get_new_blocks(1)
    need(_ids(first) == [a[3].block_id],
         f"free_blocks([block {a[3].block_id}, block {a[1].block_id}, block {a[5].block_id}]) then "
         f"get_new_blocks(1) returned blocks {_ids(first)}; expected [{a[3].block_id}]: blocks "
         "leave the free queue in the order free_blocks put them there (the KV cache manager passes "
         "a request's blocks last first, so the tail of a prefix is evicted before its head).")

    # never-used blocks go before cached-free ones
    pool = cls(6, True)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, h[:2], 0, 2)
    pool.free_blocks(a[::-1])
    taken = pool.get_new_blocks(4)
    need(not set(_ids(taken)) & set(_ids(a)) and pool.get_cached_block(h[0]) is a[0],
         f"with 4 never-used free blocks and 2 cached-free ones, get_new_blocks(4) took "
         f"{_ids(taken)}, evicting cached blocks {sorted(set(_ids(taken)) & set(_ids(a)))}: the "
         "blocks free since the start are the least recently used.")

    # a hash two blocks carry keeps both: each stays reachable until it is evicted itself
    pool = cls(4, True)
    x, y = pool.get_new_blocks(2)
    pool.cache_full_blocks([x], [h[0]], 0, 1)
    pool.cache_full_blocks([y], [h[0]], 0, 1)
    need(x.block_hash == h[0] and y.block_hash == h[0] and pool.get_cached_block(h[0]) in (x, y),
         "when two blocks get the same hash (two requests computed the same prefix side by side), "
         "both carry it and the map keeps both.")
    pool.free_blocks([x, y])
    pool.get_new_blocks(3)  # the two never-used blocks, then x: y must still answer the hash
    need(pool.get_cached_block(h[0]) is y,
         "when one of two blocks carrying a hash is evicted, the other must still be found by "
         "that hash (the map keeps every block of a hash until each is evicted).")


def _sim_workload(rng, num_requests: int = 20):
    """Events by step: ("add", id, tokens, max_tokens) and ("abort", id); shared prefixes."""
    prefixes = [[int(t) for t in rng.integers(100, 200, n)] for n in (8, 8, 4)]
    prefixes[1][:4] = prefixes[0][:4]  # two prefixes share their first block
    events: dict[int, list] = {}
    step = 0
    for i in range(num_requests):
        step += int(rng.integers(0, 4))
        prefix = prefixes[int(rng.integers(0, len(prefixes)))]
        tail = [int(t) for t in rng.integers(10, 60, int(rng.integers(0, 14)))]
        events.setdefault(step, []).append(("add", f"r{i}", prefix + tail, int(rng.integers(1, 10))))
        if rng.random() < 0.15:
            events.setdefault(step + int(rng.integers(1, 6)), []).append(("abort", f"r{i}"))
    return events


def _last(trace: list[dict], key: str):
    return trace[-1][key] if trace else None


SIM_CONFIGS = [  # (scheduler, token budget, chunked prefill)
    ("v1", 8, True), ("v1", 3, True), ("v0", 64, False),
]


def _check_pool_in_sim(cls, exercise: str, seed: int, num_workloads: int = 4) -> int:
    from minivllm.sim.engine import SimEngine

    rng = np.random.default_rng(seed)
    total = 0
    for k in range(num_workloads):
        for scheduler, budget, chunked in SIM_CONFIGS:
            events = _sim_workload(rng)
            cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=48,
                                  enable_chunked_prefill=chunked)
            ref = SimEngine(14, 4, scheduler=scheduler, scheduler_config=cfg)
            sim = SimEngine(14, 4, scheduler=scheduler, scheduler_config=cfg,
                            block_pool_cls=checked_block_pool_cls(cls, _failing(exercise)))
            where = (f"random workload {k} ({scheduler} scheduler, budget {budget}, 14 blocks of 4 "
                     "tokens, shared prefixes, aborts)")
            step = 0
            while (step <= max(events) or ref.scheduler.has_unfinished_requests()) and step < 2000:
                for engine in (ref, sim):
                    with _where(exercise, f"{where}, step {step}"):
                        for event in events.get(step, []):
                            if event[0] == "add":
                                engine.add_request(event[1], event[2], event[3],
                                                   arrival_time=engine.clock)
                            else:
                                engine.abort(event[1])
                        engine.step()
                problems = kv_cache_violations(sim.scheduler)
                if problems:
                    fail(exercise, f"{where}, after step {step}: {problems[0]}. {POOL_CONVENTION}")
                e, g = ref.step_trace, sim.step_trace
                if len(e) != len(g) or (e and (e[-1]["scheduled"], e[-1]["kv_blocks_used"]) != (
                        g[-1]["scheduled"], g[-1]["kv_blocks_used"])):
                    fail(exercise, f"{where}, step {step}: with the reference pool the scheduler "
                                   f"ran {_last(e, 'scheduled')} with {_last(e, 'kv_blocks_used')} "
                                   f"blocks in use; with yours {_last(g, 'scheduled')} with "
                                   f"{_last(g, 'kv_blocks_used')}. {POOL_CONVENTION}")
                step += 1
                total += 1
            cached = {r: (x.num_cached_tokens, x.num_preemptions) for r, x in sim.records.items()}
            expected = {r: (x.num_cached_tokens, x.num_preemptions) for r, x in ref.records.items()}
            if cached != expected:
                rid = next(r for r in expected if cached[r] != expected[r])
                fail(exercise, f"{where}: request {rid} had (cached prompt tokens, preemptions) "
                               f"{cached[rid]} with your pool, {expected[rid]} with the reference.")
            problems = all_free_violations(sim.kv_cache_manager)
            if problems:
                fail(exercise, f"{where}: {problems[0]}.")
    return total


ENGINE_TEXTS = [
    "The library opens at nine on weekdays and at ten on Saturdays.",
    "The library opens at nine on weekdays and closes at six in the evening.",
    "Books may be borrowed for three weeks and renewed twice online.",
    "The library opens at nine on weekdays and at ten on Saturdays. On Sundays it is closed.",
]


def _pool_waves(tokenizer):
    ids = [tokenizer.encode(t) for t in ENGINE_TEXTS]
    return [
        [(f"w0-{i}", ids[i], None) for i in (0, 2)],
        [(f"w1-{i}", ids[i], None) for i in (1, 3, 0, 2)],
        [(f"w2-{i}", ids[i], None) for i in (3, 1)],
    ]


def _check_pool_in_engine(cls, exercise: str) -> None:
    from minivllm import LLM
    from minivllm.course.views import engine_core

    # few blocks of 4 tokens: requests share prefixes, evict each other's cache and get preempted
    llm = LLM(check_model_path(), show_progress=False, device="cpu", block_size=4, num_kv_blocks=14, max_model_len=48,
              max_num_batched_tokens=24, max_num_seqs=4,
              block_pool_cls=checked_block_pool_cls(cls, _failing(exercise)))
    scheduler = engine_core(llm).scheduler
    manager = scheduler.kv_cache_manager
    waves = _pool_waves(llm.get_tokenizer())

    def run() -> tuple[dict, dict]:
        before = scheduler.get_stats()
        results = run_waves(llm, waves, max_tokens=4)
        after = scheduler.get_stats()
        problems = kv_cache_violations(scheduler) + all_free_violations(manager)
        if problems:
            fail(exercise, f"in the engine built with your pool: {problems[0]}. {POOL_CONVENTION}")
        return results, {k: after[k] - before[k] for k in ("prefix_cache_hits", "num_preemptions")}

    with _where(exercise, "in the engine built with your pool (14 blocks of 4 tokens)"):
        got, got_stats = run()
    manager.block_pool = BlockPool(manager.num_blocks, True)  # the same engine, the reference pool
    expected, expected_stats = run()
    if got_stats != expected_stats:
        fail(exercise, f"the engine built with your pool (14 blocks of 4 tokens) counted "
                       f"{got_stats}; with the reference pool {expected_stats}. {POOL_CONVENTION}")
    _same_runs(exercise, llm, "built with your block pool", got, expected, {})
