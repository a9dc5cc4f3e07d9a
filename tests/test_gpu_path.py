"""What a GPU does differently from the CPU tests, checked without one (docs/gpu.md, "found by
reading the GPU path"): the pinned-buffer fence, the default dtype per compute capability,
``cuda:N`` made the current device, weights cast before they are materialised, the decode
reduce over many partitions, and the smaller float32 tiles at head size 128 (under Triton's
interpreter, as the test configuration runs every kernel without CUDA)."""

import dataclasses

import pytest
import torch

from minivllm.attention.torch_backend import paged_decode_attention as ref_decode
from minivllm.attention.torch_backend import paged_prefill_attention as ref_prefill
from tests.attention_cases import paged_case


# -- the fence on pinned host buffers ------------------------------------------------------------
class FakeEvent:
    log: list = []

    def record(self):
        FakeEvent.log.append("record")

    def synchronize(self):
        FakeEvent.log.append("wait")


def test_each_step_waits_for_the_last_steps_copies_before_writing_its_buffers(tiny_llama):
    """A prompt of four chunks: three steps sample nothing (no host sync ends them), yet every
    step must wait for the previous step's copies before its buffers are written again."""
    from minivllm import LLM, SamplingParams
    from minivllm.testing import model_runner
    from minivllm.worker.model_runner import CopyFence

    llm = LLM(tiny_llama, skip_tokenizer_init=True, show_progress=False, max_num_batched_tokens=16,
              max_num_seqs=2, max_model_len=128, num_kv_blocks=32, block_size=8)
    runner = model_runner(llm)
    runner.copy_fence = CopyFence(torch.device("cuda"), event_factory=FakeEvent)
    original = runner._update_states

    def update(so):
        FakeEvent.log.append("write")
        return original(so)

    runner._update_states = update
    FakeEvent.log = []
    out = llm.generate([{"prompt_token_ids": list(range(3, 63))}],
                       SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    log = FakeEvent.log
    steps = log.count("write")
    assert steps >= 6  # 4 prefill chunks, then decodes
    assert log.count("record") == steps  # every step records after its copies
    # from the second step on, each write is preceded by a wait on the previous record
    for i, entry in enumerate(log):
        if entry == "write" and i > 0:
            assert log[i - 1] == "wait", log
    assert log[0] == "write" and log[1] == "record"


# -- the default dtype follows the device ----------------------------------------------------------
@pytest.mark.parametrize("capability,checkpoint,expected", [
    ((7, 5), torch.bfloat16, torch.float16),  # T4: bfloat16 is emulated there
    ((7, 5), torch.float32, torch.float16),
    ((7, 0), torch.float16, torch.float16),
    ((8, 0), torch.float32, torch.bfloat16),
    ((9, 0), torch.bfloat16, torch.bfloat16),
    ((9, 0), torch.float16, torch.float16),  # a float16 checkpoint stays float16
])
def test_default_dtype_on_a_gpu_follows_its_compute_capability(monkeypatch, capability, checkpoint,
                                                               expected):
    from minivllm.config import _resolve_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert _resolve_dtype("auto", torch.device("cuda"), checkpoint) == expected
    assert _resolve_dtype("bfloat16", torch.device("cuda"), checkpoint) == torch.bfloat16
    assert _resolve_dtype("auto", torch.device("cpu"), checkpoint) == torch.float32


# -- cuda:N with one rank -------------------------------------------------------------------------
class _NoRunner:
    def __init__(self, config, show_progress=True):
        self.config = config


def test_cuda_n_with_one_rank_becomes_the_current_device(tiny_llama, monkeypatch):
    from minivllm.config import DeviceConfig, EngineArgs
    from minivllm.worker.worker import Worker

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d)))
    config = EngineArgs(model=tiny_llama, skip_tokenizer_init=True,
                        model_runner_cls=_NoRunner).create_config()
    Worker(dataclasses.replace(config, device_config=DeviceConfig(torch.device("cuda", 1))))
    assert calls == [torch.device("cuda", 1)]
    calls.clear()
    Worker(config)  # the CPU: nothing to select
    assert calls == []


