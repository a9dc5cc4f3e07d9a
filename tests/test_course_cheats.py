"""No exercise passes by delegation or a constant. For every exercise (chapter 09's have their own
tests), a "notebook cell" submits (a) the package's own implementation under the expected name,
(b) a bare subclass or an alias, and (c) a wrapper that reaches the answer some other way (a
name bound before grading, a closure, an import inside the function, importlib at run time);
each must fail with the grading harness's Delegated, naming what it reached. Further down: the
answer reached from a thread or a copy compiled at run time, the grader's frames read, and
results whose own class would answer the grader's comparisons. Most are refused
before the grader runs anything, so the whole file takes seconds. The constant answers of 5.2
and 11.1 are in test_course_checks.py and test_course_checks_11.py (targets drawn at grading)."""

import textwrap

import pytest

from minivllm.course import checks


def _cell(source: str) -> dict:
    """Run ``source`` as a notebook cell would (its own globals, compiled from a string)."""
    scope: dict = {}
    exec(compile(textwrap.dedent(source), "<notebook cell>", "exec"), scope)
    return scope


# (exercise, checker, the name the grade cell passes, the cell, what the refusal must name)
CHEATS = [
    # 1.1 RMSNorm: the measured cheat, an alias, a bound name, the module
    ("1.1", "check_rms_norm", "rms_norm",
     "from minivllm.model.layers import rms_norm", "minivllm.model.layers.rms_norm"),
    ("1.1", "check_rms_norm", "rms_norm", """
        from minivllm.model import layers
        package_norm = layers.rms_norm
        def rms_norm(x, weight, eps):
            return package_norm(x, weight, eps)
        """, "rms_norm"),
    ("1.1", "check_rms_norm", "rms_norm", """
        import types
        from minivllm.model import layers
        rms_norm = types.FunctionType(layers.rms_norm.__code__, globals())
        """, "minivllm.model.layers.rms_norm"),
    ("1.1", "check_rms_norm", "rms_norm", """
        import torch.nn.functional as F
        def rms_norm(x, weight, eps):
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        """, "torch.nn.functional.rms_norm"),
    ("1.1", "check_rms_norm", "rms_norm", """
        from minivllm import cpu_kernels
        def rms_norm(x, weight, eps):
            return cpu_kernels.cpu_elementwise_ops({})["rms_norm"](x, weight, eps)
        """, "cpu_elementwise_ops"),
    ("1.1", "check_rms_norm", "rms_norm", """
        import torch
        def rms_norm(x, weight, eps):
            return torch.ops.aten.rms_norm(x.float(), [x.shape[-1]], weight.float(),
                                           eps).to(x.dtype)
        """, "torch.ops.aten.rms_norm"),
    # 1.2 rotary
    ("1.2", "check_rotary", "apply_rotary", """
        from minivllm.model.layers import RotaryEmbedding
        def apply_rotary(x, positions, base):
            return RotaryEmbedding(x.shape[-1], 4096, base)(positions, x, x)[0]
        """, "RotaryEmbedding"),
    ("1.2", "check_rotary", "apply_rotary",
     "from minivllm.model.layers import rotary_embedding as apply_rotary", "rotary_embedding"),
    # 1.3 attention: the chapter's SDPA cell, the grader's own reference
    ("1.3", "check_gqa_attention", "gqa_attention", """
        import torch.nn.functional as F
        def gqa_attention(q, k, v, scale):
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), is_causal=True, scale=scale,
                                               enable_gqa=True)
            return o.transpose(0, 1)
        """, "scaled_dot_product_attention"),
    ("1.3", "check_gqa_attention", "gqa_attention", """
        import torch
        def gqa_attention(q, k, v, scale):
            o = torch.ops.aten.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                scale=scale, enable_gqa=True)
            return o.transpose(0, 1)
        """, "scaled_dot_product_attention"),
    ("1.3", "check_gqa_attention", "gqa_attention",
     "from minivllm.course.checks.model import reference_gqa_attention as gqa_attention",
     "reference_gqa_attention"),
    # 1.3: the kernels behind torch's SDPA, as an operator and (at run time) as an overload
    ("1.3", "check_gqa_attention", "gqa_attention", """
        import torch
        def gqa_attention(q, k, v, scale):
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=scale)[0][0]
            return o.transpose(0, 1)
        """, "_scaled_dot_product_flash_attention_for_cpu"),
    ("1.3", "check_gqa_attention", "gqa_attention", """
        import torch
        def gqa_attention(q, k, v, scale):
            op = getattr(getattr(torch.ops.aten, "_scaled_dot_product_attention" + "_math"),
                         "default")
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            o = op(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                   scale=scale)[0]
            return o.transpose(0, 1)
        """, "_scaled_dot_product_attention_math.default"),
    # 2.1 sampler: the measured alias, a bare subclass, composition
    ("2.1", "check_sampler", "MySampler",
     "from minivllm.sample.sampler import Sampler as MySampler", "minivllm.sample.sampler.Sampler"),
    ("2.1", "check_sampler", "MySampler", """
        from minivllm.sample.sampler import Sampler
        class MySampler(Sampler):
            pass
        """, "minivllm.sample.sampler.Sampler"),
    ("2.1", "check_sampler", "MySampler", """
        import torch
        from minivllm.sample import sampler
        class MySampler(torch.nn.Module):
            def forward(self, logits, meta):
                keep = sampler.apply_top_k_top_p(logits / meta.temperature[:, None], meta.top_k,
                                                 meta.top_p)
                return keep.argmax(-1)
        """, "apply_top_k_top_p"),
    # 2.1: the race of the package's sampler on a CPU, its C++ kernel called directly
    ("2.1", "check_sampler", "MySampler", """
        import torch
        from minivllm.sample.sampler import sample_race
        class MySampler(torch.nn.Module):
            def forward(self, logits, meta):
                return sample_race(logits.softmax(-1), meta.generators, meta.generator)
        """, "minivllm.sample.sampler.sample_race"),
    ("2.1", "check_sampler", "MySampler", """
        import torch
        class MySampler(torch.nn.Module):
            def forward(self, logits, meta):
                keys = torch.randint(0, 2**62, (len(logits),), generator=meta.generator)
                return torch.ops.minivllm_cpu.race_sample(logits.softmax(-1), keys)
        """, "race_sample"),
    # 2.2 the generation loop: an import inside the function
    ("2.2", "check_cached_generation", "generate_with_cache", """
        def generate_with_cache(model, prompt_ids, n, block_size=16):
            from minivllm.model.standalone import greedy_generate
            return greedy_generate(model, prompt_ids, n, block_size)[0]
        """, "greedy_generate"),
    # 3.1 (warm-up) slot mapping, 3.1 allocate_slots, 3.2 paged attention
    ("3.1", "check_slot_mapping", "compute_slot_mapping",
     "from minivllm.worker.block_table import compute_slot_mapping", "compute_slot_mapping"),
    ("3.1", "check_allocate_slots", "MyKVCacheManager",
     "from minivllm.core.kv_cache_manager import KVCacheManager as MyKVCacheManager",
     "KVCacheManager.allocate_slots"),
    ("3.1", "check_allocate_slots", "MyKVCacheManager", """
        from minivllm.core.kv_cache_manager import KVCacheManager
        class MyKVCacheManager(KVCacheManager):
            pass
        """, "does not define allocate_slots"),
    ("3.1", "check_allocate_slots", "MyKVCacheManager", """
        from minivllm.core.kv_cache_manager import KVCacheManager
        class MyKVCacheManager(KVCacheManager):
            def allocate_slots(self, request, num_new_tokens, *args):
                return super().allocate_slots(request, num_new_tokens, *args)
        """, "super().allocate_slots"),
    ("3.2", "check_paged_attention", "paged_attention", """
        from minivllm.attention import torch_backend
        def paged_attention(q, kv_cache, block_table, seq_len, scale):
            return torch_backend.paged_decode_attention(q, kv_cache, block_table, seq_len, scale)
        """, "paged_decode_attention"),
    ("3.2", "check_paged_attention", "paged_attention", """
        import torch
        from minivllm import cpu_kernels
        def paged_attention(q, kv_cache, block_table, seq_len, scale):
            out = torch.empty(1, *q.shape)
            cpu_kernels.paged_decode(q[None].contiguous(), kv_cache, block_table[None].int(),
                                     torch.tensor([seq_len]), scale, out)
            return out[0]
        """, "minivllm.cpu_kernels.paged_decode"),
    ("3.2", "check_paged_attention", "paged_attention", """
        import torch
        def paged_attention(q, kv_cache, block_table, seq_len, scale):
            out = torch.empty(1, *q.shape)
            qsl = torch.tensor([0, 1], dtype=torch.int32)
            torch.ops.minivllm_cpu.paged_prefill(
                q[None].contiguous(), kv_cache, block_table[None].int(),
                torch.tensor([seq_len], dtype=torch.int32), qsl, scale, out, 0, 0)
            return out[0]
        """, "paged_prefill"),
    # 4.1 and 5.1 schedulers
    ("4.1", "check_phase_separated_scheduler", "MyPhaseSeparatedScheduler",
     "from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler as MyPhaseSeparatedScheduler",
     "PhaseSeparatedScheduler"),
    ("4.1", "check_phase_separated_scheduler", "MyPhaseSeparatedScheduler", """
        from minivllm.core.scheduler import Scheduler
        class MyPhaseSeparatedScheduler(Scheduler):
            pass
        """, "does not define schedule"),
    ("5.1", "check_unified_scheduler", "MyScheduler",
     "from minivllm.core.scheduler import Scheduler as MyScheduler", "Scheduler.schedule"),
    ("5.1", "check_unified_scheduler", "MyScheduler", """
        from minivllm.core.scheduler import Scheduler
        class MyScheduler(Scheduler):
            def schedule(self):
                return super().schedule()
        """, "super().schedule"),
    ("5.1", "check_unified_scheduler", "MyScheduler", """
        from minivllm.core.scheduler import Scheduler
        class MyScheduler(Scheduler):
            def schedule(self):
                admit = self._try_admit
                return Scheduler.schedule(self)
        """, "Scheduler."),
    # 5.2: the grader's own search is not importable as the answer
    ("5.2", "check_chunking_choice", "choose_chunking", """
        from minivllm.course.checks import tuning
        def choose_chunking(evaluate, tpot_limit_ms):
            return tuning._grid_best(16.0, tpot_limit_ms)
        """, "_grid_best"),
    # 6.1 hashes: the measured import, Python's hash()
    ("6.1", "check_block_hashes", ("hash_block_tokens", "update_block_hashes"),
     "from minivllm.core.kv_cache_utils import hash_block_tokens, update_block_hashes",
     "minivllm.core.kv_cache_utils.hash_block_tokens"),
    ("6.1", "check_block_hashes", ("hash_block_tokens", "update_block_hashes"), """
        def hash_block_tokens(parent, token_ids, extra_keys):
            return hash((parent, tuple(token_ids))).to_bytes(8, "little", signed=True)
        def update_block_hashes(request, block_size):
            return request.block_hashes
        """, "built-in hash()"),
    # 6.2 block pool: the measured bare subclass, an alias, composition
    ("6.2", "check_block_pool", "MyBlockPool", """
        from minivllm.core.block_pool import BlockPool
        class MyBlockPool(BlockPool):
            pass
        """, "subclasses minivllm.core.block_pool.BlockPool"),
    ("6.2", "check_block_pool", "MyBlockPool",
     "from minivllm.core.block_pool import BlockPool as MyBlockPool", "BlockPool"),
    ("6.2", "check_block_pool", "MyBlockPool", """
        from minivllm.core import block_pool
        class MyBlockPool:
            def __init__(self, num_blocks, enable_caching=True):
                self.pool = block_pool.BlockPool(num_blocks, enable_caching)
            def __getattr__(self, name):
                return getattr(self.pool, name)
        """, "BlockPool"),
    # 7.1 busy loop, 7.2 detokenizer
    ("7.1", "check_busy_loop", "MyEngineCoreProc",
     "from minivllm.engine.core_proc import EngineCoreProc as MyEngineCoreProc", "EngineCoreProc"),
    ("7.2", "check_detokenizer", "MyDetokenizer", """
        from minivllm.engine.detokenizer import FastIncrementalDetokenizer
        class MyDetokenizer(FastIncrementalDetokenizer):
            pass
        """, "IncrementalDetokenizer"),
    # 8.1 and 8.2: names bound before grading (the attribute swap missed them)
    ("8.1", "check_chat_stream", "chat_stream", """
        from minivllm.entrypoints.openai.serving import chat_completion_stream_generator
        async def chat_stream(request_id, model, outputs, include_usage):
            async for event in chat_completion_stream_generator(request_id, model, outputs,
                                                                include_usage):
                yield event
        """, "chat_completion_stream_generator"),
    ("8.2", "check_benchmark_metrics", "benchmark_metrics", """
        from minivllm.benchmarks.serve import summarize as package_summary
        def benchmark_metrics(traces, duration_s, slos_ms):
            return package_summary(traces, duration_s, slos_ms)
        """, "minivllm.benchmarks.serve.summarize"),
    ("8.2", "check_benchmark_metrics", "benchmark_metrics",
     "from minivllm.course.checks.serving import reference_metrics as benchmark_metrics",
     "reference_metrics"),
    # 10.x
    ("10.1", "check_persistent_batch", "PersistentBatch", """
        from minivllm.worker.input_batch import InputBatch
        class PersistentBatch(InputBatch):
            pass
        """, "InputBatch"),
    ("10.2", "check_graph_runner", "GraphRunner",
     "from minivllm.worker.cuda_graphs import DecodeCudaGraphs as GraphRunner", "DecodeCudaGraphs"),
    ("10.3", "check_capture_sizes", "choose_capture_sizes", """
        from minivllm.worker.cuda_graphs import cudagraph_batch_sizes
        def choose_capture_sizes(probs, max_graphs, max_batch):
            return cudagraph_batch_sizes(max_batch)[:max_graphs]
        """, "cudagraph_batch_sizes"),
    # 11.1: the grader's own search
    ("11.1", "check_goodput_tuner", "tune", """
        from minivllm.course.checks.capstone import _reference_choice
        def tune(evaluate, targets):
            return _reference_choice(evaluate)
        """, "_reference_choice"),
    # 11.2: an engine assembled from the package's parts
    ("11.2", "check_own_engine", ("MySampler", "MyScheduler", "MyBlockPool"), """
        from minivllm.core.block_pool import BlockPool as MyBlockPool
        from minivllm.core.scheduler import Scheduler as MyScheduler
        from minivllm.sample.sampler import Sampler as MySampler
        """, "minivllm.sample.sampler.Sampler"),
    # 12.x
    ("12.1", "check_row_parallel_linear", "RowParallelLinear", """
        from minivllm.model import parallel_layers
        class RowParallelLinear(parallel_layers.RowParallelLinear):
            pass
        """, "RowParallelLinear"),
    ("12.2", "check_qkv_sharding", "shard_qkv", """
        from minivllm.model.parallel_layers import kv_head_partition as partition
        def shard_qkv(q, k, v, num_heads, num_kv_heads, tp_size, tp_rank):
            first, count = partition(num_kv_heads, tp_size, tp_rank)
            d = q.shape[0] // num_heads
            per = num_heads // tp_size
            rows = slice(first * d, (first + count) * d)
            return q[tp_rank * per * d:(tp_rank + 1) * per * d], k[rows], v[rows]
        """, "kv_head_partition"),
]


