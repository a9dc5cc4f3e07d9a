"""Property-based tests: the block pool and cache manager under random add / step / abort.

A hypothesis state machine drives the real scheduler (v1 or v0) and KV cache manager through
the simulated runner, with a pool small enough to force eviction and preemption. The rules are
the package's (``minivllm/testing.py``, by which exercise 6.2 also grades a
learner's pool): every call to the pool is checked as it happens (LRU eviction, touch, free order,
hashes kept until evicted), and the invariants after every operation.
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minivllm.config import SchedulerConfig
from minivllm.core.block_pool import BlockPool
from minivllm.testing import all_free_violations, checked_block_pool_cls, kv_cache_violations
from minivllm.sim.engine import SimEngine

BLOCK_SIZE = 4
NUM_BLOCKS = 14
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22]]


class EngineMachine(RuleBasedStateMachine):
    @initialize(scheduler=st.sampled_from(["v1", "v0"]), caching=st.booleans(),
                budget=st.sampled_from([3, 8, 64]))
    def setup(self, scheduler, caching, budget):
        chunked = scheduler == "v1" and budget < 64
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget if chunked else 64,
                              max_model_len=48, enable_chunked_prefill=chunked)
        self.sim = SimEngine(NUM_BLOCKS, BLOCK_SIZE, scheduler=scheduler, scheduler_config=cfg,
                             enable_prefix_caching=caching,
                             block_pool_cls=checked_block_pool_cls(BlockPool))
        self.next_id = 0
        self.live: set[str] = set()

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(10, 60), max_size=14),
          max_tokens=st.integers(1, 10))
    def add(self, prefix, tail, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.sim.add_request(rid, prefix + tail, max_tokens, arrival_time=self.sim.clock)
        self.live.add(rid)

    @rule()
    def step(self):
        self.sim.step()
        self.live = {r for r in self.live if not self.sim.records[r].finished}

    @rule(data=st.data())
    def abort(self, data):
        if self.live:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.sim.abort(rid)
            self.live.discard(rid)

    @invariant()
    def kv_cache_invariants_hold(self):
        problems = kv_cache_violations(self.sim.scheduler)
        assert not problems, problems

    def teardown(self):
        # run everything to the end: then no block may stay in use
        while self.sim.step():
            pass
        assert all(r.finished for r in self.sim.records.values())
        problems = all_free_violations(self.sim.kv_cache_manager)
        assert not problems, problems


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
