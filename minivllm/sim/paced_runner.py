"""A model runner that runs no model: each step sleeps the time the cost model gives it.

``EngineArgs(model_runner_cls=PacedModelRunner)`` (or ``--model-runner-cls
minivllm.sim.paced_runner:PacedModelRunner``) keeps everything around the model real, the
scheduler, the KV cache manager, the engine core's busy loop, the process split, the server,
and replaces the forward pass by ``time.sleep(step_time)`` from ``CostModel`` (Llama-3-8B in
bf16 on one H100 by default). ``time.sleep`` releases the GIL, as a real engine does while it
waits for the GPU (a CUDA synchronize), so the front end can run meanwhile, exactly as much as it
could beside a real GPU. On a CPU-only machine this shows the engine's *host* side at the pace
of a GPU, which a CPU forward pass (holding the very cores the front end needs) cannot.

With ``MINIVLLM_PACED_LOG=path`` in the environment, every step appends a line
``sleep_start sleep_end num_tokens`` (``time.time()`` seconds) to that file: when the "GPU" was
busy, so the gaps between steps, the time it sat idle waiting for the host, can be measured.

The sampled tokens are made up (deterministic per request and position, never a special token):
the text is gibberish, its cost to detokenize and stream is real.
"""

from __future__ import annotations

import os
import time

from minivllm.config import EngineConfig
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.sim.cost_model import CostModel

FIRST_TOKEN_ID = 100  # made-up tokens stay clear of the special ids at the start of a vocabulary


class PacedModelRunner:
    cost_model = CostModel()

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.config = config
        self.vocab_size = config.model_config.hf_config.vocab_size
        # request id -> [tokens the request has (prompt + sampled), tokens computed]
        self.requests: dict[str, list[int]] = {}
        self.kv_caches: list = []
        self.num_steps = 0
        self.modelled_time_s = 0.0  # the sum of every step's simulated time
        path = os.environ.get("MINIVLLM_PACED_LOG")
        self.log = open(path, "a", buffering=1) if path else None  # line-buffered

    def determine_num_blocks(self) -> int:
        if self.config.cache_config.num_kv_blocks is not None:
            return self.config.cache_config.num_kv_blocks
        c = self.config
        cap = (c.scheduler_config.max_num_seqs
               * -(-c.model_config.max_model_len // c.cache_config.block_size))
        return max(1, min(cap, 30_000))  # what an H100's spare memory holds for Llama-3-8B

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass  # there is no model to hold keys and values

    def next_token(self, request_id: str, position: int) -> int:
        h = 2166136261  # FNV-1a: deterministic across processes, unlike hash()
        for ch in f"{request_id}:{position}".encode():
            h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
        return FIRST_TOKEN_ID + h % (self.vocab_size - FIRST_TOKEN_ID)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = [len(new.prompt_token_ids), new.num_computed_tokens]
        cached = so.scheduled_cached_reqs
        for rid, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.requests[rid][1] = num_computed
        result = ModelRunnerOutput()
        work = []
        for rid, n in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            state[1] += n
            work.append((n, state[1]))
            result.req_ids.append(rid)
            if state[1] >= state[0]:  # the step reached the last known token: sample the next
                result.sampled_token_ids.append([self.next_token(rid, state[0])])
                state[0] += 1
            else:
                result.sampled_token_ids.append([])
        step_time = self.cost_model.step_time(work)
        start = time.time()
        time.sleep(step_time)  # releases the GIL, as waiting for a GPU does
        if self.log is not None:
            self.log.write(f"{start:.6f} {time.time():.6f} {so.total_num_scheduled_tokens}\n")
        self.num_steps += 1
        self.modelled_time_s += step_time
        return result
