"""Checkers for chapter 06: 6.1 the block hash chain, 6.2 the block pool. Each runs cases with a
hint per classic mistake, then the engine beside the reference (prefix-cache hits, greedy text)."""

from __future__ import annotations

import contextlib
import reprlib
from collections import namedtuple

import numpy as np

from minivllm.config import SchedulerConfig
from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.core.request import Request
from minivllm.course.checks.common import CheckFailed, Exercise, check_engine, compare_generations
from minivllm.testing import all_free_violations, checked_block_pool_cls, kv_cache_violations

# -- 6.1 the block hash chain ---------------------------------------------------------------------

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
# what a block's hash must tell apart: argument (in hash_block_tokens' order) -> why
SENSITIVE = {
    "parent_block_hash": "a block's hash must cover its parent's hash, so that equal blocks after "
                         "different prefixes get different names",
    "token_ids": "every token id, in order, must count (encode them unambiguously, e.g. each as 4 "
                 "bytes)",
    "extra_keys": "the extra keys (the cache salt) must count",
}
# a wrongly hashed block: index, tokens, parent's hash, salt, hash_block_tokens, the hash got
_Block = namedtuple("_Block", "i tokens parent salt h got")
CHAIN_MISTAKES = [
    (lambda b: b.i > 0
     and b.got in _no_extra(b.h, None, b.tokens) | {b.h(None, list(b.tokens), [b.salt])},
     "Your block's hash ignores its parent: chain each block to block i-1's hash."),
    (lambda b: b.i > 0 and b.salt and b.got == b.h(b.parent, list(b.tokens), [b.salt]),
     ("You put the cache salt in every block's extra keys: it belongs to block 0 only; the chain "
      "carries it into every later block's hash.")),
    (lambda b: b.i == 0 and b.salt and b.got in _no_extra(b.h, None, b.tokens),
     "The cache salt is missing from block 0's extra keys."),
]


def check_block_hashes(hash_block_tokens, update_block_hashes, exercise: str = "6.1",
                       seed: int = 0) -> None:
    """``hash_block_tokens(parent_block_hash, token_ids, extra_keys) -> bytes`` and
    ``update_block_hashes(request, block_size) -> request.block_hashes`` (extended in place)."""
    ex = Exercise(exercise, CHAIN_CONVENTION, HASH_ANSWER, builtin=PYTHON_HASH,
                  allowed="hashlib, struct, json and the request's fields")
    h = ex.take(hash_block_tokens, "hash_block_tokens")
    update = ex.take(update_block_hashes, "update_block_hashes")
    rng = np.random.default_rng(seed)
    _check_block_hash(ex, h, rng)
    cases = 0
    for block_size in (1, 4, 16):
        for salt in (None, "tenant-a"):
            for _ in range(4):
                tokens = rng.integers(0, 50_000, int(rng.integers(0, 5 * block_size))).tolist()
                request = Request.from_prompt(f"r{cases}", tokens, cache_salt=salt)
                _check_one_chain(ex, h, update, request, block_size)
                cases += 1
    _check_chains(ex, update, rng)
    _check_hasher_in_engine(ex, update)
    ex.passed(f"your hashes are deterministic across processes and chained, the salt names the "
              f"first block only ({cases} random requests), and the engine using them finds the "
              "reference's prefix-cache hits and generates the reference text.")


