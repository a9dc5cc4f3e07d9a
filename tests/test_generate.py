"""Offline generation: greedy tokens identical to transformers, batching, the step API."""

import pytest

from minivllm import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_greedy_agrees

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Hi",
    "In 1492, Columbus",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "What is 2+2? Let me think step by step about the arithmetic here.",
    "Machine learning is a field of study in artificial intelligence concerned with the "
    "development of statistical algorithms that can learn from data and generalize.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


def test_bundled_greedy_identical_to_transformers(bundled_llm, bundled_path):
    tok = bundled_llm.get_tokenizer()
    outs = bundled_llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # one batch of 8
    assert len({len(tok.encode(p)) for p in PROMPTS}) == len(PROMPTS)  # all different lengths
    # transformers' own generate for the first prompt; for every prompt, transformers' argmax at
    # each position of prompt + our output (one forward each: the same test, 8x fewer forwards)
    first = outs[0].outputs[0].token_ids
    assert first == hf_greedy(bundled_path, tok.encode(PROMPTS[0]), 32), PROMPTS[0]
    for prompt, out in zip(PROMPTS, outs):
        ids = out.outputs[0].token_ids
        assert len(ids) == 32 or ids[-1] == tok.eos_token_id, prompt
        assert hf_greedy_agrees(bundled_path, tok.encode(prompt), ids) == [], prompt
        assert out.prompt == prompt and out.finished


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_tiny_family_greedy_identical_to_transformers(tiny_models, family):
    path = tiny_models[family]
    llm = LLM(path, show_progress=False, max_model_len=512)
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, tok.encode(prompt), 32), prompt


def test_prompt_alone_equals_prompt_in_batch_of_32(bundled_llm):
    target = "Explain why the sky is blue."
    short = SamplingParams(temperature=0, max_tokens=16)
    alone = bundled_llm.generate(target, short, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"Write a sentence about the number {i}." for i in range(31)]
    batch = others[:13] + [target] + others[13:]
    outs = bundled_llm.generate(batch, short, use_tqdm=False)
    assert outs[13].outputs[0].token_ids == alone
    assert [o.prompt for o in outs] == batch  # input order kept


def test_output_fields_and_text(bundled_llm):
    tok = bundled_llm.get_tokenizer()
    out = bundled_llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt_token_ids == tok.encode("The capital of France is")
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert c.finish_reason in ("stop", "length") and out.finished
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert len(m.token_times) == len(c.token_ids)


def test_max_tokens_gives_length_and_stop_strings_cut_text(bundled_llm):
    out = bundled_llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=5,
                                                                     ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5
    full = bundled_llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)[0].outputs[0].text
    stop = full.strip()[2:5]  # a string that appears in the output
    cut = bundled_llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12,
                                                                     stop=[stop]), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == full[: full.index(stop)]
    assert bundled_llm.llm_engine.get_stats()["kv_blocks_used"] == 0


def test_stop_token_ids(bundled_llm):
    base = bundled_llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[3]
    out = bundled_llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=32, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: base.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_token_id_prompts_and_per_prompt_params(bundled_llm):
    tok = bundled_llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    a, b = bundled_llm.generate(
        [{"prompt_token_ids": ids}, "The capital of France is"],
        [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=8)],
        use_tqdm=False,
    )
    assert a.prompt is None and a.prompt_token_ids == ids
    assert len(a.outputs[0].token_ids) == 4 and len(b.outputs[0].token_ids) == 8
    assert b.outputs[0].token_ids[:4] == a.outputs[0].token_ids


def test_chat_applies_template(bundled_llm):
    tok = bundled_llm.get_tokenizer()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = bundled_llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert "Paris" in out.outputs[0].text
    two = bundled_llm.chat([msgs, msgs], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2


def test_step_api_continuous_batching(tiny_llama):
    llm = LLM(tiny_llama, show_progress=False, max_num_seqs=2)
    engine = llm.llm_engine
    engine.add_request("a", "one two three", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", "four five", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("c", "six", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished_at = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            assert out.request_id in "abc"
            if out.finished:
                finished_at[out.request_id] = step
    # "c" waited for a free seat (max_num_seqs=2) and joined as soon as "a" finished
    trace = engine.get_step_trace()
    first_c = next(t["step"] for t in trace if any(r == "c" for r, _, _ in t["scheduled"]))
    assert first_c == finished_at["a"] + 1
    assert finished_at["b"] == 8 and finished_at["c"] == finished_at["a"] + 4


def test_abort_request_frees_blocks(tiny_llama):
    llm = LLM(tiny_llama, show_progress=False)
    engine = llm.llm_engine
    engine.add_request("x", "hello " * 40, SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.get_stats()["kv_blocks_used"] > 0
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["kv_blocks_used"] == 0
    assert engine.step() == []
