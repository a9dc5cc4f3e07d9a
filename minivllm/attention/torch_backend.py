"""Paged attention in plain torch: the reference every faster backend is tested against.

The reference functions a learner reads first (chapter 03):

* ``write_to_kv_cache``       — scatter new K/V into their slots (vLLM's ``reshape_and_cache``);
* ``gather_context``          — read sequences' K or V back through their block tables;
* ``paged_decode_attention``  — one query per sequence over its whole context;
* ``paged_prefill_attention`` — variable-length query chunks, causal among the new tokens and
  attending to everything before them (a cached prefix, earlier chunks).

``TorchAttentionBackend`` runs the same math for a whole step with a fixed number of torch ops
per layer, whatever the batch: the runner's metadata is planned once per step on the host
(``build_metadata``) into a few *groups* of sequences with similar context lengths. Each group
is one batched call — gather its blocks with one ``index_select`` per K and V, then
``scaled_dot_product_attention`` with a length/causal mask and ``enable_gqa`` (query heads share
their KV head; K/V are never repeated; a decode group folds the heads sharing a KV head into
that head's queries) — so every layer reads each sequence's context once, padded only to its
group's longest, and never waits for the host.

On a CPU in float32 a decode group skips the value gather and SDPA
(``attend_decodes_by_rows``): the scores come from one batched matmul with the gathered keys,
and the probability-weighted sum of value rows is read straight out of the cache by
``F.embedding_bag``, which takes row indices and per-row weights.

In an engine on a CPU, float32, the backend hands all of a step's decodes to one call of a C
kernel instead (``minivllm/cpu_kernels.py``), which reads each token's K and V rows once from
their blocks, and all of its prefill chunks to one call of another (head sizes that are
multiples of 16); the torch paths above serve when they are not built, are turned off, or
autograd needs the graph, and the reference functions below always use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from minivllm import cpu_kernels
from minivllm.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.utils import cdiv

# padded work a plan may add on top of the exact work before it splits into more groups
MAX_PADDING = 0.2
MAX_DECODE_GROUPS = 4
MAX_PREFILL_GROUPS = 4
# decodes fold the query heads of a KV head into its queries from this many heads per KV head:
# on a 2-core x86 CPU that was faster from 3 (1.1-1.7x per call, head_dim 64), and with 2 it
# was slower for 256 sequences of head_dim 16-32 over 200-500 tokens
FOLD_MIN_HEADS_PER_KV_HEAD = 3
# decodes on a CPU in float32 take the gather-free value path (``attend_decodes_by_rows``) up
# to this many KV heads: its key product multiplies every query head with every KV head's
# slice of a key row (a block-diagonal query), so its arithmetic grows with the KV heads
ROWS_MAX_KV_HEADS = 4
# a prefill group's queries are attended this many at a time, each block against only the keys
# its queries can see (a causal chunk's first block sees an eighth of a 1,024-token context):
# one call for a whole 512-token chunk computes the masked half too. On a 2-core x86 CPU, 9
# heads, head_dim 64: a fresh 512-token chunk 4.2 ms against 5.5, a 496-token chunk after 512
# cached tokens 8.2 against 10.3, two 256-token chunks 2.6 against 2.7
QUERY_BLOCK = 128


def write_to_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token t's key and value at slot ``slot_mapping[t]``; slots < 0 are skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    n = slot_mapping.shape[0]
    k, v = k[:n], v[:n]
    if (slot_mapping < 0).any():
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, d] + [seqs, blocks] -> [seqs, num_tokens, kv_heads, d]."""
    block_size = cache.shape[1]
    num_seqs = block_tables.shape[0]
    num_blocks = cdiv(num_tokens, block_size)
    ids = block_tables[:, :num_blocks].reshape(-1)
    ctx = gather_blocks(cache, ids).view(num_seqs, num_blocks * block_size, *cache.shape[2:])
    return ctx[:, :num_tokens]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks ``block_ids`` of a [num_blocks, block_size, kv_heads, d] cache, stacked:
    [len(block_ids) * block_size, kv_heads, d]. One ``index_select`` of whole blocks, each a
    row of contiguous memory: on a CPU about 3x faster than selecting from the 4-d tensor,
    and far faster than fancy indexing. ``out``: a flat buffer to write into (at least that
    many elements), so a step's many gathers reuse memory instead of allocating it afresh."""
    if not cache.is_contiguous():  # a strided view (no flat rows to copy): the 4-d select
        return cache.index_select(0, block_ids).flatten(0, 1)
    flat = cache.view(cache.shape[0], -1)
    if out is None:
        rows = flat.index_select(0, block_ids)
    else:
        rows = out[: block_ids.shape[0] * flat.shape[1]].view(-1, flat.shape[1])
        torch.index_select(flat, 0, block_ids, out=rows)
    return rows.view(-1, *cache.shape[2:])


