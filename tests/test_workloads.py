"""The workload catalogue (minivllm/sim/workloads.py): one description per workload,
read by the benchmarks' command lines, run on an engine and on the simulated engine alike."""

import argparse
import dataclasses

import pytest

from minivllm.benchmarks import long_prompt, shared_prefix, sim
from minivllm.sim.workloads import (LONG_PROMPT_CPU, LONG_PROMPT_GPU, SHARED_PREFIX_CPU,
                                    SHARED_PREFIX_GPU, VOCAB, LongPromptAmongChats, SharedPrefix)


def _defaults(module, command: str) -> dict:
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers(), None)
    return vars(parser.parse_args([command]))


def test_the_benchmarks_command_lines_default_to_the_catalogue():
    lp = _defaults(long_prompt, "long-prompt")
    assert (lp["num_chats"], lp["chat_prompt_len"], lp["long_prompt_len"], lp["steady_steps"],
            lp["seed"]) == (LONG_PROMPT_CPU.num_chats, LONG_PROMPT_CPU.chat_prompt_len,
                            LONG_PROMPT_CPU.long_prompt_len, LONG_PROMPT_CPU.steady_steps,
                            LONG_PROMPT_CPU.seed)
    sp = _defaults(shared_prefix, "shared-prefix")
    assert (sp["num_requests"], sp["prefix_len"], sp["question_len"], sp["output_len"],
            sp["seed"]) == (SHARED_PREFIX_CPU.num_requests, SHARED_PREFIX_CPU.prefix_len,
                            SHARED_PREFIX_CPU.suffix_len, SHARED_PREFIX_CPU.output_len,
                            SHARED_PREFIX_CPU.seed)
    sm = _defaults(sim, "sim")
    assert (sm["num_decoding"], sm["long_prompt_len"], sm["num_sessions"],
            sm["system_prompt_len"]) == (LONG_PROMPT_GPU.num_chats, LONG_PROMPT_GPU.long_prompt_len,
                                         SHARED_PREFIX_GPU.num_requests, SHARED_PREFIX_GPU.prefix_len)


def test_the_simulated_scenarios_default_to_the_catalogue():
    import inspect

    from minivllm.sim import scenarios

    for fn in (scenarios.long_prompt_sim, scenarios.long_prompt_stall):
        assert inspect.signature(fn).parameters["workload"].default is LONG_PROMPT_GPU
    assert (inspect.signature(scenarios.shared_system_prompt).parameters["workload"].default
            is SHARED_PREFIX_GPU)


def test_long_prompt_workload_prompts():
    w = LongPromptAmongChats(num_chats=5, chat_prompt_len=12, long_prompt_len=300, seed=3)
    chats, long = w.prompts()
    assert [len(c) for c in chats] == [12] * 5 and len(long) == 300
    assert all(len(set(c)) == len(c) for c in chats)  # a chat's prompt repeats no token
    assert all(t in VOCAB for p in (*chats, long) for t in p)
    assert len({tuple(c) for c in chats}) == 5
    assert w.prompts() == (chats, long)  # seeded
    assert dataclasses.replace(w, seed=4).prompts() != (chats, long)
    # chats decode as long as the context allows unless told otherwise
    assert w.chat_prompt_len + w.chat_max_tokens == w.max_model_len >= w.long_prompt_len
    fixed = dataclasses.replace(w, chat_output_len=7)
    assert fixed.chat_max_tokens == 7 and fixed.max_model_len >= w.long_prompt_len
    assert w.chat_ids() == [f"chat-{i}" for i in range(5)]


def test_shared_prefix_workload_prompts_and_arrivals():
    w = SharedPrefix(num_requests=6, prefix_len=40, suffix_len=9, output_len=3,
                     first_alone_s=2.0, spread_s=6.0)
    prompts = w.prompts()
    assert [len(p) for p in prompts] == [49] * 6
    assert all(p[:40] == prompts[0][:40] for p in prompts)
    assert len({tuple(p[40:]) for p in prompts}) == 6  # each suffix its own
    assert w.max_model_len == 49 + 3
    times = w.arrival_times()
    assert times[0] == 0.0 and times[1] > w.first_alone_s and times[-1] < 2.0 + 6.0
    assert times == sorted(times) and len(times) == 6
    assert set(SharedPrefix(num_requests=4).arrival_times()) == {0.0}  # all at once by default


def test_simulated_window_takes_the_engines_steps(tiny_llama):
    """The same workload and scheduler settings on an engine (``run_scenario``) and on the
    simulated engine (``long_prompt_window_sim``): the same number of steps until the long
    prompt's first token, under v0 (one step) and v1 (chunks)."""
    from minivllm import LLM
    from minivllm.config import SchedulerConfig
    from minivllm.sim.cost_model import CostModel
    from minivllm.sim.scenarios import long_prompt_window_sim

    w = LongPromptAmongChats(num_chats=3, chat_prompt_len=8, long_prompt_len=96, steady_steps=2)
    runs = {"v0": dict(scheduler="v0", max_num_batched_tokens=256),
            "v1": dict(scheduler="v1", long_prefill_token_threshold=16,
                       max_num_batched_tokens=16 + w.num_chats)}
    steps = {}
    for name, kw in runs.items():
        llm = LLM(tiny_llama, show_progress=False, max_model_len=256, num_kv_blocks=64, **kw)
        real = long_prompt.run_scenario(None, {}, w.num_chats, w.chat_prompt_len,
                                        w.long_prompt_len, w.steady_steps, llm=llm)
        config = SchedulerConfig(
            max_num_batched_tokens=kw["max_num_batched_tokens"], max_model_len=256,
            enable_chunked_prefill=name == "v1",
            long_prefill_token_threshold=kw.get("long_prefill_token_threshold", 0))
        simulated = long_prompt_window_sim(w, name, config, CostModel(), num_blocks=64)
        assert real["steps"] == simulated["steps"], name
        steps[name] = real["steps"]
    assert steps["v0"] == 1 and steps["v1"] >= w.long_prompt_len // 16


@pytest.mark.parametrize("caching", [True, False])
def test_simulated_shared_prefix_uses_the_engines_blocks(tiny_llama, caching):
    from minivllm.config import EngineArgs, SchedulerConfig
    from minivllm.sim.cost_model import CostModel
    from minivllm.sim.scenarios import shared_prefix_at_once_sim
    from minivllm.utils import cdiv

    w = SharedPrefix(num_requests=4, prefix_len=64, suffix_len=8, output_len=2)
    real = shared_prefix.run_once(tiny_llama, caching, w.prompts(), w.output_len,
                                  max_num_batched_tokens=512)
    per_request = cdiv(w.max_model_len, EngineArgs.block_size)  # run_once's cache, unshared
    config = SchedulerConfig(max_num_batched_tokens=512, max_model_len=w.max_model_len)
    simulated = shared_prefix_at_once_sim(w.prompts(), w.output_len, caching, config,
                                          CostModel(), num_blocks=w.num_requests * per_request + 16)
    assert real["peak_kv_blocks_used"] == simulated["peak_kv_blocks_used"]
