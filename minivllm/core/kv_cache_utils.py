"""The block hash chain: how a full KV block gets a name that any later request can look up.

A block's hash covers its parent's hash, its own token ids and any extra keys, so two blocks
share a hash only if the *entire prefix* up to and including them is the same:

    hash(block i) = H( hash(block i-1) | token ids of block i | extra keys of block i )

The encoding is canonical and the function fixed (SHA-256 by default, or xxHash's XXH3-128),
never Python's ``hash()``: Python salts string hashes per process, so two processes — the API
server and the engine core, or yesterday's run and today's — would disagree.

Canonical encoding of one block (all integers little-endian):
    b"mvb1" | parent hash (or 32 zero bytes for the first block)
           | uint32 token count | uint32 token ids ...
           | UTF-8 JSON list of extra keys (b"[]" when none)
Extra keys of the first block include the request's ``cache_salt``, so a tenant with its own
salt never shares (or reveals) a prefix with anyone else.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

BlockHash = bytes
ROOT_PARENT = bytes(32)
_MAGIC = b"mvb1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS = {"sha256": _sha256, "xxhash": _xxhash}
_PACKERS: dict[int, struct.Struct] = {}  # one compiled struct per block length


def encode_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence | None = None
) -> bytes:
    n = len(token_ids)
    packer = _PACKERS.get(n) or _PACKERS.setdefault(n, struct.Struct(f"<I{n}I"))
    tokens = packer.pack(n, *token_ids)
    # b"[]" is what the JSON of no extra keys encodes to (the common case: skip the encoder)
    extra = json.dumps(list(extra_keys), separators=(",", ":")).encode() if extra_keys else b"[]"
    return _MAGIC + (parent_hash or ROOT_PARENT) + tokens + extra


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence | None = None,
    algo: str = "sha256",
) -> BlockHash:
    return HASH_FUNCTIONS[algo](encode_block(parent_hash, token_ids, extra_keys))


def block_extra_keys(block_index: int, cache_salt: str | None) -> list:
    return [cache_salt] if block_index == 0 and cache_salt is not None else []


def update_block_hashes(request, block_size: int, algo: str = "sha256") -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens; return them."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    hash_fn = HASH_FUNCTIONS[algo]
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        block = tokens[i * block_size : (i + 1) * block_size]
        extra = block_extra_keys(i, request.cache_salt)
        hashes.append(hash_fn(encode_block(parent, block, extra)))
    return hashes
