"""The simulated engine and the production-scale scenarios."""

import pytest

from minivllm.sim.cost_model import CostModel
from minivllm.sim.scenarios import long_prompt_stall, shared_system_prompt


def test_cost_model_roofline():
    cm = CostModel()
    one = cm.step_time([(1, 100)])
    # memory-bound: one decode costs about the weights' streaming time plus overhead
    assert abs(one - (cm.step_overhead_s + cm.weight_bytes / (cm.mem_bandwidth * cm.mbu))) < 1e-3
    # below the ridge extra tokens are almost free, far above it they cost linearly
    assert cm.step_time([(1, 100)] * 64) < 1.5 * one
    assert cm.step_time([(4096, 4096)]) > 10 * one
    assert 100 < cm.ridge_tokens < 1000


def test_small_long_prompt_scenario_v0_stalls_v1_does_not():
    kw = dict(num_chats=8, long_prompt_len=4096, chat_output_len=400)
    v0 = long_prompt_stall("v0", **kw)
    v1 = long_prompt_stall("v1", chunk_size=256, **kw)
    assert v0["p99_over_steady"] > 10
    assert v1["p99_over_steady"] < 2
    assert v1["long_prompt_ttft_s"] > v0["long_prompt_ttft_s"]  # the price: a later first token


def test_small_shared_prefix_scenario_counts_one_prefix_copy():
    r = shared_system_prompt(num_sessions=40, prefix_len=2000, num_blocks=4000, spread_s=0.05)
    assert r["all_finished"]
    assert r["peak_kv_blocks_used"] == r["peak_blocks_if_one_prefix_copy"]
    assert r["block_references_at_peak"] > 5 * r["peak_kv_blocks_used"]
    off = shared_system_prompt(num_sessions=40, prefix_len=2000, num_blocks=4000,
                               enable_prefix_caching=False)
    assert off["peak_kv_blocks_used"] == off["block_references_at_peak"]  # nothing shared


@pytest.mark.slow
def test_full_scale_scenarios():
    """The course's seed scenarios at full size: a 16k prompt among 64 decodes; 1000 sessions
    sharing a 30k-token system prompt (8B-class cost model)."""
    v0 = long_prompt_stall("v0")
    v1 = long_prompt_stall("v1", chunk_size=512)
    assert v0["p99_over_steady"] > 20 and v1["p99_over_steady"] < 3
    r = shared_system_prompt()
    assert r["all_finished"] and r["sessions_alive_at_peak"] > 500
    assert r["peak_kv_blocks_used"] == r["peak_blocks_if_one_prefix_copy"]
    assert r["kv_gb_all_sessions_unshared"] > 50 * r["kv_gb_all_sessions_shared"]