@pytest.mark.parametrize("exercise, checker, names, source, named", CHEATS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CHEATS)])
def test_a_cheat_fails_naming_what_it_reached(exercise, checker, names, source, named):
    scope = _cell(source)
    args = [scope[n] for n in ((names,) if isinstance(names, str) else names)]
    with pytest.raises(checks.Delegated) as info:
        getattr(checks, checker)(*args)
    message = str(info.value)
    assert message.startswith(f"Exercise {exercise}"), message
    assert named in message and "the package's own answer" in message or "hash()" in message, \
        message


def test_every_exercise_outside_chapter_09_has_a_cheat():
    graded = {c[0] for c in CHEATS}
    assert graded >= {"1.1", "1.2", "1.3", "2.1", "2.2", "3.1", "3.2", "4.1", "5.1", "5.2", "6.1",
                      "6.2", "7.1", "7.2", "8.1", "8.2", "10.1", "10.2", "10.3", "11.1", "11.2",
                      "12.1", "12.2"}


def test_a_cheat_that_catches_the_refusal_still_fails():
    scope = _cell("""
        import importlib
        import torch
        def rms_norm(x, weight, eps):
            try:
                package = importlib.import_module("minivllm.model.layers")
                return getattr(package, "rms" + "_norm")(x, weight, eps)
            except Exception:
                x32 = x.float()
                return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
                        * weight.float()).to(x.dtype)
        """)
    with pytest.raises(checks.Delegated, match="while it ran"):
        checks.check_rms_norm(scope["rms_norm"])


