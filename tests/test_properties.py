"""Property-based tests: the block pool and cache manager under random add / step / abort.

A hypothesis state machine drives the real scheduler (v1 or v0) and KV cache manager through
the simulated runner, with a pool small enough to force eviction and preemption, and checks
the invariants after every operation.
"""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from minivllm.config import SchedulerConfig
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
                             enable_prefix_caching=caching)
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
    def ref_counts_match_holders(self):
        m = self.sim.kv_cache_manager
        holders = Counter(b.block_id for blocks in m.req_to_blocks.values() for b in blocks)
        for block in m.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), block
        # only live (unfinished) requests hold blocks
        assert set(m.req_to_blocks) <= {r.request_id for r in self.sim.scheduler.running}

    @invariant()
    def free_queue_is_exactly_the_unreferenced_blocks(self):
        pool = self.sim.kv_cache_manager.block_pool
        free = [b.block_id for b in pool.free_block_queue]
        assert len(free) == len(set(free)) == pool.get_num_free_blocks()
        assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}

    @invariant()
    def hash_map_entries_point_to_blocks_with_that_hash(self):
        pool = self.sim.kv_cache_manager.block_pool
        for h, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == h

    def teardown(self):
        # run everything to the end: then no block may stay in use
        while self.sim.step():
            pass
        assert all(r.finished for r in self.sim.records.values())
        m = self.sim.kv_cache_manager
        assert m.get_num_free_blocks() == m.num_blocks, "kv_blocks_used != 0 after all finished"


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
