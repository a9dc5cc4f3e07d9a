"""The workloads of ``minivllm.sim.workloads`` on the simulated engine.

At production scale (the course's two scenarios, ``bench sim``):

(a) ``long_prompt_stall``: N requests are decoding when one very long prompt arrives. Under the
    v0 scheduler every decode waits for the whole prefill (one giant gap between tokens);
    under v1 the prompt is cut into chunks that ride along with the decodes.
(b) ``shared_system_prompt``: many sessions share one long system prompt. With prefix caching
    its KV blocks exist once, shared by reference count; each session adds only its own blocks.

Step for step as ``bench long-prompt`` and ``bench shared-prefix`` run them on an engine, so
that the two can be overlaid: ``long_prompt_window_sim`` and ``shared_prefix_at_once_sim``.
"""

from __future__ import annotations

import dataclasses

from minivllm.utils import cdiv, percentile, stall_window
from minivllm.config import EngineArgs, SchedulerConfig
from minivllm.sim.cost_model import CostModel
from minivllm.sim.engine import SimEngine
from minivllm.sim.workloads import (LONG_PROMPT_GPU, SHARED_PREFIX_GPU, LongPromptAmongChats,
                                    SharedPrefix)

GB = 1e9
_LONG_PROMPT_FIELDS = {f.name for f in dataclasses.fields(LongPromptAmongChats)}


def long_prompt_sim(
    scheduler: str = "v1",
    chunk_size: int = 512,
    workload: LongPromptAmongChats = LONG_PROMPT_GPU,
    num_blocks: int = 30000,
    block_size: int = EngineArgs.block_size,
    cost_model: CostModel | None = None,
    **fields,
) -> SimEngine:
    """The long-prompt scenario at its ``arrival_s``, run to the end on the simulated engine
    (``sim.records`` holds every request's simulated token times: what a timeline plot needs).
    ``fields``: the workload's own, replaced (``long_prompt_len=4096``)."""
    w = dataclasses.replace(workload, **fields)
    if w.arrival_s is None:
        raise ValueError("long_prompt_sim runs a workload that arrives at a time (arrival_s); "
                         "long_prompt_window_sim counts steps")
    max_len = w.max_model_len
    if scheduler == "v1":
        cfg = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=chunk_size + w.num_chats,
                              max_model_len=max_len, enable_chunked_prefill=True,
                              long_prefill_token_threshold=chunk_size)
    else:
        cfg = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=max_len,
                              max_model_len=max_len, enable_chunked_prefill=False)
    sim = SimEngine(num_blocks, block_size, scheduler=scheduler, scheduler_config=cfg,
                    cost_model=cost_model)
    chats, long = w.prompts()
    for rid, prompt in zip(w.chat_ids(), chats):
        sim.add_request(rid, prompt, w.chat_max_tokens, 0.0)
    sim.add_request("long", long, w.long_output_len, w.arrival_s)
    sim.run()
    return sim