# -- weights cast on meta, before they take memory -------------------------------------------------
def test_loader_materialises_parameters_in_the_serving_dtype(tiny_llama, monkeypatch):
    from minivllm.model.config import ModelConfig
    from minivllm.model.loader import load_model

    seen = []
    original = torch.nn.Module.to_empty

    def to_empty(self, *args, **kwargs):
        seen.append({p.dtype for p in self.parameters()})
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)
    model = load_model(tiny_llama, ModelConfig.from_pretrained(tiny_llama), torch.device("cpu"),
                       torch.bfloat16, show_progress=False)
    assert seen == [{torch.bfloat16}]  # already bfloat16 when memory is allocated
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" for p in model.parameters())


# -- kernels: many partitions, float32 tiles at head size 128 --------------------------------------
def test_decode_reduce_combines_more_partitions_than_one_tile_holds():
    from minivllm.kernels import decode_attention as da

    seq_lens = [2500, 70, 1]  # 2500 tokens in partitions of 64: 40 partitions, > BLOCK_S
    cache, table = paged_case(torch.Generator().manual_seed(0), seq_lens, 2, 32, 16)
    q = torch.randn(3, 4, 32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = ref_decode(q, cache, table, lens, 0.3)
    out = da.paged_decode_attention(q, cache, table, lens, 0.3, max_seq_len=2560, num_splits=40)
    assert -(-2560 // 64) > da.BLOCK_S
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


def test_float32_at_head_size_128_takes_smaller_tiles_and_stays_exact():
    from minivllm.kernels import decode_attention as da
    from minivllm.kernels import prefill_attention as pa

    assert da.decode_block_n(torch.float32, 128) == 32 and da.decode_block_n(torch.bfloat16, 128) == 64
    assert pa.prefill_tiles(torch.float32, 128) == (32, 32)
    assert pa.prefill_tiles(torch.float16, 128) == (pa.BLOCK_M, pa.BLOCK_N)
    assert da.decode_block_n(torch.float32, 64) == 64
    query_lens, context_lens = [40, 1], [0, 70]
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    cache, table = paged_case(torch.Generator().manual_seed(1), seq_lens, 1, 128, 16)
    q = torch.randn(sum(query_lens), 2, 128)
    qsl = [0, 40, 41]
    expected = ref_prefill(q, cache, qsl, seq_lens, table, 128**-0.5)
    out = pa.paged_prefill_attention(q, cache, qsl, seq_lens, table, 128**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    dq = torch.randn(2, 2, 128)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    torch.testing.assert_close(da.paged_decode_attention(dq, cache, table, lens, 0.1),
                               ref_decode(dq, cache, table, lens, 0.1), atol=2e-5, rtol=0)


# -- top-k without reading the device ------------------------------------------------------------
def test_top_k_bound_comes_from_the_host(tiny_llama, monkeypatch):
    from minivllm import LLM, SamplingParams
    from minivllm.sample import sampler

    logits = torch.randn(3, 50)
    top_k = torch.tensor([0, 5, 10])
    torch.testing.assert_close(sampler.apply_top_k(logits, top_k, max_k=10),
                               sampler.apply_top_k(logits, top_k))
    seen = []
    original = sampler.apply_top_k

    def spy(logits, top_k, max_k=None):
        seen.append(max_k)
        return original(logits, top_k, max_k)

    monkeypatch.setattr(sampler, "apply_top_k", spy)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, show_progress=False, num_kv_blocks=16,
              block_size=8, max_model_len=64)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2,
                 [SamplingParams(top_k=7, max_tokens=2, seed=1),
                  SamplingParams(top_k=0, temperature=0.5, max_tokens=2, seed=2)], use_tqdm=False)
    assert seen and all(k == 7 for k in seen)
