"""The KV cache manager: which blocks each request holds, and which prefix it can reuse.

The scheduler asks three questions of it (vLLM v1's API, chapter 06):

* ``get_computed_blocks(request)`` — how much of this prompt is already in the cache?
  The longest run of cached *full* blocks from the start; the last prompt token is always
  recomputed, because its logits are needed to sample the first output token.
* ``allocate_slots(request, num_new_tokens, ...)`` — find room for this step's tokens, or
  return None if the pool cannot (the scheduler then preempts or waits). Blocks that will be
  full once this step runs are hashed and cached right away, so a request scheduled later in
  the *same* step can already share them.
* ``free(request)`` — release its blocks, last block first, so the tail of a prefix is the
  first to be evicted and the shared head of it the last.

How a request's blocks are named is one function, ``block_hasher(request, block_size)``
(``update_block_hashes`` with the configured hash algorithm unless another is given): chapter
06's exercise swaps in the learner's hash chain here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from minivllm.core.block_pool import BlockPool, KVCacheBlock
from minivllm.core.kv_cache_utils import BlockHash, update_block_hashes
from minivllm.core.request import Request
from minivllm.utils import cdiv


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        block_pool_cls: type = BlockPool,
        block_hasher: Callable[[Request, int], list[BlockHash]] | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # extends request.block_hashes to cover its full blocks, and returns them
        self.block_hasher = block_hasher or functools.partial(update_block_hashes, algo=hash_algo)
        self.block_pool = block_pool_cls(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The request's longest cached prefix: (blocks, number of tokens they hold)."""
        if not self.enable_caching:
            return [], 0
        hashes = self.block_hasher(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size  # keep >= 1 token to compute
        hits: list[KVCacheBlock] = []
        for h in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens (after any cache hit). None: no room."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        blocks = self.req_to_blocks.get(request.request_id)
        if (blocks and not new_computed_blocks
                and num_tokens_after <= len(blocks) * self.block_size
                and (not self.enable_caching or num_tokens_after // self.block_size
                     <= self.num_cached_blocks.get(request.request_id, 0))):
            return []  # most decode steps: the token fits in the last block, which stays partial
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = cdiv(num_tokens_after, self.block_size) - len(blocks) - len(new_computed_blocks)
        # hit blocks nobody holds sit in the free queue: reviving them uses up free slots too
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.get_num_free_blocks() - num_revived:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)

        if self.enable_caching:
            num_full = num_tokens_after // self.block_size
            already = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > already:  # a block fills up in this step (a decode: 1 step in 16)
                hashes = self.block_hasher(request, self.block_size)
                self.block_pool.cache_full_blocks(blocks, hashes, already, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