def long_prompt_stall(
    scheduler: str = "v1",
    chunk_size: int = 512,
    workload: LongPromptAmongChats = LONG_PROMPT_GPU,
    cost_model: CostModel | None = None,
    **kwargs,
) -> dict:
    """TPOT of the decoding requests around the long prompt's arrival, v0 vs v1.

    "steady" is the median gap between consecutive tokens in the second before the long prompt
    arrives (everyone decoding, the initial prefills long done);
    the "window" holds every gap that ends between its arrival and its first token (plus one
    steady step), i.e. the decodes that had to share the machine with its prefill.
    Other keyword arguments: those of ``long_prompt_sim`` and the workload's fields.
    """
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in _LONG_PROMPT_FIELDS}
    w = dataclasses.replace(workload, **fields)
    sim = long_prompt_sim(scheduler, chunk_size, w, cost_model=cost_model, **kwargs)
    records = sim.records
    long = records["long"]
    before, window = stall_window(
        [records[rid].token_times for rid in w.chat_ids()],
        w.arrival_s, long.token_times[0], steady_span=1.0,
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
    workload: SharedPrefix = SHARED_PREFIX_GPU,
    enable_prefix_caching: bool = True,
    num_blocks: int = 30000,
    block_size: int = EngineArgs.block_size,
    chunk_size: int = 2048,
    cost_model: CostModel | None = None,
    num_sessions: int | None = None,
    **fields,
) -> dict:
    """KV blocks when ``num_sessions`` share a system prompt, and the memory sharing saves.

    The first session arrives alone (it computes the system prompt once); the others arrive
    spread over the workload's ``spread_s`` seconds and find it in the prefix cache.
    ``num_sessions``: the workload's ``num_requests``; ``fields``: its other fields, replaced.
    """
    if num_sessions is not None:
        fields["num_requests"] = num_sessions
    w = dataclasses.replace(workload, **fields)
    num_sessions, system_prompt_len = w.num_requests, w.prefix_len
    cost_model = cost_model or CostModel()
    cfg = SchedulerConfig(max_num_seqs=max(num_sessions, 1), max_num_batched_tokens=chunk_size,
                          max_model_len=w.max_model_len + block_size)
    sim = SimEngine(num_blocks, block_size, scheduler_config=cfg,
                    enable_prefix_caching=enable_prefix_caching, cost_model=cost_model)
    for i, (prompt, t) in enumerate(zip(w.prompts(), w.arrival_times())):
        sim.add_request(f"session-{i}", prompt, w.output_len, t)
    records = sim.run()

    prefix_blocks = system_prompt_len // block_size
    block_bytes = block_size * cost_model.kv_bytes_per_token
    session_blocks = cdiv(w.max_model_len, block_size)
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


# -- bench long-prompt's and bench shared-prefix's runs, simulated -----------------------------

def long_prompt_window_sim(workload: LongPromptAmongChats, scheduler: str,
                           config: SchedulerConfig, cost_model: CostModel, extra_steps: int = 1,
                           num_blocks: int = 4096, block_size: int = EngineArgs.block_size) -> dict:
    """``bench long-prompt``'s run (``run_scenario``) on the simulated engine: the chats decode
    until each has ``steady_steps`` tokens, then the long prompt arrives; run until its first
    token, then ``extra_steps`` more. ``scheduler`` ("v0" or "v1") and ``config``: the policy
    to simulate (``config.max_model_len`` must hold the workload's ``max_model_len``). The keys
    of ``run_scenario``'s result that time the run, in simulated seconds."""
    sim = SimEngine(num_blocks, block_size, scheduler=scheduler, scheduler_config=config,
                    cost_model=cost_model)
    chats, long = workload.prompts()
    chat_ids = workload.chat_ids()
    for rid, prompt in zip(chat_ids, chats):
        sim.add_request(rid, prompt, workload.chat_max_tokens)
    while min(len(sim.records[r].token_times) for r in chat_ids) < workload.steady_steps:
        sim.step()
    arrival = sim.clock
    sim.add_request("long", long, workload.long_output_len, arrival)
    steps = 0
    while not sim.records["long"].token_times:
        sim.step()
        steps += 1
    for _ in range(max(extra_steps, 1)):
        sim.step()
    return {"steps": steps, "long_prompt_ttft_s": sim.records["long"].ttft, "arrival": arrival,
            "window_end": sim.records["long"].token_times[0],
            "token_times": {r: list(rec.token_times) for r, rec in sim.records.items()},
            "trace": sim.step_trace}


def shared_prefix_at_once_sim(prompts: list[list[int]], output_len: int, caching: bool,
                              config: SchedulerConfig, cost_model: CostModel, num_blocks: int,
                              block_size: int = EngineArgs.block_size) -> dict:
    """``bench shared-prefix``'s run (``run_all_at_once``) on the simulated engine: every prompt
    (``SharedPrefix.prompts()``, or any others) arrives at once. TTFT per request, in the order
    of ``prompts``, and the peak of KV blocks in use."""
    sim = SimEngine(num_blocks, block_size, scheduler_config=config,
                    enable_prefix_caching=caching, cost_model=cost_model)
    for i, p in enumerate(prompts):
        sim.add_request(str(i), list(p), output_len, 0.0)
    records = sim.run()
    ttfts = [records[str(i)].ttft for i in range(len(prompts))]
    return {"ttfts_s": ttfts, "mean_ttft_s": sum(ttfts) / len(ttfts),
            "peak_kv_blocks_used": sim.peak_blocks_used}
