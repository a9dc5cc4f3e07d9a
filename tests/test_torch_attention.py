"""The torch attention backend's torch paths against attention written out densely, per
sequence: every ratio of query heads to KV heads (on a CPU in float32 decodes read value rows
up to ``ROWS_MAX_KV_HEADS`` KV heads; above it SDPA folds the query heads from three per KV head
up), with and without a sliding window, decodes and prefill chunks in one step, and several
groups. (In an engine on a CPU, decodes go to the C kernel when it builds:
tests/test_cpu_kernels.py.)"""

import pytest
import torch

from minivllm import cpu_kernels
from minivllm.attention import torch_backend
from minivllm.attention.torch_backend import TorchAttentionBackend, paged_decode_attention
from tests.attention_cases import context, dense, paged_case, step_case


@pytest.mark.parametrize("heads_per_kv", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_heads", [1, 2, 5])
def test_decode_equals_dense_attention(heads_per_kv, window, kv_heads, monkeypatch):
    """Up to ``ROWS_MAX_KV_HEADS`` KV heads a CPU float32 decode takes the value-row path
    (checked: it ran), above that the gather + SDPA path; both must equal dense attention."""
    calls = []
    by_rows = torch_backend.attend_decodes_by_rows
    monkeypatch.setattr(torch_backend, "attend_decodes_by_rows",
                        lambda *a, **k: calls.append(1) or by_rows(*a, **k))
    gen = torch.Generator().manual_seed(heads_per_kv)
    d = 8
    seq_lens = [1, 3, 9, 17, 30, 31]  # varied enough for several groups
    cache, table = paged_case(gen, seq_lens, kv_heads, d)
    q = torch.randn(len(seq_lens), kv_heads * heads_per_kv, d, generator=gen)
    out = paged_decode_attention(q, cache, table, torch.tensor(seq_lens), 0.3,
                                 sliding_window=window)
    assert bool(calls) == (kv_heads <= torch_backend.ROWS_MAX_KV_HEADS)
    for i, n in enumerate(seq_lens):
        keys, values = context(cache, table, i, n)
        torch.testing.assert_close(out[i:i + 1], dense(q[i:i + 1], keys, values, [n - 1], 0.3, window))


@pytest.mark.parametrize("heads_per_kv", [2, 3])
@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("query_block,window", [(None, None), (2, None), (2, 3)])
def test_backend_step_of_decodes_and_chunks_equals_dense(heads_per_kv, kv_heads, query_block,
                                                         window, monkeypatch):
    """One step as the runner hands it over: three decodes, then two prefill chunks (one after a
    cached prefix); the new tokens' K/V are written by the backend itself. Padding limits set
    so that the decodes split into groups; the C decode kernel is off (tests/test_cpu_kernels.py
    runs this step through it). With ``query_block`` the chunks' queries are attended a block at
    a time (``QUERY_BLOCK``, 128 in the engine), each against the keys its queries can see."""
    monkeypatch.setattr(torch_backend, "MAX_PADDING", 0.0)
    if query_block:
        monkeypatch.setattr(torch_backend, "QUERY_BLOCK", query_block)
    monkeypatch.setenv(cpu_kernels.ENV, "torch")
    gen = torch.Generator().manual_seed(7)
    query_lens, seq_lens = [1, 1, 1, 5, 3], [6, 13, 2, 5, 11]
    cache, table, q, k, v, qsl, positions, meta = step_case(
        gen, query_lens, seq_lens, kv_heads, kv_heads * heads_per_kv, 16, 4, num_decodes=3)
    bs = 4
    backend = TorchAttentionBackend()
    planned = backend.build_metadata(meta, bs)
    assert len(planned.decode_groups()) >= 2  # the decodes alone, unpadded, make several
    blocks = [b for g in planned.groups for b in g.query_blocks]
    # a group each (no padding allowed): 5 queries at positions 0-4, 3 at positions 8-10
    assert blocks == ([(0, 2, 2), (2, 4, 4), (4, 5, 5), (0, 2, 10), (2, 3, 11)]
                      if query_block else [])
    out = backend.forward(q, k, v, cache, planned, 0.25, sliding_window=window)
    _each_sequence_equals_dense(out, q, k, cache, table, qsl, positions, query_lens, seq_lens,
                                window)


def _each_sequence_equals_dense(out, q, k, cache, table, qsl, positions, query_lens, seq_lens,
                                window):
    for i, (ql, n) in enumerate(zip(query_lens, seq_lens)):
        keys, values = context(cache, table, i, n)
        lo = int(qsl[i])
        torch.testing.assert_close(out[lo:lo + ql], dense(q[lo:lo + ql], keys, values,
                                                          positions[lo:lo + ql], 0.25, window))
        # the backend wrote this step's keys/values where the slots say
        torch.testing.assert_close(keys[n - ql:], k[lo:lo + ql])


@pytest.mark.parametrize("window", [None, 3])
def test_query_blocks_of_a_padded_group_of_chunks_equal_dense(window, monkeypatch):
    """Two prefill chunks in one group (padding allowed): the shorter one's padding queries
    share the blocks with real ones, and each block's key limit is the group's largest."""
    monkeypatch.setattr(torch_backend, "MAX_PADDING", 10.0)
    monkeypatch.setattr(torch_backend, "QUERY_BLOCK", 2)
    gen = torch.Generator().manual_seed(3)
    query_lens, seq_lens = [5, 3], [5, 11]
    cache, table, q, k, v, qsl, positions, meta = step_case(
        gen, query_lens, seq_lens, 2, 6, 16, 4, num_decodes=0)
    backend = TorchAttentionBackend()
    planned = backend.build_metadata(meta, 4)
    assert [g.num_seqs for g in planned.groups] == [2]
    # positions 0-4 and 8-10 (then two padding queries at 0): keys seen up to 10, 11, 5
    assert planned.groups[0].query_blocks == [(0, 2, 10), (2, 4, 11), (4, 5, 5)]
    out = backend.forward(q, k, v, cache, planned, 0.25, sliding_window=window)
    _each_sequence_equals_dense(out, q, k, cache, table, qsl, positions, query_lens, seq_lens,
                                window)


def test_decode_after_an_inference_mode_step_still_carries_gradients(monkeypatch):
    """The engine attends under ``torch.inference_mode``; the course's standalone models attend
    with autograd on, in the same process: nothing the first call keeps may break the second."""
    monkeypatch.setattr(torch_backend, "_EYES", {})  # as in a fresh process
    gen = torch.Generator().manual_seed(3)
    kv_heads, d, seq_lens = 3, 8, [5, 12]
    cache, table = paged_case(gen, seq_lens, kv_heads, d)
    q = torch.randn(len(seq_lens), kv_heads * 3, d, generator=gen)
    with torch.inference_mode():
        paged_decode_attention(q.clone(), cache.clone(), table, torch.tensor(seq_lens), 0.3)
    cache.requires_grad_(True)
    q.requires_grad_(True)
    out = paged_decode_attention(q, cache, table, torch.tensor(seq_lens), 0.3)
    out.sum().backward()
    assert q.grad is not None and cache.grad is not None and cache.grad.abs().sum() > 0


def test_decode_over_a_strided_cache_equals_the_contiguous_one(monkeypatch):
    """A cache that is a strided view (here every other block of a larger one) cannot be read
    as flat value rows: the backend takes the gather + SDPA path, with the same result."""
    strided_calls = []
    by_rows = torch_backend.attend_decodes_by_rows
    monkeypatch.setattr(torch_backend, "attend_decodes_by_rows", lambda q, kv_cache, *a, **k: (
        strided_calls.append(not kv_cache.is_contiguous()) or by_rows(q, kv_cache, *a, **k)))
    gen = torch.Generator().manual_seed(5)
    kv_heads, d, seq_lens = 2, 8, [3, 14, 9]
    cache, table = paged_case(gen, seq_lens, kv_heads, d)
    wide = torch.zeros(2, cache.shape[1] * 2, *cache.shape[2:])
    wide[:, ::2] = cache
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    q = torch.randn(len(seq_lens), kv_heads * 3, d, generator=gen)
    lens = torch.tensor(seq_lens)
    torch.testing.assert_close(paged_decode_attention(q, strided, table, lens, 0.3),
                               paged_decode_attention(q, cache, table, lens, 0.3))
    assert strided_calls and not any(strided_calls)  # value rows for the contiguous one only
