"""Random-weight checkpoints of real architectures, written with transformers.

Tests, notebooks and the GPU check script need models that load in a blink (tiny shapes) or
that have a real model's shapes without its download (throughput does not depend on the
weights' values). Both are built here with transformers' own classes and saved as ordinary
Hugging Face folders, so transformers stays an independent reference for correctness.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections import Counter

# tiny shapes per family: each covers what makes the family different
TINY_PRESETS: dict[str, dict] = {
    # GQA (4 query heads over 2 KV heads), untied lm_head, llama3 rope scaling
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
    # multi-head attention (no GQA) with tied embeddings
    "llama-tied": dict(
        model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
    ),
    # q/k/v bias, GQA, untied
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # per-head q/k RMSNorm, head_dim (32) != hidden / heads (16), tied
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}

# shapes for tensor parallelism at size 3 (the presets above have 4 heads): 6 query heads over one
# KV head (multi-query), so each rank keeps a replica of the KV head
TP_PRESETS: dict[str, dict] = {
    "llama-mqa6": dict(
        model_type="llama", hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=False,
    ),
}

# real shapes, random weights (for speed measurements)
REAL_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        tie_word_embeddings=True, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}

_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "chat_template*", "vocab.json",
                    "merges.txt")


def copy_tokenizer(src_folder: str, dst_folder: str) -> None:
    for pattern in _TOKENIZER_FILES:
        for path in glob.glob(os.path.join(src_folder, pattern)):
            shutil.copy(path, dst_folder)


def make_checkpoint(
    folder: str,
    preset: str | dict,
    tokenizer_from: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    **overrides,
) -> str:
    """Write a random-weight checkpoint (config.json + model.safetensors) into ``folder``.

    ``preset``: a key of TINY_PRESETS, TP_PRESETS or REAL_SHAPES, or a dict of config fields.
    ``tokenizer_from``: a model folder whose tokenizer files are copied alongside.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY_PRESETS.get(preset) or TP_PRESETS.get(preset) or REAL_SHAPES.get(preset)
                  or {}) if isinstance(
        preset, str) else dict(preset)
    if not fields:
        raise ValueError(f"unknown preset {preset!r}")
    fields = {
        "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.05, **fields, **overrides,
    }
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer_from:
        copy_tokenizer(tokenizer_from, folder)
    return folder


# -- reaching inside an in-process engine (tests, benchmarks and course checks look at its parts)

def engine_core(llm):
    """The ``EngineCore`` behind an ``LLM``, ``LLMEngine`` or ``AsyncLLM`` whose core runs in
    this process (its client holds it as ``engine_core``)."""
    client = getattr(llm, "llm_engine", llm).engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise ValueError(f"the engine core runs in another process ({type(client).__name__}): "
                         "its parts are not reachable from here")
    return core


def model_runner(llm):
    """The model runner of an in-process engine (``engine_core(llm).model_runner``)."""
    return engine_core(llm).model_runner


# -- the rules of a prefix-caching KV cache ----------------------------------------------------
# The rules of a prefix-caching KV cache, written once: what must hold after every step, and
# what each call to the block pool must do.
#
# Two tools, used by the package's property tests (``tests/test_properties.py``) on the
# reference ``BlockPool`` and by the course's exercise 6.2 grader on a learner's pool:
#
# * ``kv_cache_violations(scheduler)`` — the invariants of the state, between steps:
#   every ref count equals the number of live requests holding the block; the free queue holds
#   exactly the unreferenced blocks, once each; the hash map and the blocks' hashes agree both
#   ways; a hashed block a request holds carries that request's hash for that position.
# * ``CheckedBlockPool`` — wraps a pool and checks every call the KV cache manager makes
#   against a shadow model kept by block id: new blocks are the least recently freed (LRU
#   eviction) and lose their old hash; ``touch`` takes revived blocks out of the free queue;
#   ``free_blocks`` queues blocks in the order given, and they keep their hash until evicted;
#   ``cache_full_blocks`` names blocks (the first block with a hash keeps it); lookups agree.
#
# Blocks never used since the start (or since ``reset_prefix_cache``) may be taken in any order:
# they hold nothing worth keeping. Freed blocks must leave in the order they were freed.

def _h(block_hash) -> str:
    return "None" if block_hash is None else bytes(block_hash).hex()[:8]


def _block_tables(manager) -> dict[str, list[int]]:
    """request id -> the ids of the blocks it holds, for every request the manager keeps."""
    return {rid: manager.get_block_ids(rid) for rid in manager.req_to_blocks}


