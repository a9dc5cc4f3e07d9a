"""Greedy outputs do not depend on how the work was scheduled.

v0 or v1, chunked prefill on or off at any chunk size (down to one token per request per step),
prefix caching on or off, a KV pool so small that requests are preempted and recomputed: the
tokens must be the same. Only the order of floating-point work changes, never the result's
argmax (float32 on CPU).
"""

import pytest

from minivllm import LLM, SamplingParams

SYSTEM = ("You are a helpful assistant. Answer briefly and precisely, in plain English, "
          "and say so when you do not know the answer to a question. ")  # > 2 KV blocks
PROMPTS = [
    SYSTEM + "What is the capital of France?",
    SYSTEM + "Name three colours.",
    SYSTEM + "What is 2 + 2?",
    "Once upon a time",
    "The quick brown fox " * 6,
    "def add(a, b):",
    SYSTEM * 2 + "Why is the sky blue?",
    "Hi",
]
PARAMS = [SamplingParams(temperature=0, max_tokens=10 + 2 * i, ignore_eos=True)
          for i in range(len(PROMPTS))]

CONFIGS = {
    "v1-default": {},
    "v0": dict(scheduler="v0"),
    "no-chunking": dict(enable_chunked_prefill=False),
    "budget-16": dict(max_num_batched_tokens=16),
    "budget-7": dict(max_num_batched_tokens=7),
    "one-token-chunks": dict(long_prefill_token_threshold=1),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "preemption": dict(num_kv_blocks=12, block_size=8, max_model_len=96),
    "preemption-v0": dict(num_kv_blocks=12, block_size=8, max_model_len=96, scheduler="v0"),
}


def _run(path, **kwargs):
    llm = LLM(path, show_progress=False, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats["kv_blocks_used"] == 0
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return _run(tiny_llama)[0]


@pytest.fixture(scope="module")
def bundled_reference(bundled_path):
    return _run(bundled_path)[0]


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "v1-default"])
def test_tiny_model_same_tokens_under_every_schedule(tiny_llama, reference, name):
    tokens, stats = _run(tiny_llama, **CONFIGS[name])
    assert tokens == reference
    if name.startswith("preemption"):
        assert stats["num_preemptions"] > 0


def test_prefix_cache_hits_happen_by_default(tiny_llama):
    _, stats = _run(tiny_llama)
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_queries"] > stats["prefix_cache_hits"]


# on the real model, where near-ties are real: v0, and one run that both chunks every prompt
# (16-token budget) and preempts (12 blocks of 8)
BUNDLED_CONFIGS = {
    "v0": CONFIGS["v0"],
    "budget-16-preemption": {**CONFIGS["preemption"], **CONFIGS["budget-16"]},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUNDLED_CONFIGS))
def test_bundled_model_same_tokens_under_v0_chunking_and_preemption(
    bundled_path, bundled_reference, name
):
    tokens, stats = _run(bundled_path, **BUNDLED_CONFIGS[name])
    assert tokens == bundled_reference
    if "preemption" in name:
        assert stats["num_preemptions"] > 0
