"""The paced model runner: the real engine around no model, each step sleeping its simulated
GPU time (chapter 07's load test)."""

import time

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.sim.paced_runner import PacedModelRunner
from minivllm.testing import model_runner


@pytest.fixture(scope="module")
def paced_llm():
    return LLM(model_runner_cls="minivllm.sim.paced_runner:PacedModelRunner", show_progress=False,
               max_model_len=1024, block_size=16, num_kv_blocks=256)


def test_every_request_gets_its_tokens_and_the_steps_take_their_modelled_time(paced_llm):
    runner = model_runner(paced_llm)
    assert isinstance(runner, PacedModelRunner)
    before = runner.modelled_time_s
    start = time.perf_counter()
    outs = paced_llm.generate([f"prompt number {i}" for i in range(8)],
                              SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 8
    modelled = runner.modelled_time_s - before
    assert modelled > 12 * runner.cost_model.step_overhead_s  # at least one step per token
    assert elapsed >= modelled  # it slept each step's time
    special = set(paced_llm.get_tokenizer().all_special_ids)
    assert not special & {t for o in outs for t in o.outputs[0].token_ids}


@pytest.mark.parametrize("value, fragment", [
    ("minivllm.sim.paced_runner.PacedModelRunner", "'package.module:Class'"),
    ("minivllm.sim.paced_runner:NoSuchRunner", "cannot import"),
])
def test_a_bad_model_runner_cls_is_a_value_error_naming_it(value, fragment):
    with pytest.raises(ValueError, match="model_runner_cls") as info:
        EngineArgs(model_runner_cls=value).create_config()
    assert fragment in str(info.value)
