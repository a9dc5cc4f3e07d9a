"""The pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache map.

Every KV block is in exactly one of three states (chapter 06 draws them):

* in use      — ``ref_cnt > 0``: one or more running requests hold it (shared prefixes: many);
* cached-free — ``ref_cnt == 0`` but still carrying its ``block_hash``: its K/V stay valid, it
                sits in the free queue, and a new request with the same prefix can revive it;
                several blocks may carry one hash (two requests computed the same prefix side
                by side): each stays reachable by that hash until it is evicted itself;
* free        — ``ref_cnt == 0``, no hash: plain free space.

Free blocks are kept in a doubly linked queue, least recently freed at the head. New blocks
are taken from the head, which evicts their old hash (LRU eviction); a cache hit pulls a block
out of the *middle* of the queue, which the links make O(1).
"""

from __future__ import annotations

from collections.abc import Iterable

from minivllm.core.kv_cache_utils import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; O(1) popleft, append, and remove from the middle."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # two sentinels make every real block have both neighbours: no edge cases
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self._tail.prev_free_block = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self._tail.prev_free_block = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free_block
        while block is not self._tail:
            yield block
            block = block.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}, every block that carries the hash (vLLM's BlockHashToBlockMap)
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    # -- lookups ---------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block carrying this hash (the earliest cached of its copies), or None."""
        copies = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(copies.values())) if copies else None

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a hash (reusable by a cache hit until evicted)."""
        return sum(1 for copies in self.cached_block_hash_to_block.values()
                   for b in copies.values() if b.ref_cnt == 0)

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    # -- allocation ------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue (least recently used first)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        copies = self.cached_block_hash_to_block.get(block.block_hash)
        if copies is not None and copies.get(block.block_id) is block:
            del copies[block.block_id]
            if not copies:
                del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts sharing these (cache-hit) blocks: pull free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks nobody holds go to the queue's tail (in order)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than it was taken")
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] their hashes and enter them in the map.

        If another block already holds the same hash (two requests computed the same prefix
        side by side), both are kept under it: whichever is evicted first, the other still
        serves a later request's cache hit.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a cache hit: already named
            h = block_hashes[i]
            block.block_hash = h
            self.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (only when no block is in use). Returns whether it did."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