def test_grid_best_is_gone_and_a_failure_never_names_the_best_choice():
    from minivllm.course.checks import tuning

    assert not hasattr(tuning, "grid_best")
    with pytest.raises(checks.CheckFailed) as info:
        checks.check_chunking_choice(
            lambda evaluate, limit: {"max_num_batched_tokens": 128,
                                     "long_prefill_token_threshold": 64}, seed=1)
    message = str(info.value)
    assert message.count("max_num_batched_tokens=") == 1, message  # the learner's own choice


# the answer reached where the profile hook of the watched call does not run by itself: in a
# thread the learner's code starts, or in code compiled at run time from the package's source
@pytest.mark.parametrize("source, named", [("""
    import concurrent.futures
    import importlib
    def rms_norm(x, weight, eps):
        norm = getattr(importlib.import_module("minivllm.model." + "layers"), "rms" + "_norm")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(norm, x, weight, eps).result()
    """, "called minivllm.model.layers.rms_norm"), ("""
    import importlib
    import inspect
    def rms_norm(x, weight, eps):
        layers = importlib.import_module("minivllm.model." + "layers")
        scope = dict(vars(layers))
        exec(inspect.getsource(getattr(layers, "rms" + "_norm")), scope)
        return scope["rms" + "_norm"](x, weight, eps)
    """, "called a copy of minivllm.model.layers.rms_norm")], ids=["thread", "exec"])
