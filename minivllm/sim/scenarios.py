"""The course's two production-scale scenarios, run on the simulated engine.

(a) ``long_prompt_stall``: N requests are decoding when one very long prompt arrives. Under the
    v0 scheduler every decode waits for the whole prefill (one giant gap between tokens);
    under v1 the prompt is cut into chunks that ride along with the decodes.
(b) ``shared_system_prompt``: many sessions share one long system prompt. With prefix caching
    its KV blocks exist once, shared by reference count; each session adds only its own blocks.
"""

from __future__ import annotations

import random

from minivllm.utils import cdiv, percentile, stall_window
from minivllm.config import EngineArgs, SchedulerConfig
from minivllm.sim.cost_model import CostModel
from minivllm.sim.engine import SimEngine

GB = 1e9


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 32000) for _ in range(n)]


def long_prompt_sim(
    scheduler: str = "v1",
    chunk_size: int = 512,
    num_decoding: int = 64,
    decode_prompt_len: int = 512,
    decode_output_len: int = 600,
    long_prompt_len: int = 16384,
    long_prompt_arrival: float = 3.0,
    num_blocks: int = 30000,
    block_size: int = EngineArgs.block_size,
    cost_model: CostModel | None = None,
    seed: int = 0,
) -> SimEngine:
    """The long-prompt scenario, run to the end on the simulated engine (``sim.records`` holds
    every request's simulated token times: what a timeline plot needs)."""
    rng = random.Random(seed)
    max_len = max(long_prompt_len, decode_prompt_len + decode_output_len) + 64
    if scheduler == "v1":
        cfg = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=chunk_size + num_decoding,
                              max_model_len=max_len, enable_chunked_prefill=True,
                              long_prefill_token_threshold=chunk_size)
    else:
        cfg = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=max_len,
                              max_model_len=max_len, enable_chunked_prefill=False)
    sim = SimEngine(num_blocks, block_size, scheduler=scheduler, scheduler_config=cfg,
                    cost_model=cost_model)
    for i in range(num_decoding):
        sim.add_request(f"chat-{i}", _tokens(rng, decode_prompt_len), decode_output_len, 0.0)
    sim.add_request("long", _tokens(rng, long_prompt_len), 16, long_prompt_arrival)
    sim.run()
    return sim


def long_prompt_stall(
    scheduler: str = "v1",
    chunk_size: int = 512,
    num_decoding: int = 64,
    long_prompt_arrival: float = 3.0,
    cost_model: CostModel | None = None,
    **kwargs,
) -> dict:
    """TPOT of the decoding requests around the long prompt's arrival, v0 vs v1.

    "steady" is the median gap between consecutive tokens in the second before the long prompt
    arrives (everyone decoding, the initial prefills long done);
    the "window" holds every gap that ends between its arrival and its first token (plus one
    steady step), i.e. the decodes that had to share the machine with its prefill.
    Other keyword arguments: those of ``long_prompt_sim``.
    """
    sim = long_prompt_sim(scheduler, chunk_size, num_decoding,
                          long_prompt_arrival=long_prompt_arrival, cost_model=cost_model, **kwargs)
    records = sim.records
    long = records["long"]
    before, window = stall_window(
        [records[f"chat-{i}"].token_times for i in range(num_decoding)],
        long_prompt_arrival, long.token_times[0], steady_span=1.0,
    )
    steady = percentile(before, 50)
    return {
        "scheduler": scheduler,
        "chunk_size": chunk_size if scheduler == "v1" else None,
        "cost_model": (cost_model or CostModel()).name,
        "steady_tpot_ms": steady * 1e3,
        "window_tpot_p50_ms": percentile(window, 50) * 1e3,
        "window_tpot_p99_ms": percentile(window, 99) * 1e3,
        "window_tpot_max_ms": max(window) * 1e3,
        "p99_over_steady": percentile(window, 99) / steady,
        "long_prompt_ttft_s": long.ttft,
        "num_steps": len(sim.step_trace),
    }


def shared_system_prompt(
    num_sessions: int = 1000,
    system_prompt_len: int = 30000,
    user_len: int = 200,
    output_len: int = 100,
    enable_prefix_caching: bool = True,
    num_blocks: int = 30000,
    block_size: int = EngineArgs.block_size,
    chunk_size: int = 2048,
    arrival_spread: float = 10.0,
    cost_model: CostModel | None = None,
    seed: int = 0,
) -> dict:
    """KV blocks when ``num_sessions`` share a system prompt, and the memory sharing saves.

    The first session arrives alone (it computes the system prompt once); the others arrive
    spread over ``arrival_spread`` seconds and find it in the prefix cache.
    """
    cost_model = cost_model or CostModel()
    rng = random.Random(seed)
    system = _tokens(rng, system_prompt_len)
    cfg = SchedulerConfig(max_num_seqs=max(num_sessions, 1), max_num_batched_tokens=chunk_size,
                          max_model_len=system_prompt_len + user_len + output_len + block_size)
    sim = SimEngine(num_blocks, block_size, scheduler_config=cfg,
                    enable_prefix_caching=enable_prefix_caching, cost_model=cost_model)
    sim.add_request("session-0", system + _tokens(rng, user_len), output_len, 0.0)
    first_done = 5.0
    for i in range(1, num_sessions):
        t = first_done + arrival_spread * i / num_sessions
        sim.add_request(f"session-{i}", system + _tokens(rng, user_len), output_len, t)
    records = sim.run()

    prefix_blocks = system_prompt_len // block_size
    block_bytes = block_size * cost_model.kv_bytes_per_token
    session_blocks = cdiv(system_prompt_len + user_len + output_len, block_size)
    n_peak = sim.peak_num_running
    return {
        "num_sessions": num_sessions,
        "enable_prefix_caching": enable_prefix_caching,
        "system_prompt_blocks": prefix_blocks,
        "blocks_per_session_total": session_blocks,
        "own_blocks_per_session": session_blocks - prefix_blocks,
        # the busiest moment: live sessions, blocks they reference, blocks actually used
        "sessions_alive_at_peak": n_peak,
        "block_references_at_peak": sim.peak_block_references,
        "peak_kv_blocks_used": sim.peak_blocks_used,
        "peak_blocks_if_one_prefix_copy": prefix_blocks
        + (sim.peak_block_references - n_peak * prefix_blocks),
        "kv_bytes_per_token": cost_model.kv_bytes_per_token,
        "kv_gb_at_peak": sim.peak_blocks_used * block_bytes / GB,
        "kv_gb_at_peak_unshared": sim.peak_block_references * block_bytes / GB,
        # all sessions at once, computed from the block counts above
        "kv_gb_all_sessions_unshared": num_sessions * session_blocks * block_bytes / GB,
        "kv_gb_all_sessions_shared": (prefix_blocks + num_sessions * (session_blocks - prefix_blocks))
        * block_bytes / GB,
        "prefix_cache_hit_tokens": sum(r.num_cached_tokens for r in records.values()),
        "all_finished": all(r.finished for r in records.values()),
        # simulated seconds: mean time to first token, and until the last session finished
        "mean_ttft_s": sum(r.ttft for r in records.values()) / len(records),
        "sim_time_s": sim.clock,
    }
