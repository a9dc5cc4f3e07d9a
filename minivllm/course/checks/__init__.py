"""Checkers the exercise notebooks call: ``from minivllm.course import checks``.

Each ``check_*`` takes the learner's function or class, compares it with the package's reference
on seeded random cases, then plugs it into the real model or engine. It prints one line when the
component passes and raises ``CheckFailed`` (an AssertionError) naming what was expected and
what came back when it does not. Every checker goes through one harness
(``minivllm.course.grading.Exercise``): a component that is, or reaches, the package's own answer
raises ``Delegated`` (a ``CheckFailed``) naming the route. 5.2 and 11.1 draw their settings when
they grade; 11.2 grades an engine assembled from the learner's own sampler, scheduler and block
pool against the package's engine; 5.3 and 7.3 (``design``) grade goals by the engine's behaviour.
"""

from minivllm.course.checks.allocation import check_allocate_slots
from minivllm.course.checks.capstone import check_goodput_tuner, check_own_engine
from minivllm.course.checks.common import CheckFailed, Delegated
from minivllm.course.checks.design import check_overlap_core, check_priority_scheduler
from minivllm.course.checks.detokenizer import check_detokenizer
from minivllm.course.checks.engine_core import check_busy_loop
from minivllm.course.checks.generation import check_cached_generation
from minivllm.course.checks.hotpath import (
    check_capture_sizes, check_graph_runner, check_persistent_batch,
)
from minivllm.course.checks.kernels import (
    check_bias_add, check_fused_add_rms_norm, check_online_softmax, check_online_softmax_kernel,
    check_paged_decode, check_row_sums, check_split_decode, check_tiled_matmul,
)
from minivllm.course.checks.model import check_gqa_attention, check_rms_norm, check_rotary
from minivllm.course.checks.paged import check_paged_attention, check_slot_mapping
from minivllm.course.checks.prefix import check_block_hashes, check_block_pool
from minivllm.course.checks.sampler import check_sampler
from minivllm.course.checks.scheduler import check_phase_separated_scheduler, check_unified_scheduler
from minivllm.course.checks.serving import check_benchmark_metrics, check_chat_stream
from minivllm.course.checks.tp import check_qkv_sharding, check_row_parallel_linear
from minivllm.course.checks.tuning import check_chunking_choice

__all__ = ["CheckFailed", "Delegated"] + sorted(n for n in dir() if n.startswith("check_"))