class GatherWorkspace:
    """Two flat buffers, for a group's gathered K and V, grown to the largest group seen and
    reused by every layer and step (one layer's attention runs at a time). Writing into memory
    already touched saves a CPU the page faults of fresh large allocations: in a decode step of
    the bundled model at batch 40 that halved the time of a gather."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def buffers(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (self.k is None or self.k.numel() < numel or self.k.dtype != like.dtype
                or self.k.device != like.device):
            self.k = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.v = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self.k, self.v


def gather_buffers(workspace: GatherWorkspace | None, numel: int, kv_cache: torch.Tensor
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Where a group's gathered K and V go: the workspace's buffers, or (None, None) for fresh
    memory when there is no workspace or the cache carries a graph (``out=`` cannot)."""
    if workspace is None or kv_cache.requires_grad:
        return None, None
    return workspace.buffers(numel, kv_cache)


# -- planning a step: which sequences are attended together ----------------------------------

@dataclass
class AttentionGroup:
    """Sequences attended in one batched call, padded to the longest query and context."""

    num_seqs: int
    query_pad: int  # queries per sequence after padding (1 for decodes)
    kv_len: int  # context tokens per sequence after padding (whole blocks)
    query_index: torch.Tensor  # [num_seqs * query_pad] token of the batch behind each query
    block_ids: torch.Tensor  # [num_seqs * kv_len / block_size] the blocks to read, in order
    mask: torch.Tensor  # [num_seqs, 1, query_pad, kv_len] bool: which keys each query sees
    # where the real (unpadded) queries sit in the padded ones; None: no padding
    real_queries: torch.Tensor | None
    out_index: torch.Tensor  # [real queries] token of the batch each result belongs to
    # [num_seqs, 1, query_pad, 1] each query's position (0 for padding queries): what a
    # sliding-window layer narrows the mask with
    positions: torch.Tensor | None = None
    # (first, end, keys): queries [first, end) see no key past the first ``keys`` (prefills
    # longer than QUERY_BLOCK); empty: one call for all
    query_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    # masks built once per step (not once per layer): by sliding window, and additive ones
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    additive_masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    value_rows_by_heads: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def value_rows(self, num_kv_heads: int, heads_per_kv_head: int, block_size: int
                   ) -> torch.Tensor:
        """[num_seqs * heads, kv_len]: for each sequence and query head, the row of the value
        cache viewed as [slots * kv_heads, head_dim] holding each context token's value for
        that head's KV head (row = slot * kv_heads + kv_head). Built once per step."""
        key = (num_kv_heads, heads_per_kv_head, block_size)
        rows = self.value_rows_by_heads.get(key)
        if rows is None:
            g, L = self.num_seqs, self.kv_len
            offsets = torch.arange(block_size, device=self.block_ids.device)
            slots = (self.block_ids.view(g, -1, 1).long() * block_size + offsets).view(g, 1, 1, L)
            kv = torch.arange(num_kv_heads, device=slots.device).view(1, -1, 1, 1)
            rows = (slots * num_kv_heads + kv).expand(g, num_kv_heads, heads_per_kv_head, L)
            rows = self.value_rows_by_heads[key] = rows.reshape(-1, L)
        return rows

    def mask_for(self, sliding_window: int | None, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        """The full causal mask, or (sliding window w) only keys p - w < k <= p. With a
        ``dtype``: the same mask as 0 (attend) / -inf (skip) of that dtype, what
        ``scaled_dot_product_attention`` would otherwise convert a boolean mask into on every
        call, that is in every layer."""
        if dtype is not None:
            key = (sliding_window, dtype)
            mask = self.additive_masks.get(key)
            if mask is None:
                allowed = self.mask_for(sliding_window)
                mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                mask.masked_fill_(~allowed, float("-inf"))
                self.additive_masks[key] = mask
            return mask
        if sliding_window is None:
            return self.mask
        mask = self.window_masks.get(sliding_window)
        if mask is None:
            keys = torch.arange(self.kv_len, device=self.mask.device)
            mask = self.mask & (keys > self.positions - sliding_window)
            self.window_masks[sliding_window] = mask
        return mask


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    block_size: int = 0
    _prefill_groups: list[AttentionGroup] | None = None
    _decode_groups: list[AttentionGroup] | None = None

    @property
    def groups(self) -> list[AttentionGroup]:
        """The prefill chunks' groups, planned on first use: a step whose prefills all go to
        the CPU kernel (``cpu_kernels``) never plans them."""
        if self._prefill_groups is None:
            self._prefill_groups = plan_groups(
                self.query_start_loc_cpu, self.seq_lens_cpu, self.num_decodes,
                self.block_tables, self.block_size, decodes=False)
        return self._prefill_groups

    def decode_groups(self) -> list[AttentionGroup]:
        """The decodes' groups, planned on first use: a step whose decodes all go to the CPU
        kernel (``cpu_kernels``) never plans them."""
        if self._decode_groups is None:
            self._decode_groups = plan_groups(
                self.query_start_loc_cpu, self.seq_lens_cpu, self.num_decodes,
                self.block_tables, self.block_size, prefills=False)
        return self._decode_groups


def split_sorted(costs: np.ndarray, exact: float, padded_cost, max_groups: int) -> list[np.ndarray]:
    """Cut sequences (sorted by context length) into the fewest equal-count groups whose padded
    cost stays within ``MAX_PADDING`` of ``exact``, at most ``max_groups``."""
    n = len(costs)
    for k in range(1, min(max_groups, n) + 1):
        parts = np.array_split(np.arange(n), k)
        if k == min(max_groups, n) or padded_cost(parts) <= (1 + MAX_PADDING) * exact:
            return parts
    return [np.arange(n)]


def plan_groups(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_decodes: int,
    block_tables: torch.Tensor, block_size: int, decodes: bool = True, prefills: bool = True,
) -> list[AttentionGroup]:
    """Group the step's sequences (decodes first, then prefill chunks) for batched attention;
    ``decodes`` / ``prefills`` False leaves those out."""
    device = block_tables.device
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_lens = np.diff(query_start_loc)
    groups = []
    for lo, hi, max_groups, wanted in (
            (0, num_decodes, MAX_DECODE_GROUPS, decodes),
            (num_decodes, len(seq_lens), MAX_PREFILL_GROUPS, prefills)):
        if hi <= lo or not wanted:
            continue
        seqs = lo + np.argsort(seq_lens[lo:hi], kind="stable")
        q_lens, s_lens = query_lens[seqs], seq_lens[seqs]

        def padded(parts, q_lens=q_lens, s_lens=s_lens):
            return sum(len(p) * q_lens[p].max() * s_lens[p].max() for p in parts)

        exact = float((q_lens * s_lens).sum())
        for part in split_sorted(s_lens, exact, padded, max_groups):
            groups.append(_make_group(seqs[part], query_start_loc, query_lens, seq_lens,
                                      block_tables, block_size, device))
    return groups


def _make_group(seqs, query_start_loc, query_lens, seq_lens, block_tables, block_size,
                device) -> AttentionGroup:
    g = len(seqs)
    q_lens, s_lens = query_lens[seqs], seq_lens[seqs]
    query_pad = int(q_lens.max())
    num_blocks = cdiv(int(s_lens.max()), block_size)
    kv_len = num_blocks * block_size

    offsets = np.arange(query_pad)
    real = offsets[None, :] < q_lens[:, None]  # [g, query_pad]
    token = query_start_loc[seqs][:, None] + offsets[None, :]
    query_index = np.where(real, token, 0).reshape(-1)
    # query j of a sequence sits at position (seq_len - query_len + j); padding queries see key 0
    pos = (s_lens - q_lens)[:, None] + offsets[None, :]
    keys = np.arange(kv_len)
    mask = keys[None, None, :] <= pos[:, :, None]
    mask[~real] = keys == 0
    pos = np.where(real, pos, 0)  # a padding query keeps key 0 under any window

    rows = torch.from_numpy(seqs).to(device)
    block_ids = block_tables.index_select(0, rows)[:, :num_blocks].reshape(-1)
    padded = not real.all()
    return AttentionGroup(
        num_seqs=g, query_pad=query_pad, kv_len=kv_len,
        query_index=torch.from_numpy(query_index).to(device),
        block_ids=block_ids,
        mask=torch.from_numpy(mask[:, None]).to(device),
        real_queries=torch.from_numpy(np.flatnonzero(real)).to(device) if padded else None,
        out_index=torch.from_numpy(token[real]).to(device),
        positions=torch.from_numpy(pos[:, None, :, None]).to(device),
        query_blocks=query_blocks(pos) if query_pad > QUERY_BLOCK else [],
    )


def query_blocks(pos: np.ndarray) -> list[tuple[int, int, int]]:
    """``AttentionGroup.query_blocks`` for queries at positions ``pos`` [seqs, query_pad]."""
    query_pad = pos.shape[1]
    return [(a, min(a + QUERY_BLOCK, query_pad), int(pos[:, a:a + QUERY_BLOCK].max()) + 1)
            for a in range(0, query_pad, QUERY_BLOCK)]


def attend_group(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, scale: float,
                 out: torch.Tensor, sliding_window: int | None = None,
                 workspace: GatherWorkspace | None = None) -> None:
    """One group's attention: gather its blocks once, one masked SDPA call (for a prefill, one
    per block of ``QUERY_BLOCK`` queries), scatter results.
    A sliding-window layer uses the same call with a narrower mask (still reading the whole
    context: simple, and exact). ``workspace``: where the gathered K/V go (else fresh memory)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[-2]
    g, qp, L = group.num_seqs, group.query_pad, group.kv_len
    if (qp == 1 and q.device.type == "cpu" and q.dtype == torch.float32
            and num_kv_heads <= ROWS_MAX_KV_HEADS and kv_cache.is_contiguous()):
        return attend_decodes_by_rows(q, kv_cache, group, scale, out, sliding_window, workspace)
    qg = q.index_select(0, group.query_index).view(g, qp, num_heads, head_dim).transpose(1, 2)
    kbuf, vbuf = gather_buffers(workspace, g * L * num_kv_heads * head_dim, kv_cache)
    k = gather_blocks(kv_cache[0], group.block_ids, kbuf).view(g, L, num_kv_heads, head_dim)
    v = gather_blocks(kv_cache[1], group.block_ids, vbuf).view(g, L, num_kv_heads, head_dim)
    # decodes: the query heads sharing a KV head become that head's queries (GQA folded into
    # the query length), so each KV head's context is read once, not once per query head; the
    # group's one mask row is every such query's
    fold = qp == 1 and num_heads >= FOLD_MIN_HEADS_PER_KV_HEAD * num_kv_heads
    if fold:
        qg = qg.reshape(g, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k, v, mask = k.transpose(1, 2), v.transpose(1, 2), group.mask_for(sliding_window, q.dtype)
    if group.query_blocks and not fold:
        o = torch.cat([F.scaled_dot_product_attention(
            qg[:, :, first:end], k[:, :, :keys], v[:, :, :keys],
            attn_mask=mask[..., first:end, :keys], scale=scale, enable_gqa=True)
            for first, end, keys in group.query_blocks], dim=2)
    else:
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=not fold)
    # [g, kv_heads, heads per kv head, d] folded, else [g, heads, query_pad, d]
    o = o.reshape(g, num_heads, head_dim) if fold else (
        o.transpose(1, 2).reshape(g * qp, num_heads, head_dim))
    if group.real_queries is not None:
        o = o.index_select(0, group.real_queries)
    out.index_copy_(0, group.out_index, o.to(out.dtype))


def attend_decodes_by_rows(q: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup,
                           scale: float, out: torch.Tensor, sliding_window: int | None = None,
                           workspace: GatherWorkspace | None = None) -> None:
    """A decode group's attention reading the values straight from the cache.

    The keys are gathered as in ``attend_group`` and multiplied with the queries in one batched
    matmul; then each head's output, the sum of its context's value rows weighted by their
    softmax probabilities, is exactly what ``F.embedding_bag(mode="sum", per_sample_weights=)``
    computes from a table of rows (the value cache) and their indices (``value_rows``). So the
    values are never copied out of their blocks (docs/hot_path.md has the measured gain).

    The key product is batched over the group's sequences with a block-diagonal query (head h's
    vector sits in its KV head's part of a [kv_heads * d] row, zeros elsewhere), so it reads the
    gathered keys as they lie, at the price of kv_heads times the multiply-adds: hence
    ``ROWS_MAX_KV_HEADS``."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    g, L = group.num_seqs, group.kv_len
    qg = q.index_select(0, group.query_index)  # [g, heads, d]
    if num_kv_heads > 1:  # block-diagonal: head h meets only its KV head's part of a key row
        qg = (qg.view(g, num_kv_heads, per_kv, 1, head_dim) * _eye(num_kv_heads, q)).view(
            g, num_heads, num_kv_heads * head_dim)
    kbuf, _ = gather_buffers(workspace, g * L * num_kv_heads * head_dim, kv_cache)
    k = gather_blocks(kv_cache[0], group.block_ids, kbuf).view(g, L, num_kv_heads * head_dim)
    mask = group.mask_for(sliding_window, q.dtype).view(g, 1, L)
    probs = torch.softmax(torch.baddbmm(mask, qg, k.transpose(1, 2), alpha=scale), dim=-1)
    o = F.embedding_bag(group.value_rows(num_kv_heads, per_kv, block_size),
                        kv_cache[1].view(-1, head_dim), mode="sum",
                        per_sample_weights=probs.view(-1, L))
    out.index_copy_(0, group.out_index, o.view(g, num_heads, head_dim).to(out.dtype))


_EYES: dict[tuple, torch.Tensor] = {}


def _eye(n: int, like: torch.Tensor) -> torch.Tensor:
    """[1, n, 1, n, 1]: multiplies [g, kv_heads, per_kv, 1, d] queries into block-diagonal ones."""
    key = (n, like.dtype, like.device)
    if key not in _EYES:
        # a normal tensor even when first made in an engine step (under inference mode): the
        # course's standalone models run this with autograd on, and may reuse it
        with torch.inference_mode(False):
            _EYES[key] = torch.eye(n, dtype=like.dtype, device=like.device).view(1, n, 1, n, 1)
    return _EYES[key]


# -- the reference functions, one call = one group -------------------------------------------

def paged_decode_attention(
    q: torch.Tensor,  # [seqs, heads, d]: one query token per sequence
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Each sequence's single query (its last token) over its whole context (or, with a
    sliding window w, over its last w tokens)."""
    lens = seq_lens.cpu().numpy().astype(np.int64)
    qsl = np.arange(len(lens) + 1)
    return _attend_all(q, kv_cache, qsl, lens, len(lens), block_tables, scale, sliding_window)


def paged_prefill_attention(
    q: torch.Tensor,  # [tokens, heads, d]
    kv_cache: torch.Tensor,
    query_start_loc,
    seq_lens,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context, read from the
    cache (the new tokens' K/V must already be written there); with a sliding window w, the
    query at position p sees keys p - w < k <= p only."""
    qsl = np.asarray(torch.as_tensor(query_start_loc).cpu(), dtype=np.int64)
    lens = np.asarray(torch.as_tensor(seq_lens).cpu(), dtype=np.int64)
    return _attend_all(q, kv_cache, qsl, lens, 0, block_tables, scale, sliding_window)


def _attend_all(q, kv_cache, qsl, lens, num_decodes, block_tables, scale,
                sliding_window=None) -> torch.Tensor:
    out = torch.empty_like(q)
    for group in plan_groups(qsl, lens, num_decodes, block_tables, kv_cache.shape[2]):
        attend_group(q, kv_cache, group, scale, out, sliding_window)
    return out


class TorchAttentionBackend(AttentionBackend):
    """The whole step in a few batched torch calls per layer, planned once per step."""

    name = "torch"

    def __init__(self) -> None:
        self.workspace = GatherWorkspace()  # one per engine (per runner): layers run in turn

    def build_metadata(self, metadata: AttentionMetadata, block_size: int) -> TorchAttentionMetadata:
        fields = {f: getattr(metadata, f) for f in AttentionMetadata.__dataclass_fields__}
        if fields["query_start_loc_cpu"] is None:  # built by hand: the host copies from these
            fields["query_start_loc_cpu"] = metadata.query_start_loc.cpu().numpy()
            fields["seq_lens_cpu"] = metadata.seq_lens.cpu().numpy()
        return TorchAttentionMetadata(**fields, block_size=block_size)

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None):
        n = metadata.num_actual_tokens
        slots = metadata.slot_mapping[:n]  # real tokens never have a negative slot
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[:n])
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[:n])
        if not isinstance(metadata, TorchAttentionMetadata):  # not planned (called directly)
            metadata = self.build_metadata(metadata, kv_cache.shape[2])
        out = torch.empty_like(q)
        d, native = metadata.num_decodes, cpu_kernels.can_run(q, kv_cache)
        if d and not (native and cpu_kernels.paged_decode(
                q[:d], kv_cache, metadata.block_tables, metadata.seq_lens, scale, out[:d],
                sliding_window)):
            for group in metadata.decode_groups():
                attend_group(q, kv_cache, group, scale, out, sliding_window, self.workspace)
        if metadata.num_prefills and not (native and cpu_kernels.paged_prefill(
                q, kv_cache, metadata.block_tables[d:], metadata.seq_lens[d:],
                metadata.query_start_loc[d:], scale, out, sliding_window)):
            for group in metadata.groups:
                attend_group(q, kv_cache, group, scale, out, sliding_window, self.workspace)
        return out