def kv_cache_violations(scheduler) -> list[str]:
    """Every invariant the KV cache behind ``scheduler`` breaks right now (empty: none)."""
    manager = scheduler.kv_cache_manager  # the package's KVCacheManager (no exercise replaces it)
    pool = manager.block_pool  # the package's BlockPool, or exercise 6.2's
    problems = []
    running = {r.request_id for r in scheduler.running}
    tables = _block_tables(manager)
    holding = {rid for rid, ids in tables.items() if ids}
    if holding - running:
        problems.append(f"requests {sorted(holding - running)} hold KV blocks but are not running")

    holders = Counter(i for ids in tables.values() for i in ids)
    for block in pool.blocks:
        if block.ref_cnt != holders.get(block.block_id, 0):
            problems.append(f"block {block.block_id} has ref_cnt {block.ref_cnt}, but "
                            f"{holders.get(block.block_id, 0)} live requests hold it")

    # read through the free queue itself: exercise 6.2's pool is given that attribute (a
    # FreeKVCacheBlockQueue)
    free = [b.block_id for b in pool.free_block_queue]
    twice = sorted(i for i, n in Counter(free).items() if n > 1)
    if twice:
        problems.append(f"blocks {twice} are in the free queue more than once")
    if len(free) != pool.get_num_free_blocks():
        problems.append(f"get_num_free_blocks() says {pool.get_num_free_blocks()}, but the free "
                        f"queue holds {len(free)} blocks")
    in_use_and_free = sorted(i for i in set(free) if pool.blocks[i].ref_cnt > 0)
    if in_use_and_free:
        problems.append(f"blocks {in_use_and_free} are both in the free queue and referenced "
                        "(ref_cnt > 0): get_new_blocks could hand them to a second request")
    free_set = set(free)
    lost = sorted(b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_id not in free_set)
    if lost:
        problems.append(f"blocks {lost} have ref_cnt 0 but are not in the free queue (lost)")

    def copies(entry) -> list:
        # the engine's map sends a hash to {block_id: block}; a learner's may hold a list
        if isinstance(entry, dict):
            return list(entry.values())
        return list(entry) if isinstance(entry, (list, tuple)) else [entry]

    for block_hash, entry in pool.cached_block_hash_to_block.items():
        for block in copies(entry):
            if block.block_hash != block_hash:
                problems.append(f"the hash map sends {_h(block_hash)} to block {block.block_id}, "
                                f"which carries hash {_h(block.block_hash)}")
    for block in pool.blocks:
        if block.block_hash is not None and not any(
                b is block for b in copies(pool.cached_block_hash_to_block.get(block.block_hash))):
            problems.append(f"block {block.block_id} carries hash {_h(block.block_hash)}, but the "
                            "hash map does not send that hash to it")

    for rid in tables:
        request = scheduler.requests.get(rid)
        if request is None:
            continue
        for i, block in enumerate(manager.get_blocks(rid)):
            if block.block_hash is None:
                continue
            own = request.block_hashes[i] if i < len(request.block_hashes) else None
            if block.block_hash != own:
                problems.append(f"request {rid!r} holds block {block.block_id} as its block {i}, "
                                f"which carries hash {_h(block.block_hash)}, but the request's block "
                                f"{i} hashes to {_h(own)} (a stale hash)")
    return problems


def all_free_violations(manager) -> list[str]:
    """Once every request has finished, no block may stay in use."""
    used = manager.num_blocks - manager.get_num_free_blocks()
    problems = []
    if used:
        problems.append(f"every request finished, but {used} KV blocks are still in use")
    tables = _block_tables(manager)
    if any(tables.values()):
        problems.append(f"every request finished, but {sorted(tables)} still hold blocks")
    return problems