def test_a_thread_or_a_copy_made_at_run_time_is_still_caught(source, named):
    import threading

    with pytest.raises(checks.Delegated, match="while it ran") as info:
        checks.check_rms_norm(_cell(source)["rms_norm"])
    assert named in str(info.value)
    assert threading.getprofile() is None  # new threads are not watched after grading


def test_a_pasted_copy_is_caught_without_the_modules_imports():
    """Pasted alone (``torch`` imported in another cell), the package's function compiles to
    other instructions than in its module (there ``torch`` is bound by an import): still a copy."""
    import inspect

    from minivllm.model import layers

    scope = _cell("import torch")
    exec(compile(inspect.getsource(layers.rms_norm), "<notebook cell>", "exec"), scope)
    with pytest.raises(checks.Delegated, match="is a copy of minivllm.model.layers.rms_norm"):
        checks.check_rms_norm(scope["rms_norm"])


@pytest.mark.parametrize("source, named", [("""
    import sys
    def rms_norm(x, weight, eps):
        expected = sys._getframe(1).f_back.f_locals
        return x
    """, "uses _getframe"), ("""
    import sys
    def rms_norm(x, weight, eps):
        try:
            raise ValueError
        except ValueError as e:
            frame = e.__traceback__.tb_frame
        return x
    """, "uses tb_frame"), ("""
    import importlib
    def rms_norm(x, weight, eps):
        frame = getattr(importlib.import_module("sys"), "_get" + "frame")(1)
        return x
    """, "called sys._getframe"), ("""
    import importlib
    def rms_norm(x, weight, eps):
        frames = getattr(importlib.import_module("inspect"), "st" + "ack")()
        return x
    """, "called inspect.stack")], ids=["static", "traceback", "sys", "inspect"])