def _check_block_hash(ex: Exercise, h, rng) -> None:
    tokens = rng.integers(0, 50_000, 16).tolist()
    first = h(None, list(tokens), [])
    if not isinstance(first, bytes):
        ex.fail(f"hash_block_tokens returned a {type(first).__name__}; expected bytes (a digest, "
                "e.g. hashlib.sha256(...).digest()).")
    if h(None, list(tokens), []) != first:
        ex.fail("hash_block_tokens returned two different hashes for the same block: a block's "
                "name must depend on its contents only.")
    parent = h(None, [1, 2, 3], [])
    pairs = [  # (argument that differs, one call's arguments, the other's)
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
            ex.fail(f"hash_block_tokens gives the same hash for {what} {_show(what, a)} and "
                    f"{_show(what, b)}: {SENSITIVE[what]}.")


def _show(what: str, args: tuple) -> str:
    """The argument ``what`` of ``args``: a hash by its first 8 hex digits, a list by 6 items."""
    value = args[list(SENSITIVE).index(what)]
    return value.hex()[:8] + "..." if isinstance(value, bytes) else reprlib.repr(value)


def _no_extra(h, parent, tokens) -> set:
    """The hashes a block without extra keys may have: [] is the convention; None or () too."""
    return {h(parent, list(tokens), extra) for extra in ([], None, ())}


def _check_one_chain(ex: Exercise, h, update, request: Request, block_size: int) -> None:
    got = update(request, block_size)
    hashes, tokens, salt = request.block_hashes, request.all_token_ids, request.cache_salt
    what = (f"update_block_hashes(request with {request.num_tokens} tokens, cache_salt="
            f"{salt!r}, block_size={block_size})")
    if got is not hashes and (not isinstance(got, list) or got != hashes):
        ex.fail(f"{what} returned {'None' if got is None else 'something else'} instead of "
                "request.block_hashes: extend request.block_hashes in place and return it (the "
                "engine looks blocks up by the list it returns).")
    if len(hashes) != request.num_tokens // block_size:
        ex.fail(f"{what} left {len(hashes)} hashes; expected {request.num_tokens // block_size}, "
                "one per full block (a partial last block is never hashed: it will still change).")
    parent = None
    for i, got_hash in enumerate(hashes):
        block = tokens[i * block_size:(i + 1) * block_size]
        expected = ({h(parent, list(block), [salt]), h(parent, list(block), (salt,))}
                    if salt and i == 0 else _no_extra(h, parent, block))
        if got_hash not in expected:
            ex.fail(f"{what}: block {i}'s hash is not hash_block_tokens(parent, its tokens, "
                    "extra_keys).", ex.hint(_Block(i, block, parent, salt, h, got_hash),
                                            CHAIN_MISTAKES))
        parent = got_hash


def _check_chains(ex: Exercise, update, rng) -> None:
    """Hashes grown token by token as the engine does; shared prefixes and salts."""
    request = Request.from_prompt("growing", rng.integers(0, 50_000, 5).tolist(),
                                  cache_salt="tenant-a")
    seen: list[bytes] = []
    for t in rng.integers(0, 50_000, 23).tolist():
        update(request, 4)
        hashes = request.block_hashes
        if hashes[:len(seen)] != seen or len(hashes) != request.num_tokens // 4:
            ex.fail(f"called after each new token, update_block_hashes left {len(hashes)} hashes "
                    f"for {request.num_tokens} tokens in blocks of 4, or changed earlier ones: "
                    "extend request.block_hashes from len(request.block_hashes) on.")
        seen = list(hashes)
        request.append_output_token_ids([t])
    update(request, 4)
    fresh = Request.from_prompt("fresh", request.all_token_ids, cache_salt="tenant-a")
    update(fresh, 4)
    if request.block_hashes != fresh.block_hashes:
        ex.fail("hashes computed as tokens were appended differ from those computed at once.")
    base = rng.integers(0, 50_000, 12).tolist()
    requests = [Request.from_prompt(rid, tokens, cache_salt=salt) for rid, tokens, salt in (
        ("a", base + [1, 2, 3, 4], None), ("b", base + [5, 6, 7, 8], None),
        ("c", [base[0] + 1] + base[1:] + [1, 2, 3, 4], None),
        ("d", base + [1, 2, 3, 4], "tenant-a"), ("e", base + [1, 2, 3, 4], "tenant-a"))]
    for r in requests:
        update(r, 4)
    a, b, c, d, e = (r.block_hashes for r in requests)
    if a[:3] != b[:3]:
        ex.fail("two requests with the same first 12 tokens got different hashes for their 3 "
                "first blocks of 4: equal prefixes must get equal names.")
    if any(x == y for x, y in zip(a[1:], c[1:])):
        ex.fail("two requests that differ only in their first token got the same hash for a "
                "later block: each block's hash must cover its parent's hash (the chain).")
    if any(x == y for x, y in zip(a, d)) or d != e:
        ex.fail("the same tokens with cache_salt='tenant-a' and without must differ in every "
                "block, and two requests with the same salt must agree.")


SYSTEM = ("You are the help desk of a public library. Answer questions about opening hours, "
          "loans and events in one short, friendly sentence.")
QUESTIONS = ["When do you open on Sunday?", "How long can I keep a book?",
             "Is there a reading club this month?", "Can I renew a loan online?",
             "Do you have a quiet room for studying?"]


def _check_hasher_in_engine(ex: Exercise, update) -> None:
    """One system prompt, requests in waves, two tenants with their own salt (blocks of 8)."""
    from minivllm.course.views import engine_core
    llm = check_engine()
    manager = engine_core(llm).scheduler.kv_cache_manager
    tok = llm.get_tokenizer()
    ask = [tok.encode(SYSTEM) + tok.encode(" " + q) for q in QUESTIONS]
    waves = [
        [("plain-1", ask[0], None, "the first request")],
        [("plain-2", ask[1], None, "the same system prompt as plain-1, no salt"),
         ("tenant-a-1", ask[2], "tenant-a", "the same system prompt, salted 'tenant-a'")],
        [("tenant-a-2", ask[3], "tenant-a", "the same system prompt and salt as tenant-a-1"),
         ("tenant-b-1", ask[4], "tenant-b", "the same system prompt, salt 'tenant-b' (new)"),
         ("shuffled", ask[0][8:16] + ask[0][0:8] + ask[0][16:], None,
          "plain-1's first blocks swapped")]]
    llm.llm_engine.reset_prefix_cache()
    expected = run_waves(llm, waves)
    llm.llm_engine.reset_prefix_cache()
    saved, manager.block_hasher = manager.block_hasher, update
    try:
        got = run_waves(llm, waves)
    finally:
        manager.block_hasher = saved
        llm.llm_engine.reset_prefix_cache()
    _same_runs(ex, llm, "with your hash chain (blocks of 8 tokens)", got, expected, waves)


def run_waves(llm, waves, max_tokens: int = 3) -> dict[str, tuple[list[int], int]]:
    """Each wave of (id, token ids, cache salt, ...) run to the end in turn: id -> (greedy output
    token ids, prompt tokens served from the prefix cache)."""
    from minivllm import SamplingParams
    engine, results = llm.llm_engine, {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for wave in waves:
        for rid, token_ids, salt, *_ in wave:
            engine.add_request(rid, {"prompt_token_ids": token_ids}, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
    return results


def _same_runs(ex: Exercise, llm, what: str, got: dict, expected: dict, waves) -> None:
    """The same prefix-cache hits and greedy tokens for every request (``run_waves``)."""
    descs = {rid: f" ({desc[0]})" for wave in waves for rid, _, _, *desc in wave if desc}
    for rid, (_, hits) in expected.items():
        if got[rid][1] != hits:
            ex.fail(f"in the engine {what}, request {rid!r}{descs.get(rid, '')} found "
                    f"{got[rid][1]} prompt tokens in the prefix cache; with the reference's, "
                    f"{hits}.")
    compare_generations(ex.number, what, llm, list(expected), [got[r][0] for r in expected],
                        [expected[r][0] for r in expected])


# -- 6.2 the block pool ---------------------------------------------------------------------------

POOL_CONVENTION = (
    "Expected: get_new_blocks takes blocks from the head of the free queue (LRU), evicting any "
    "hash they carry; touch adds a reference and takes a free block out of the queue; "
    "free_blocks drops a reference and queues blocks that reach 0 at the tail, in the order "
    "given, keeping their hash; cache_full_blocks names blocks [num_cached_blocks, "
    "num_full_blocks) unless named already, and the map keeps every block of a hash.")


def check_block_pool(block_pool_cls, exercise: str = "6.2", seed: int = 0) -> None:
    """``block_pool_cls(num_blocks, enable_caching)``: the API of ``core.block_pool.BlockPool``."""
    ex = Exercise(exercise, POOL_CONVENTION, ("minivllm.core.block_pool:BlockPool",),
                  allowed="KVCacheBlock and FreeKVCacheBlockQueue (the blocks and the free queue)")
    cls = ex.take(block_pool_cls, "block pool")
    _pool_scenarios(ex, cls)
    checked = checked_block_pool_cls(cls, lambda m: ex.fail(m + "."))
    steps = _check_pool_in_sim(ex, checked, seed)
    _check_pool_in_engine(ex, checked)
    ex.passed(f"your block pool keeps every rule in the scenarios and on {steps} steps of "
              "random workloads beside the reference, and the engine built with it "
              "(block_pool_cls) finds the same prefix-cache hits and generates the reference "
              "text.")


@contextlib.contextmanager
def _where(ex: Exercise, where: str):
    """Say where in the engine a rule broke (the checked pool does not know)."""
    try:
        yield
    except CheckFailed as e:
        prefix = f"Exercise {ex.number}: "
        raise type(e)(prefix + where + ": " + str(e).removeprefix(prefix)) from None


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _pool_scenarios(ex: Exercise, cls) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            ex.fail(message)

    def state() -> tuple[list[int], int]:
        return [x.ref_cnt for x in b], pool.get_num_free_blocks()

    h = [bytes([i]) * 32 for i in range(8)]
    pool = cls(8, True)
    b = pool.get_new_blocks(3)
    need(len(b) == 3 and all(isinstance(x, KVCacheBlock) for x in b) and len(set(_ids(b))) == 3,
         "get_new_blocks(3) must return 3 different KVCacheBlocks.")
    need(state() == ([1, 1, 1], 5), f"after get_new_blocks(3) from 8 free blocks, (ref counts, "
                                    f"free blocks) are {state()}; expected ([1, 1, 1], 5).")
    pool.cache_full_blocks(b, h[:3], 0, 2)
    need(pool.get_cached_block(h[0]) is b[0] and pool.get_cached_block(h[1]) is b[1]
         and b[0].block_hash == h[0] and pool.get_cached_block(h[2]) is None
         and b[2].block_hash is None, "cache_full_blocks(blocks, hashes, 0, 2) must give blocks 0 "
         "and 1 (only) their hashes, and get_cached_block(hash) must find them.")
    pool.free_blocks([b[2], b[1], b[0]])
    need(state() == ([0, 0, 0], 8), f"after freeing all 3, (ref counts, free blocks) are "
                                    f"{state()}; expected ([0, 0, 0], 8).")
    need(b[0].block_hash == h[0] and pool.get_cached_block(h[0]) is b[0], "a freed block keeps "
         "its hash, and get_cached_block finds it (cached-free) until get_new_blocks evicts it.")
    pool.touch([b[0]])
    need(b[0].ref_cnt == 1 and pool.get_num_free_blocks() == 7, "touch([cached-free block]) must "
         f"make its ref_cnt 1 and take it out of the free queue: got ref_cnt {b[0].ref_cnt} and "
         f"{pool.get_num_free_blocks()} free (expected 7).")
    need(b[0] not in pool.get_new_blocks(7), "get_new_blocks handed out a block that touch() had "
         "revived: touch must take a free block out of the free queue.")
    stale, found = b[1].block_hash is not None, pool.get_cached_block(h[1]) is not None
    need(not stale and not found, f"get_new_blocks reused cached-free block {b[1].block_id} but "
         f"its old hash survived (block_hash {'set' if stale else 'None'}, get_cached_block "
         f"{'finds it' if found else 'None'}): evict it, clearing the map entry and block_hash.")

    pool = cls(6, True)  # LRU: blocks leave the free queue in the order free_blocks put them there
    a = pool.get_new_blocks(6)
    pool.free_blocks([a[3], a[1], a[5]])
    first = _ids(pool.get_new_blocks(1))
    need(first == [a[3].block_id], f"free_blocks(blocks {_ids([a[3], a[1], a[5]])}) then "
         f"get_new_blocks(1) returned blocks {first}; expected [{a[3].block_id}]: blocks leave "
         "the free queue in the order free_blocks put them there (the manager passes a request's "
         "blocks last first, so a prefix's tail is evicted before its head).")

    pool = cls(6, True)  # never-used blocks go before cached-free ones
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, h[:2], 0, 2)
    pool.free_blocks(a[::-1])
    taken = _ids(pool.get_new_blocks(4))
    evicted = sorted(set(taken) & set(_ids(a)))
    need(not evicted and pool.get_cached_block(h[0]) is a[0], f"with 4 never-used free blocks "
         f"and 2 cached-free ones, get_new_blocks(4) took {taken}, evicting cached blocks "
         f"{evicted}: the blocks free since the start are the least recently used.")

    pool = cls(4, True)  # a hash two blocks carry: each stays reachable until it is evicted itself
    x, y = pool.get_new_blocks(2)
    pool.cache_full_blocks([x], [h[0]], 0, 1)
    pool.cache_full_blocks([y], [h[0]], 0, 1)
    need(x.block_hash == h[0] and y.block_hash == h[0] and pool.get_cached_block(h[0]) in (x, y),
         "two blocks given the same hash (the same prefix computed side by side) both carry it, "
         "and the map keeps both.")
    pool.free_blocks([x, y])
    pool.get_new_blocks(3)  # the two never-used blocks, then x: y must still answer the hash
    need(pool.get_cached_block(h[0]) is y, "when one of two blocks carrying a hash is evicted, "
         "get_cached_block must still find the other.")


def _sim_workload(rng, num_requests: int = 20) -> dict[int, list]:
    """Events by step: ("add", id, tokens, max_tokens) and ("abort", id); shared prefixes."""
    prefixes = [[int(t) for t in rng.integers(100, 200, n)] for n in (8, 8, 4)]
    prefixes[1][:4] = prefixes[0][:4]  # two prefixes share their first block
    events: dict[int, list] = {}
    step = 0
    for i in range(num_requests):
        step += int(rng.integers(0, 4))
        prefix = prefixes[int(rng.integers(0, len(prefixes)))]
        tail = [int(t) for t in rng.integers(10, 60, int(rng.integers(0, 14)))]
        max_tokens = int(rng.integers(1, 10))
        events.setdefault(step, []).append(("add", f"r{i}", prefix + tail, max_tokens))
        if rng.random() < 0.15:
            events.setdefault(step + int(rng.integers(1, 6)), []).append(("abort", f"r{i}"))
    return events


def _check_pool_in_sim(ex: Exercise, checked, seed: int, num_workloads: int = 4) -> int:
    """Random workloads on the simulated engine, the learner's pool (``checked``: wrapped in
    checks) beside the reference one."""
    from minivllm.sim.engine import SimEngine
    rng, total = np.random.default_rng(seed), 0
    for k in range(num_workloads):
        for scheduler, budget, chunked in (("v1", 8, True), ("v1", 3, True), ("v0", 64, False)):
            events = _sim_workload(rng)
            cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=48,
                                  enable_chunked_prefill=chunked)
            ref, sim = (SimEngine(14, 4, scheduler=scheduler, scheduler_config=cfg, **kw)
                        for kw in ({}, {"block_pool_cls": checked}))
            where = (f"random workload {k} ({scheduler} scheduler, budget {budget}, 14 blocks of 4 "
                     "tokens, shared prefixes, aborts)")
            step = 0
            while (step <= max(events) or ref.scheduler.has_unfinished_requests()) and step < 2000:
                for engine in (ref, sim):
                    with _where(ex, f"{where}, step {step}"):
                        for event in events.get(step, []):
                            if event[0] == "add":
                                engine.add_request(*event[1:], arrival_time=engine.clock)
                            else:
                                engine.abort(event[1])
                        engine.step()
                problems = kv_cache_violations(sim.scheduler)
                if problems:
                    ex.fail(f"{where}, after step {step}: {problems[0]}.")
                e, g = ((t[-1]["scheduled"], t[-1]["kv_blocks_used"]) if t else (None, None)
                        for t in (ref.step_trace, sim.step_trace))
                if len(ref.step_trace) != len(sim.step_trace) or e != g:
                    ex.fail(f"{where}, step {step}: with the reference pool the scheduler ran "
                            f"{e[0]} with {e[1]} blocks in use; with yours {g[0]} with {g[1]}.")
                step += 1
            total += step
            got, want = ({r: (x.num_cached_tokens, x.num_preemptions) for r, x in s.records.items()}
                         for s in (sim, ref))
            for rid in (r for r in want if got.get(r) != want[r]):
                ex.fail(f"{where}: request {rid} had (cached prompt tokens, preemptions) "
                        f"{got.get(rid)} with your pool, {want[rid]} with the reference.")
            problems = all_free_violations(sim.kv_cache_manager)
            if problems:
                ex.fail(f"{where}: {problems[0]}.")
    return total


ENGINE_TEXTS = [
    "The library opens at nine on weekdays and at ten on Saturdays.",
    "The library opens at nine on weekdays and closes at six in the evening.",
    "Books may be borrowed for three weeks and renewed twice online.",
    "The library opens at nine on weekdays and at ten on Saturdays. On Sundays it is closed.",
]


def _check_pool_in_engine(ex: Exercise, checked) -> None:
    """Few blocks of 4 tokens: requests share prefixes, evict each other's cache, get preempted."""
    from minivllm import LLM
    from minivllm.course.checks.common import check_model_path
    from minivllm.course.views import engine_core
    llm = LLM(check_model_path(), show_progress=False, device="cpu", block_size=4,
              num_kv_blocks=14, max_model_len=48, max_num_batched_tokens=24, max_num_seqs=4,
              block_pool_cls=checked)
    scheduler = engine_core(llm).scheduler
    manager = scheduler.kv_cache_manager
    ids = [llm.get_tokenizer().encode(t) for t in ENGINE_TEXTS]
    waves = [[(f"w{w}-{i}", ids[i], None) for i in order]
             for w, order in enumerate(((0, 2), (1, 3, 0, 2), (3, 1)))]
    where = "in the engine built with your pool (14 blocks of 4 tokens)"

    def run() -> tuple[dict, dict]:
        before = scheduler.get_stats()
        results = run_waves(llm, waves, max_tokens=4)
        after = scheduler.get_stats()
        problems = kv_cache_violations(scheduler) + all_free_violations(manager)
        if problems:
            ex.fail(f"{where}: {problems[0]}.")
        return results, {k: after[k] - before[k] for k in ("prefix_cache_hits", "num_preemptions")}

    with _where(ex, where):
        got, got_stats = run()
    manager.block_pool = BlockPool(manager.num_blocks, True)  # the same engine, the reference pool
    expected, expected_stats = run()
    if got_stats != expected_stats:
        ex.fail(f"{where} counted {got_stats}; with the reference pool {expected_stats}.")
    _same_runs(ex, llm, "built with your block pool", got, expected, waves)
