"""Each default has one source: ``EngineArgs`` (and the constants beside it in config.py). The
configs built without an engine (``SchedulerConfig()`` for the simulator), the command line's
help, the model runner's CPU KV budget and the block size of the simulator and of the
standalone model runs all read it, so changing a default there changes it everywhere."""

import argparse
import dataclasses
import inspect
from types import SimpleNamespace

import torch

from minivllm import config
from minivllm.config import (DEFAULT_BATCHED_TOKENS, DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs,
                             EngineConfig, ParallelConfig, SchedulerConfig)


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def test_configs_built_without_an_engine_take_engine_args_defaults():
    args = _defaults(EngineArgs)
    for cls in (SchedulerConfig, ParallelConfig, EngineConfig):
        shared = {name: value for name, value in _defaults(cls).items()
                  if name in args and args[name] is not None}
        assert shared, cls
        assert shared == {name: args[name] for name in shared}, cls.__name__
    # EngineArgs leaves the budget to the device; SchedulerConfig() is a CPU's
    assert SchedulerConfig().max_num_batched_tokens == DEFAULT_BATCHED_TOKENS["cpu"]


def test_an_engine_and_a_bare_scheduler_config_agree_where_the_engine_does_not_decide():
    """The fields create_config copies from EngineArgs unchanged (everything but the budget and
    max_model_len, which depend on the device and the model) equal SchedulerConfig()'s."""
    bare, args = SchedulerConfig(), EngineArgs()
    for name in ("max_num_seqs", "enable_chunked_prefill", "long_prefill_token_threshold"):
        assert getattr(bare, name) == getattr(args, name), name


def _help() -> dict[str, str]:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return {a.dest: a.help or "" for a in parser._actions}


def test_help_states_the_defaults_from_their_source():
    helps = _help()
    assert (f"{DEFAULT_BATCHED_TOKENS['cpu']} on a CPU, {DEFAULT_BATCHED_TOKENS['cuda']} on a GPU"
            in helps["max_num_batched_tokens"])
    assert f"{DEFAULT_CPU_KV_CACHE_BYTES / 2 ** 30:g} GiB" in helps["kv_cache_memory_bytes"]
    for name, value in _defaults(EngineArgs).items():  # argparse's own "(default: ...)"
        if name in helps and value is not None and not isinstance(value, bool):
            assert f"(default: {value})" in helps[name], name


def test_help_follows_a_changed_constant(monkeypatch):
    """The help texts are computed from the constants, not written out: config.py's help table
    re-evaluated with another budget says the other budget."""
    source = inspect.getsource(config)
    start = source.index("_CLI_HELP: dict")
    end = source.index("_CLI_HELP[\"model_runner_cls\"]")
    namespace = {**vars(config), "DEFAULT_BATCHED_TOKENS": {"cuda": 4096, "cpu": 64},
                 "DEFAULT_CPU_KV_CACHE_BYTES": 3 << 29}
    exec(source[start:end], namespace)
    table = namespace["_CLI_HELP"]
    assert "64 on a CPU, 4096 on a GPU" in table["max_num_batched_tokens"][0]
    assert "1.5 GiB" in table["kv_cache_memory_bytes"][0]


def test_the_model_runner_sizes_a_cpu_cache_from_config():
    from minivllm.worker.model_runner import ModelRunner

    fake = SimpleNamespace(
        config=SimpleNamespace(
            cache_config=SimpleNamespace(num_kv_blocks=None, kv_cache_memory_bytes=None),
            scheduler_config=SimpleNamespace(max_num_seqs=10 ** 6),
            model_config=SimpleNamespace(max_model_len=10 ** 6)),
        device=torch.device("cpu"), block_size=16, kv_cache_bytes_per_block=lambda: 4096)
    assert ModelRunner.determine_num_blocks(fake) == DEFAULT_CPU_KV_CACHE_BYTES // 4096


def test_block_size_defaults_come_from_engine_args():
    from minivllm.model import standalone
    from minivllm.sim import scenarios
    from minivllm.sim.engine import SimEngine

    for fn in (SimEngine.__init__, scenarios.long_prompt_sim, scenarios.shared_system_prompt,
               standalone.sequence_logits, standalone.greedy_generate):
        assert inspect.signature(fn).parameters["block_size"].default == EngineArgs.block_size
