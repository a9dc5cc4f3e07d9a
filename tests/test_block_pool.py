"""Block pool and KV cache manager: LRU free queue, ref counts, hash chain, prefix hits."""

import pytest

from minivllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import encode_block, hash_block_tokens, update_block_hashes
from minivllm.core.request import Request


def test_free_queue_o1_remove_from_middle_and_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # not in the queue any more


def test_hash_chain_is_stable_and_covers_the_prefix():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])  # deterministic, no per-process salt
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    b1 = hash_block_tokens(a, [5, 6, 7, 8])
    b2 = hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert b1 != b2  # same tokens, different prefix -> different block
    assert hash_block_tokens(None, [1], ["salt"]) != hash_block_tokens(None, [1])
    # the documented encoding, checked with a hash library directly
    import hashlib

    assert a == hashlib.sha256(encode_block(None, [1, 2, 3, 4])).digest()
    assert len(hash_block_tokens(None, [1, 2], algo="xxhash")) == 16


def test_hashes_agree_across_processes():
    import subprocess
    import sys

    code = "from minivllm.core.kv_cache_utils import hash_block_tokens as h; print(h(None, [7, 8, 9], ['s']).hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert outs == {hash_block_tokens(None, [7, 8, 9], ["s"]).hex() + "\n"}


def test_cache_salt_only_on_first_block():
    r1 = Request.from_prompt("a", list(range(12)), cache_salt="tenant-1")
    r2 = Request.from_prompt("b", list(range(12)))
    h1, h2 = update_block_hashes(r1, 4), update_block_hashes(r2, 4)
    assert len(h1) == 3 and all(x != y for x, y in zip(h1, h2))


def _manager(num_blocks=10, block_size=4, caching=True):
    return KVCacheManager(num_blocks, block_size, enable_caching=caching)


def test_prefix_hit_shares_blocks_and_recomputes_last_token():
    m = _manager()
    a = Request.from_prompt("a", list(range(10)))
    assert m.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    # same 8-token prefix (2 full blocks), different tail
    b = Request.from_prompt("b", list(range(8)) + [99, 98])
    blocks, n = m.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == m.get_block_ids("a")[:2]
    m.allocate_slots(b, 2, n, blocks)
    assert [x.ref_cnt for x in blocks] == [2, 2]
    # a prompt that is exactly two full blocks: the last token is never a hit
    c = Request.from_prompt("c", list(range(8)))
    assert m.get_computed_blocks(c)[1] == 4


def test_free_in_reverse_order_evicts_tail_first_and_hits_survive_free():
    m = _manager(num_blocks=4, block_size=2)
    a = Request.from_prompt("a", [1, 2, 3, 4, 5, 6, 7])
    m.allocate_slots(a, 7)
    ids = m.get_block_ids("a")
    m.free(a)
    pool = m.block_pool
    assert [b.block_id for b in pool.free_block_queue] == list(reversed(ids))
    assert pool.get_num_cached_free_blocks() == 3  # 3 full blocks keep their hashes
    # a later request with the same prefix revives them from the free queue
    b = Request.from_prompt("b", [1, 2, 3, 4, 5, 6, 9])
    blocks, n = m.get_computed_blocks(b)
    assert n == 6
    # taking new blocks evicts least recently freed first: the tail of a's prefix
    new = pool.get_new_blocks(1)
    assert new[0].block_id == ids[-1]
    assert m.get_computed_blocks(b)[1] == 6  # the head of the prefix survived


def test_allocate_returns_none_when_full_and_leaks_nothing():
    m = _manager(num_blocks=3, block_size=4)
    a = Request.from_prompt("a", list(range(12)))
    assert m.allocate_slots(a, 12) is not None
    b = Request.from_prompt("b", [50, 51])
    assert m.allocate_slots(b, 2) is None
    assert m.get_block_ids("b") == []
    m.free(a)
    assert m.get_num_free_blocks() == 3


def test_revived_cached_blocks_count_against_free_space():
    m = _manager(num_blocks=3, block_size=2)
    a = Request.from_prompt("a", [1, 2, 3, 4, 5])
    m.allocate_slots(a, 5)
    m.free(a)  # 3 free blocks, 2 of them cached
    b = Request.from_prompt("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    blocks, n = m.get_computed_blocks(b)
    assert n == 4
    # needs 5 blocks: 2 revived + 3 new, but only 3 exist
    assert m.allocate_slots(b, 5, n, blocks) is None
    assert all(x.ref_cnt == 0 for x in blocks)


def test_prefix_caching_off_never_shares():
    m = _manager(caching=False)
    a = Request.from_prompt("a", list(range(10)))
    m.allocate_slots(a, 10)
    b = Request.from_prompt("b", list(range(10)))
    assert m.get_computed_blocks(b) == ([], 0)
    assert not m.block_pool.cached_block_hash_to_block


def test_duplicate_hash_keeps_every_copy_until_each_is_evicted():
    pool = BlockPool(4)
    h = b"h" * 32
    x, y = pool.get_new_blocks(2)
    pool.cache_full_blocks([x], [h], 0, 1)
    pool.cache_full_blocks([y], [h], 0, 1)
    assert x.block_hash == y.block_hash == h
    assert pool.get_cached_block(h) in (x, y)
    pool.free_blocks([x, y])
    assert pool.get_num_cached_free_blocks() == 2
    # evicting one copy leaves the other reachable; evicting both forgets the hash
    first = pool.get_new_blocks(3)[-1]  # the two never-used blocks, then x (LRU order)
    assert first is x and x.block_hash is None
    assert pool.get_cached_block(h) is y
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is None and not pool.cached_block_hash_to_block


def test_two_requests_computing_one_prefix_both_serve_later_hits():
    """vLLM keeps every block of a hash: whichever copy is evicted first, a later request
    with the prefix still hits the other."""
    m = _manager(num_blocks=6, block_size=4)
    prompt = list(range(8)) + [50]
    a, b = Request.from_prompt("a", prompt), Request.from_prompt("b", prompt)
    m.allocate_slots(a, 9)  # side by side: neither was cached when both were admitted
    m.allocate_slots(b, 9)
    m.free(a)
    m.free(b)
    a_ids = [x.block_id for x in m.block_pool.free_block_queue][:3]  # a's, freed first
    # evict a's blocks (least recently used): b's copies remain, under the same hashes
    evicted = m.block_pool.get_new_blocks(3)
    assert sorted(x.block_id for x in evicted) == sorted(a_ids)
    c = Request.from_prompt("c", prompt)
    blocks, n = m.get_computed_blocks(c)
    assert n == 8 and not {x.block_id for x in blocks} & set(a_ids)


def test_block_tables_and_the_free_queue_order():
    """A request's table is a copy in order; freed blocks join the free queue's tail last first."""
    m = _manager(num_blocks=6, block_size=2)
    a, b = Request.from_prompt("a", [1, 2, 3]), Request.from_prompt("b", [7, 8, 9, 10, 11])
    m.allocate_slots(a, 3)
    m.allocate_slots(b, 5)
    assert len(m.get_block_ids("a")) == 2 and len(m.get_block_ids("b")) == 3
    m.get_block_ids("a").clear()  # a copy: the manager's own table is untouched
    assert len(m.get_block_ids("a")) == 2
    a_ids = m.get_block_ids("a")
    m.free(a)  # freed last first: they join the tail of the free queue in that order
    assert [x.block_id for x in m.block_pool.free_block_queue][-2:] == list(reversed(a_ids))
    assert list(m.req_to_blocks) == ["b"] and m.get_block_ids("a") == []