class CheckedBlockPool:
    """A block pool with every call checked against a shadow model (by block id).

    ``on_violation(message)``: called first when a rule is broken (the course's graders raise
    their ``CheckFailed`` from it); then, or without it, a plain ``AssertionError``.
    """

    def __init__(self, pool, on_violation=None) -> None:
        self.pool = pool
        self.on_violation = on_violation
        n = pool.num_blocks
        self._ref = [0] * n
        self._hash = [None] * n
        self._map: dict = {}  # hash -> ids of the blocks carrying it, earliest cached first
        self._never_used: set[int] = set(range(n))
        self._freed: dict[int, None] = {}  # free blocks that were used, least recently freed first
        for block in pool.blocks:
            if block.ref_cnt or block.block_hash is not None:
                self._broken(f"a new pool's block {block.block_id} has ref_cnt {block.ref_cnt} and "
                             f"hash {_h(block.block_hash)}: it should be free, with no hash")
        self._expect_free_count("a new pool")

    def __getattr__(self, name):  # blocks, num_blocks, free_block_queue, enable_caching...
        return getattr(self.pool, name)

    def _broken(self, message: str) -> None:
        if self.on_violation is not None:
            self.on_violation(message)
        raise AssertionError(message)

    def _expect_free_count(self, after: str) -> None:
        expected = len(self._never_used) + len(self._freed)
        got = self.pool.get_num_free_blocks()
        if got != expected:
            self._broken(f"after {after}, get_num_free_blocks() returned {got}; expected {expected} "
                         "(the blocks nobody references)")

    # -- lookups ----------------------------------------------------------------------------
    def get_cached_block(self, block_hash):
        got = self.pool.get_cached_block(block_hash)
        copies = self._map.get(block_hash)
        expected = copies[0] if copies else None
        got_id = None if got is None else got.block_id
        if got_id != expected:
            if expected is None:
                why = "no block carries that hash any more (never cached, or evicted)"
            else:
                why = (f"block {expected} carries it" if len(copies) == 1 else
                       f"blocks {copies} carry it, and block {expected} was cached first")
            self._broken(f"get_cached_block({_h(block_hash)}...) returned "
                         f"{'None' if got is None else f'block {got_id}'}, but {why}")
        return got

    def get_num_free_blocks(self) -> int:
        self._expect_free_count("the last call")
        return self.pool.get_num_free_blocks()

    def get_num_cached_free_blocks(self) -> int:
        got = self.pool.get_num_cached_free_blocks()
        expected = sum(1 for i in self._freed if self._hash[i] is not None)
        if got != expected:
            self._broken(f"get_num_cached_free_blocks() returned {got}; expected {expected} (free "
                         "blocks that still carry a hash)")
        return got

    def get_usage(self) -> float:
        return self.pool.get_usage()

    # -- the calls that change the pool -----------------------------------------------------
    def get_new_blocks(self, num_blocks: int):
        blocks = self.pool.get_new_blocks(num_blocks)
        ids = [b.block_id for b in blocks]
        if len(ids) != num_blocks or len(set(ids)) != num_blocks:
            self._broken(f"get_new_blocks({num_blocks}) returned blocks {ids}: expected "
                         f"{num_blocks} different blocks")
        not_free = [i for i in ids if self._ref[i] > 0]
        if not_free:
            self._broken(f"get_new_blocks({num_blocks}) returned blocks {not_free}, which are in use "
                         f"(ref_cnt {[self._ref[i] for i in not_free]}): new blocks come from the "
                         "free queue only")
        never, freed_order = sorted(self._never_used), list(self._freed)
        taken_freed = num_blocks - len(never)
        if taken_freed <= 0:
            ok, expected = set(ids) <= self._never_used, f"any {num_blocks} of the never-used {never}"
        else:
            ok = set(ids) == self._never_used | set(freed_order[:taken_freed])
            expected = (f"the never-used {never}, then the {taken_freed} least recently freed "
                        f"{freed_order[:taken_freed]}")
        if not ok:
            self._broken(
                f"get_new_blocks({num_blocks}) took blocks {sorted(ids)}; expected {expected} (the "
                f"free blocks, oldest first: never-used {never}, then freed {freed_order}). LRU "
                "eviction: take blocks from the head of the free queue, to whose tail free_blocks "
                "appends them in the order it is given")
        for block in blocks:
            i = block.block_id
            old = self._hash[i]
            if block.ref_cnt != 1:
                self._broken(f"get_new_blocks returned block {i} with ref_cnt {block.ref_cnt}; "
                             "expected 1 (its new owner's reference)")
            if old is not None and (block.block_hash is not None
                                    or self.pool.get_cached_block(old) is block):
                self._broken(f"get_new_blocks reused cached-free block {i} without evicting its old "
                             f"hash {_h(old)}: delete that hash from the map and clear "
                             "block.block_hash, or a later request would read the new owner's "
                             "K/V as a prefix-cache hit")
            self._ref[i] = 1
            self._never_used.discard(i)
            self._freed.pop(i, None)
            if old is not None:
                self._map[old].remove(i)
                if not self._map[old]:
                    del self._map[old]
                self._hash[i] = None
        self._expect_free_count(f"get_new_blocks({num_blocks})")
        return blocks

    def touch(self, blocks) -> None:
        blocks = list(blocks)
        self.pool.touch(blocks)
        for block in blocks:
            i = block.block_id
            self._ref[i] += 1
            revived = i in self._freed or i in self._never_used
            self._freed.pop(i, None)
            self._never_used.discard(i)
            if block.ref_cnt != self._ref[i]:
                self._broken(f"after touch(), block {i} has ref_cnt {block.ref_cnt}; expected "
                             f"{self._ref[i]} (one more per request that shares it)")
            if block.block_hash != self._hash[i]:
                self._broken(f"touch() changed block {i}'s hash from {_h(self._hash[i])} to "
                             f"{_h(block.block_hash)}: a cache hit keeps its name")
            if revived and any(b is block for b in getattr(self.pool, "free_block_queue", ())):
                self._broken(f"touch() revived cached-free block {i} (ref_cnt 0 -> 1) but left it in "
                             "the free queue: take it out, or get_new_blocks could hand it to another "
                             "request while this one reads it")
        self._expect_free_count("touch()")

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        self.pool.free_blocks(blocks)
        for block in blocks:
            i = block.block_id
            self._ref[i] -= 1
            if self._ref[i] == 0:
                self._freed[i] = None
            if block.ref_cnt != self._ref[i]:
                self._broken(f"after free_blocks(), block {i} has ref_cnt {block.ref_cnt}; expected "
                             f"{self._ref[i]} (one less per request that released it)")
            if block.block_hash != self._hash[i]:
                self._broken(f"free_blocks() changed block {i}'s hash from {_h(self._hash[i])} to "
                             f"{_h(block.block_hash)}: a freed block keeps its hash (cached-free) "
                             "until get_new_blocks evicts it")
        queued = {b.block_id for b in getattr(self.pool, "free_block_queue", ())}
        held = sorted(b.block_id for b in blocks if self._ref[b.block_id] > 0 and b.block_id in queued)
        if held:
            self._broken(f"free_blocks() put blocks {held} in the free queue while other requests "
                         f"still hold them (ref_cnt {[self._ref[i] for i in held]}): only a block "
                         "whose ref_cnt drops to 0 is free")
        self._expect_free_count("free_blocks()")

    def cache_full_blocks(self, blocks, block_hashes, num_cached_blocks: int,
                          num_full_blocks: int) -> None:
        self.pool.cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks)
        for i in range(num_cached_blocks, num_full_blocks):
            block, h = blocks[i], block_hashes[i]
            b = block.block_id
            if self.pool.enable_caching and self._hash[b] is None:
                self._hash[b] = h
                self._map.setdefault(h, []).append(b)  # beside any block already carrying it
            if block.block_hash != self._hash[b]:
                if not self.pool.enable_caching:
                    rule = "prefix caching is off: cache nothing"
                else:
                    rule = (f"blocks {num_cached_blocks}..{num_full_blocks - 1} of the list get the "
                            "hashes at the same positions; a block that already has a hash keeps it")
                self._broken(f"after cache_full_blocks(), block {b} (position {i}) carries hash "
                             f"{_h(block.block_hash)}; expected {_h(self._hash[b])}: {rule}")
            first = self._map[self._hash[b]][0] if self._hash[b] is not None else None
            got = self.pool.get_cached_block(self._hash[b]) if first is not None else None
            if first is not None and (got is None or got.block_id != first):
                self._broken(f"after cache_full_blocks(), get_cached_block({_h(self._hash[b])}...) "
                             f"does not return block {first}, the earliest cached of the blocks "
                             f"carrying that hash ({self._map[self._hash[b]]})")

    def reset_prefix_cache(self) -> bool:
        done = self.pool.reset_prefix_cache()
        in_use = any(self._ref)
        if done == in_use:
            self._broken(f"reset_prefix_cache() returned {done} while {sum(map(bool, self._ref))} "
                         "blocks are in use: it resets (True) exactly when no block is in use")
        if done:
            self._hash = [None] * len(self._hash)
            self._map.clear()
            self._never_used = set(range(len(self._ref)))
            self._freed.clear()
        return done


def checked_block_pool_cls(pool_cls, on_violation=None):
    """A ``block_pool_cls`` for the engine that builds ``pool_cls`` pools wrapped in checks."""

    def make(num_blocks: int, enable_caching: bool = True) -> CheckedBlockPool:
        return CheckedBlockPool(pool_cls(num_blocks, enable_caching), on_violation)

    make.__name__ = f"Checked{getattr(pool_cls, '__name__', 'BlockPool')}"
    return make