def test_reading_the_graders_frames_is_refused(source, named):
    with pytest.raises(checks.Delegated, match="reads the grader's own frames") as info:
        checks.check_rms_norm(_cell(source)["rms_norm"])
    assert named in str(info.value)


# results whose own methods would answer the grader's comparisons
@pytest.mark.parametrize("checker, names, source, named", [
    ("check_rms_norm", "rms_norm", """
        import torch
        class Agreeable(torch.Tensor):
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                if func is torch.isclose:
                    return torch.ones(args[0].shape, dtype=torch.bool)
                return super().__torch_function__(func, types, args, kwargs or {})
        def rms_norm(x, weight, eps):
            return torch.zeros_like(x).as_subclass(Agreeable)
        """, "Agreeable, a torch.Tensor subclass of your own"),
    ("check_block_hashes", ("hash_block_tokens", "update_block_hashes"), """
        class Digest(bytes):
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
            __hash__ = bytes.__hash__
        def hash_block_tokens(parent_block_hash, token_ids, extra_keys):
            return Digest(b"0" * 32)
        def update_block_hashes(request, block_size):
            return request.block_hashes
        """, "Digest, a subclass of bytes of your own that defines __eq__"),
], ids=["tensor", "bytes"])
def test_a_result_that_answers_comparisons_itself_fails(checker, names, source, named):
    scope = _cell(source)
    args = [scope[n] for n in ((names,) if isinstance(names, str) else names)]
    with pytest.raises(checks.CheckFailed, match="its own methods") as info:
        getattr(checks, checker)(*args)
    assert named in str(info.value)


def test_faked_flags_only_the_learners_own_comparing_classes():
    import collections

    import torch

    from minivllm.course.grading import faked

    scope = _cell("""
        import collections
        import torch
        Pair = collections.namedtuple("Pair", "a b")
        class Loud(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        class Plain(torch.Tensor):
            pass
        """)
    assert faked([1, 2.0, "a", b"b", None, torch.ones(2), torch.nn.Parameter(torch.ones(1)),
                  {"k": (1, 2)}, scope["Pair"](1, 2), collections.OrderedDict(a=1)]) is None
    assert faked([[{"k": scope["Loud"](3)}]]) == \
        "Loud, a subclass of int of your own that defines __eq__"
    assert faked((torch.ones(1), torch.ones(1).as_subclass(scope["Plain"]))) == \
        "Plain, a torch.Tensor subclass of your own"
