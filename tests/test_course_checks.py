"""The checkers the exercise notebooks call: a correct component passes, however it is written;
each classic mistake fails with a CheckFailed that names the convention (and the mistake, where
the checker can tell)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minivllm.course import checks
from minivllm.core.block_pool import BlockPool
from minivllm.course.checks.model import _rope_interleaved
from minivllm.model.layers import RMSNorm, RotaryEmbedding
from minivllm.sample.sampler import Sampler
from tests.course_helpers import fails


# -- 1.1 RMSNorm ---------------------------------------------------------------------------------

def own_rms_norm(x, weight, eps):
    x32 = x.float()
    return (x32 / (x32.square().mean(-1, keepdim=True) + eps).sqrt() * weight.float()).to(x.dtype)


def test_rms_norm_check_passes_an_own_implementation(capsys):
    checks.check_rms_norm(own_rms_norm)
    assert "Exercise 1.1 passed" in capsys.readouterr().out


def test_rms_norm_through_the_package_module_is_refused():
    def rms_norm_with_module(x, weight, eps):
        norm = RMSNorm(x.shape[-1], eps).to(x.dtype)
        norm.weight.data = weight.to(x.dtype)
        return norm(x).detach()

    fails(checks.check_rms_norm, rms_norm_with_module, "Exercise 1.1", "RMSNorm",
          "the package's own answer", error=checks.Delegated)


def test_rms_norm_without_eps_fails_with_a_hint():
    def no_eps(x, w, eps):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)) * w).to(x.dtype)

    fails(checks.check_rms_norm, no_eps, "Exercise 1.1", "sqrt(mean(x**2", "add eps inside the sqrt")


def test_layer_norm_is_not_rms_norm():
    def layer_norm(x, w, eps):
        return F.layer_norm(x.float(), x.shape[-1:], w.float(), eps=eps).to(x.dtype)

    fails(checks.check_rms_norm, layer_norm, "expected", "got")


def test_rms_norm_returning_float32_for_bfloat16_fails_on_dtype():
    def keeps_float32(x, w, eps):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    fails(checks.check_rms_norm, keeps_float32, "expected dtype torch.bfloat16")


# -- 1.2 rotary ----------------------------------------------------------------------------------

def _rope(x, positions, base):
    d = x.shape[-1]
    angle = positions.double()[:, None] * base ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x.double()[..., :d // 2], x.double()[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(x.dtype)


def test_rotary_check_passes_an_own_implementation():
    checks.check_rotary(_rope)


def test_rotary_through_the_package_module_is_refused():
    def with_module(x, positions, base):
        return RotaryEmbedding(x.shape[-1], int(positions.max()) + 1, base)(positions, x, x)[0]

    fails(checks.check_rotary, with_module, "RotaryEmbedding", error=checks.Delegated)


def test_interleaved_rotary_fails_naming_the_layout():
    fails(checks.check_rotary, _rope_interleaved, "Exercise 1.2", "neox", "adjacent pairs")


def test_rotary_by_batch_index_instead_of_position_fails_naming_it():
    def by_index(x, positions, base):
        return _rope(x, torch.arange(len(positions)), base)

    fails(checks.check_rotary, by_index, "positions[t]")


# -- 1.3 GQA -------------------------------------------------------------------------------------

def test_gqa_check_refuses_torch_sdpa_the_chapter_cell():
    def sdpa(q, k, v, scale):
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(0, 1)

    fails(checks.check_gqa_attention, sdpa, "scaled_dot_product_attention", error=checks.Delegated)


def _attention(q, k, v, scale, causal=True, tile=False):
    group = q.shape[1] // k.shape[1]
    if tile:
        k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
    else:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    if causal:
        t = q.shape[0]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("mistake, hint", [
    (dict(tile=True), "h % kv_heads"),
    (dict(causal=False), "no causal mask"),
])
def test_gqa_mistakes_fail_naming_them(mistake, hint):
    fails(checks.check_gqa_attention, lambda q, k, v, s: _attention(q, k, v, s, **mistake),
          "Exercise 1.3", "h // (heads // kv_heads)", hint)


def test_gqa_check_passes_an_einsum_attention():
    checks.check_gqa_attention(_attention)


def test_gqa_ignoring_the_scale_argument_fails():
    fails(checks.check_gqa_attention, lambda q, k, v, s: _attention(q, k, v, q.shape[-1] ** -0.5),
          "use the scale argument")


# -- 2.1 sampler ---------------------------------------------------------------------------------

def test_sampler_check_refuses_the_reference_sampler_and_a_bare_subclass():
    for cls in (Sampler, type("MySampler", (Sampler,), {})):
        fails(checks.check_sampler, cls, "minivllm.sample.sampler.Sampler", error=checks.Delegated)


class _RowSampler(torch.nn.Module):
    """A learner's sampler with switchable mistakes, written on the whole batch at once, drawing
    with ``torch.multinomial`` (not the reference's method, so not its random stream)."""

    top_p_keeps_crossing_token = True
    top_p_before_top_k = False
    use_own_generators = True
    use_temperature = True

    def forward(self, logits, meta):
        out = logits.argmax(-1).clone()
        rows = (meta.temperature >= 1e-5).nonzero().flatten().tolist()
        if not rows:
            return out
        temps = meta.temperature[rows] if self.use_temperature else torch.ones(len(rows))
        ks = meta.top_k[rows] if meta.top_k is not None else torch.zeros(len(rows), dtype=torch.long)
        ps = meta.top_p[rows] if meta.top_p is not None else torch.ones(len(rows))
        x = logits[rows] / temps[:, None]
        steps = [self._top_p, self._top_k] if self.top_p_before_top_k else [self._top_k, self._top_p]
        for step in steps:
            x = step(x, ks, ps)
        probs = x.softmax(-1)
        own = {i: meta.generators[r] for i, r in enumerate(rows)
               if self.use_own_generators and r in meta.generators}
        shared = [i for i in range(len(rows)) if i not in own]
        if shared:
            out[[rows[i] for i in shared]] = torch.multinomial(
                probs[shared], 1, generator=meta.generator)[:, 0]
        for i, gen in own.items():
            out[rows[i]] = torch.multinomial(probs[i], 1, generator=gen)[0]
        return out

    def _top_k(self, x, k, p):
        kth = x.sort(-1, descending=True).values.gather(-1, (k.clamp_min(1) - 1)[:, None])
        return x.masked_fill((k[:, None] > 0) & (x < kth), float("-inf"))

    def _top_p(self, x, k, p):
        probs, order = x.softmax(-1).sort(-1, descending=True)
        before = probs.cumsum(-1) - probs
        drop = before >= p[:, None] if self.top_p_keeps_crossing_token else probs.cumsum(-1) > p[:, None]
        drop[:, 0] = False
        drop &= (p < 1)[:, None]
        return x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def _variant(**flags):
    return type("Variant", (_RowSampler,), flags)


@pytest.mark.slow
def test_a_multinomial_sampler_passes(capsys):
    checks.check_sampler(_variant())
    assert "Exercise 2.1 passed" in capsys.readouterr().out


@pytest.mark.parametrize("flags, fragment", [
    (dict(use_temperature=False), "temperature=0.5"),
    (dict(top_p_keeps_crossing_token=False), "top_p=0.6"),
    (dict(top_p_before_top_k=True), "top_k=4, top_p=0.6"),
    (dict(use_own_generators=False), "meta.generators[row]"),
])
def test_sampler_mistakes_fail(flags, fragment):
    fails(checks.check_sampler, _variant(**flags), "Exercise 2.1", fragment, engine=False)


def test_sampler_that_ignores_greedy_rows_fails():
    class AlwaysSamples(_RowSampler):
        def forward(self, logits, meta):
            meta.temperature = meta.temperature.clamp_min(1.0)
            return super().forward(logits, meta)

    fails(checks.check_sampler, AlwaysSamples, "argmax", engine=False)


# -- 2.2 the generation loop with a KV cache -------------------------------------------------------

def _loop(mistake=None):
    from minivllm.attention.backend import get_attention_backend
    from minivllm.model.standalone import sequence_logits, single_sequence_metadata

    if mistake == "delegates":
        from minivllm.model.standalone import greedy_generate

        return lambda model, ids, n, block_size=16: greedy_generate(model, ids, n, block_size)[0]

    def generate_with_cache(model, ids, n, block_size=16):
        if mistake == "no cache":
            ids = list(ids)
            for _ in range(n):
                ids.append(int(sequence_logits(model, ids)[-1].argmax()))
            return ids[-n:]
        c = model.config
        num_blocks = -(-(len(ids) + n) // block_size)
        for layer in model.attention_layers():
            layer.kv_cache = torch.zeros(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
            layer.backend = get_attention_backend("torch")
        feed, start, out = list(ids), 0, []
        if mistake == "prompt token by token":
            for i in range(len(ids) - 1):
                model(torch.tensor(ids[i:i + 1]), torch.arange(i, i + 1),
                      single_sequence_metadata(i, i + 1, list(range(num_blocks)), block_size, "cpu"))
            feed, start = ids[-1:], len(ids) - 1
        for _ in range(n):
            end = start + len(feed)
            meta = single_sequence_metadata(start, end, list(range(num_blocks)), block_size, "cpu")
            hidden = model(torch.tensor(feed), torch.arange(start, end), meta)
            out.append(int(model.compute_logits(hidden[-1:]).argmax()))
            feed, start = [out[-1]], (len(ids) if mistake == "same position" else end)
        return out

    return generate_with_cache


def test_greedy_generate_equals_recomputing_without_a_cache():
    from minivllm.course.checks.generation import _model
    from minivllm.model.standalone import greedy_generate, sequence_logits

    model = _model()
    ids = list(range(300, 313))
    tokens, seconds = greedy_generate(model, ids, 6, block_size=4)
    for _ in range(6):
        ids.append(int(sequence_logits(model, ids)[-1].argmax()))
    assert tokens == ids[13:] and len(seconds) == 6


def test_cached_generation_check_passes_the_loop(capsys):
    checks.check_cached_generation(_loop())
    assert "Exercise 2.2 passed" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, fragments", [
    ("no cache", ["forward 2 fed 2 tokens", "only the token just chosen"]),
    ("prompt token by token", ["prefill the whole prompt in one forward"]),
    ("same position", ["expected position"]),
    ("delegates", ["greedy_generate", "the package's own answer"]),
])
def test_cached_generation_mistakes_fail_naming_them(mistake, fragments):
    fails(checks.check_cached_generation, _loop(mistake), "Exercise 2.2", *fragments)


# -- 3.1 slot mapping, 3.2 paged attention ---------------------------------------------------------

@pytest.mark.slow
def test_slot_mapping_check_passes_a_list_comprehension():
    checks.check_slot_mapping(lambda table, pos, bs: [table[p // bs] * bs + p % bs for p in pos])


@pytest.mark.parametrize("wrong", [
    lambda table, pos, bs: [table[p // bs] + p % bs for p in pos],  # forgot * block_size
    lambda table, pos, bs: [p for p in pos],  # ignored the block table
    lambda table, pos, bs: [table[p % len(table)] * bs + p // bs for p in pos],  # swapped
])
def test_slot_mapping_mistakes_fail_stating_the_convention(wrong):
    fails(checks.check_slot_mapping, wrong, "Exercise 3.1", "block_table[p // block_size]", "got")


def _paged(q, kv_cache, block_table, seq_len, scale, read=None, tile=False):
    bs = kv_cache.shape[2]
    n = seq_len if read is None else read(seq_len, bs, len(block_table))
    pos = torch.arange(n)
    k, v = (kv_cache[i, block_table[pos // bs], pos % bs] for i in (0, 1))
    g = q.shape[0] // k.shape[1]
    if tile:  # head h -> KV head h % kv_heads: the classic mistake
        k, v = k.repeat(1, g, 1), v.repeat(1, g, 1)
    else:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.einsum("hs,shd->hd", (torch.einsum("hd,shd->hs", q, k) * scale).softmax(-1), v)


@pytest.mark.slow
def test_paged_attention_check_passes_a_gather_then_attend():
    checks.check_paged_attention(_paged)


@pytest.mark.parametrize("kwargs, hint", [
    (dict(read=lambda n, bs, nb: -(-n // bs) * bs), "only the first seq_len"),
    (dict(read=lambda n, bs, nb: nb * bs), "only the first seq_len"),
    (dict(tile=True), "h % kv_heads"),
])
def test_paged_attention_mistakes_fail_naming_them(kwargs, hint):
    fails(checks.check_paged_attention, lambda *a: _paged(*a, **kwargs), "Exercise 3.2", hint)


def test_unsolved_exercise_propagates_not_implemented_error():
    def unsolved(*args):
        raise NotImplementedError("Exercise 3.1: ...")

    with pytest.raises(NotImplementedError, match="Exercise 3.1"):
        checks.check_slot_mapping(unsolved)


# -- 3.1 allocate_slots --------------------------------------------------------------------------

def _manager(mistake=None):
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.utils import cdiv

    class Manager(KVCacheManager):
        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                           new_computed_blocks=None):
            blocks = self.req_to_blocks.setdefault(request.request_id, [])
            total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
            held = 0 if mistake == "forgets existing blocks" else len(blocks)
            rounded = total // self.block_size if mistake == "floor" else cdiv(total, self.block_size)
            need = max(0, rounded - held)
            free = self.block_pool.get_num_free_blocks()
            if mistake == "partial" and need > free:
                blocks.extend(self.block_pool.get_new_blocks(free))
                return None
            if need > free and mistake != "no room check":
                return None
            new = self.block_pool.get_new_blocks(need)
            blocks.extend(new)
            return new

    return Manager


def test_allocate_slots_check_passes_the_rule(capsys):
    checks.check_allocate_slots(_manager())
    out = capsys.readouterr().out
    assert "Exercise 3.1 passed" in out and "preemptions" in out


@pytest.mark.parametrize("mistake, fragments", [
    ("floor", ["floor(tokens / block_size)", "round up"]),
    ("forgets existing blocks", ["the blocks it already holds count"]),
    ("no room check", ["more than are free", "return None, taking nothing"]),
    ("partial", ["returned None but took 1 block from the pool", "leak"]),
])
def test_allocate_slots_mistakes_fail_naming_them(mistake, fragments):
    fails(checks.check_allocate_slots, _manager(mistake), "Exercise 3.1", *fragments,
          "ceil(tokens / block_size)")


def test_allocate_slots_check_refuses_the_package_own():
    from minivllm.core.kv_cache_manager import KVCacheManager

    class Inherits(KVCacheManager):
        pass

    class CallsSuper(KVCacheManager):
        def allocate_slots(self, *args, **kwargs):
            try:
                return super().allocate_slots(*args, **kwargs)
            except Exception:
                return None

    for cls in (Inherits, CallsSuper):
        fails(checks.check_allocate_slots, cls, "Exercise 3.1",
              "KVCacheManager.allocate_slots", "write it")
    assert KVCacheManager.allocate_slots.__name__ == "allocate_slots"
    assert "num_new_computed_tokens" in KVCacheManager.allocate_slots.__code__.co_varnames


def test_slot_mapping_check_accepts_numpy_output():
    from minivllm.worker.block_table import compute_slot_mapping

    assert isinstance(compute_slot_mapping([3, 1], np.arange(3), 2), np.ndarray)


# -- the scheduler swap (chapters 04-05 and their checkers) ----------------------------------------

def test_swapped_scheduler_builds_what_the_engine_arguments_say_and_restores_the_engine():
    from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler
    from minivllm.course.checks.common import check_engine, greedy_token_ids
    from minivllm.course.swap import swapped_scheduler
    from minivllm.course.views import engine_core

    llm = check_engine()
    own = engine_core(llm).scheduler
    prompts = ["def fibonacci(n):"]
    expected = greedy_token_ids(llm, prompts, max_tokens=4)
    with swapped_scheduler(llm, scheduler="v0", max_num_batched_tokens=1024, num_kv_blocks=40) as s:
        assert type(s) is PhaseSeparatedScheduler and engine_core(llm).scheduler is s
        assert s.kv_cache_manager.num_blocks == 40 and s.max_num_batched_tokens == 1024
        assert greedy_token_ids(llm, prompts, max_tokens=4) == expected
        assert llm.llm_engine.get_step_trace()[0]["step"] == 1  # a trace of its own
    assert engine_core(llm).scheduler is own


@pytest.mark.parametrize("overrides, message", [
    (dict(block_size=4), "can change only"),
    (dict(scheduler="v0", max_num_batched_tokens=32), "max_num_batched_tokens"),
    (dict(num_kv_blocks=10**6), "holds only"),
])
def test_swapped_scheduler_rejects_what_llm_would_reject(overrides, message):
    from minivllm.course.checks.common import check_engine
    from minivllm.course.swap import swapped_scheduler

    with pytest.raises(ValueError, match=message):
        with swapped_scheduler(check_engine(), **overrides):
            pass


def test_swapped_scheduler_aborts_what_an_error_left_behind():
    from minivllm import SamplingParams
    from minivllm.course.checks.common import check_engine
    from minivllm.course.swap import swapped_scheduler

    llm = check_engine()
    with pytest.raises(RuntimeError, match="boom"):
        with swapped_scheduler(llm, max_num_seqs=2):
            llm.llm_engine.add_request("x", "Hello", SamplingParams(max_tokens=3))
            raise RuntimeError("boom")
    assert not llm.llm_engine.has_unfinished_requests()


# -- 4.1 the phase-separated (v0) scheduler ------------------------------------------------------

from minivllm.core.request import RequestStatus  # noqa: E402
from minivllm.core.scheduler import Scheduler  # noqa: E402


def _admit(sched, head, budget, whole_only):
    """Admission written without the package's _try_admit: the tokens scheduled, 0 if none."""
    hits, num_cached = sched.kv_cache_manager.get_computed_blocks(head)
    want = head.num_tokens - num_cached
    if sched.long_prefill_token_threshold and not whole_only:
        want = min(want, sched.long_prefill_token_threshold)
    if whole_only and want > budget:
        return 0
    want = min(want, budget)
    if sched.kv_cache_manager.allocate_slots(head, want, num_cached, hits) is None:
        return 0
    sched.running.append(sched.waiting.popleft())
    head.status = RequestStatus.RUNNING
    head.num_computed_tokens = num_cached
    sched.record_admission(head, num_cached)
    return want


class _V0(Scheduler):
    """A phase-separated schedule(), written unlike the package's (and without its helpers),
    with switchable mistakes."""

    prefill_first = True  # False: decode whenever anything runs (waiting prompts wait)
    mix = False  # True: decode the running requests in the prefill step too
    admit_all = True  # False: one prompt per prefill step

    def _prefill(self, entries):
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            n = _admit(self, head, budget, whole_only=True)
            if not n:
                break
            entries.append((head, n))
            budget -= n
            if not self.admit_all:
                break

    def _decode(self, entries, requests, preempted):
        for request in requests:
            if request not in self.running:
                break  # preempted by an earlier request of this loop
            while self.kv_cache_manager.allocate_slots(request, 1) is None:
                victim = self.running.pop()
                self._preempt(victim)  # 4.1 may use the package's state change
                preempted.append(victim)
                if victim is request:
                    break
            if request in preempted:
                break
            entries.append((request, 1))

    def schedule(self):
        entries, preempted = [], []
        running = list(self.running)
        if self.prefill_first or not self.running:
            self._prefill(entries)
        if not entries or self.mix:
            self._decode(entries, running, preempted)
        return self.make_scheduler_output(entries, preempted)


@pytest.mark.slow
def test_v0_check_passes_a_scheduler_written_without_the_package_helpers(capsys):
    checks.check_phase_separated_scheduler(_V0)
    assert capsys.readouterr().out.count("Exercise 4.1 passed") == 1


class _DelegatesAdmission(_V0):
    def _prefill(self, entries):
        while self.waiting and len(self.running) < self.max_num_seqs:
            n = self._try_admit(self.waiting[0], self.max_num_batched_tokens, whole_only=True)
            if not n:
                break
            entries.append((self.running[-1], n))


class _DelegatesToSuper(Scheduler):
    def schedule(self):
        return super().schedule()


class _CatchesAndDelegates(_V0):
    def _prefill(self, entries):
        try:
            Scheduler._try_admit(self, self.waiting[0], 10**6, whole_only=True)
        except AssertionError:
            pass
        super()._prefill(entries)


def test_v0_check_fails_the_package_scheduler_and_classes_that_delegate_to_it():
    from minivllm.core.scheduler_v0 import PhaseSeparatedScheduler

    for cls, name in ((PhaseSeparatedScheduler, "PhaseSeparatedScheduler"),
                      (_DelegatesAdmission, "Scheduler._try_admit"),
                      (_DelegatesToSuper, "Scheduler.schedule"),
                      (_CatchesAndDelegates, "Scheduler._try_admit")):
        fails(checks.check_phase_separated_scheduler, cls, "Exercise 4.1", name,
              "the package's own answer", "self.kv_cache_manager", error=checks.Delegated)


@pytest.mark.parametrize("flags, fragment", [
    (dict(mix=True), "mixes the prefill of"),
    (dict(prefill_first=False), "waiting prompts take priority"),
    (dict(admit_all=False), "keep admitting while prompts fit"),
])
def test_v0_mistakes_fail_naming_them(flags, fragment):
    fails(checks.check_phase_separated_scheduler, type("Mistake", (_V0,), flags),
          "Exercise 4.1", fragment, "Expected (v0)")


def test_the_v1_scheduler_is_not_a_v0_one():
    fails(checks.check_phase_separated_scheduler, type("V1", (_V1,), {}), "Exercise 4.1",
          "in v0 a step is")


def test_scheduler_checks_want_a_scheduler_class():
    fails(checks.check_phase_separated_scheduler, object,
          "subclass of minivllm.core.scheduler.Scheduler")


# -- 5.1 the unified (v1) scheduler --------------------------------------------------------------

class _V1(Scheduler):
    """A unified schedule() with its own preemption (not the package's helpers), with switchable
    mistakes."""

    subtract_budget = True
    victim_index = -1  # 0: preempt the earliest arrival
    requeue_front = True
    reset_computed = True

    def _evict(self, victim):
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        if self.reset_computed:
            victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self.requeue_front:
            self.waiting.appendleft(victim)
        else:
            self.waiting.append(victim)

    def schedule(self):
        budget = self.max_num_batched_tokens
        entries, preempted = [], []
        for request in list(self.running):
            if budget <= 0 or request not in self.running:
                break
            want = request.num_tokens - request.num_computed_tokens
            if self.long_prefill_token_threshold:
                want = min(want, self.long_prefill_token_threshold)
            want = min(want, budget)
            while self.kv_cache_manager.allocate_slots(request, want) is None:
                victim = self.running.pop(self.victim_index)
                self._evict(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if any(v is request for v in preempted):
                break
            entries.append((request, want))
            if self.subtract_budget:
                budget -= want
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            n = _admit(self, self.waiting[0], budget, whole_only=False)
            if not n:
                break
            entries.append((self.running[-1], n))
            budget -= n
        return self.make_scheduler_output(entries, preempted)


@pytest.mark.slow
def test_v1_check_passes_a_scheduler_written_without_the_package_helpers(capsys):
    checks.check_unified_scheduler(_V1)
    assert capsys.readouterr().out.count("Exercise 5.1 passed") == 1


class _DelegatesPreemption(_V1):
    def _evict(self, victim):
        self._preempt(victim)


class _DelegatesTheLoop(_V1):
    def schedule(self):
        entries, preempted, budget = [], [], self.max_num_batched_tokens
        for request in list(self.running):
            want = min(request.num_tokens - request.num_computed_tokens, 16, budget)
            if request not in self.running or not self._allocate_or_preempt(request, want, preempted):
                break
            entries.append((request, want))
            budget -= want
        while not preempted and self.waiting and budget > 0:
            n = _admit(self, self.waiting[0], budget, whole_only=False)
            if not n:
                break
            entries.append((self.running[-1], n))
            budget -= n
        return self.make_scheduler_output(entries, preempted)


def test_v1_check_fails_the_package_scheduler_and_classes_that_delegate_to_it():
    for cls, name in ((Scheduler, "Scheduler.schedule"), (_DelegatesToSuper, "Scheduler.schedule"),
                      (_DelegatesPreemption, "Scheduler._preempt"),
                      (_DelegatesTheLoop, "Scheduler._allocate_or_preempt")):
        fails(checks.check_unified_scheduler, cls, "Exercise 5.1", name,
              "the package's own answer", error=checks.Delegated)


@pytest.mark.parametrize("flags, fragments", [
    (dict(subtract_budget=False), ["over the step's budget max_num_batched_tokens=24"]),
    (dict(victim_index=0), ["latest-arrived running request", "expected the 1 latest"]),
    (dict(requeue_front=False), ["FRONT of the waiting queue", "appendleft"]),
    (dict(reset_computed=False),
     ["num_computed_tokens is still", "reset num_computed_tokens to 0"]),
])
def test_v1_mistakes_fail_naming_them(flags, fragments):
    fails(checks.check_unified_scheduler, type("Mistake", (_V1,), flags), "Exercise 5.1",
          *fragments)


def test_the_v0_scheduler_is_not_a_v1_one():
    class V0(_V0):
        def _preempt(self, request):  # 5.1 writes preemption's state change itself
            self.kv_cache_manager.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.appendleft(request)

    fails(checks.check_unified_scheduler, V0, "Exercise 5.1", "Expected (v1)")


def test_unsolved_scheduler_exercise_propagates_not_implemented_error():
    class Unsolved(Scheduler):
        def schedule(self):
            raise NotImplementedError("Exercise 5.1: ...")

    with pytest.raises(NotImplementedError, match="Exercise 5.1"):
        checks.check_unified_scheduler(Unsolved)


# -- 5.2 choosing the chunking (simulated) ---------------------------------------------------------

def _chunking(budget, cap):
    return {"max_num_batched_tokens": budget, "long_prefill_token_threshold": cap}


def _search(evaluate, tpot_limit_ms):
    """A plain search over budgets and caps, not the solution's."""
    runs = {(b, c): evaluate(b, c) for b in (256, 512, 1024, 2048, 4096) for c in (0, 128, 256, 512)
            if c < b}
    within = [k for k, r in runs.items() if r["p99_tpot_ms"] <= tpot_limit_ms]
    return _chunking(*min(within, key=lambda k: runs[k]["mean_ttft_ms"]))


def test_chunking_check_passes_a_search_on_drawn_settings(capsys):
    checks.check_chunking_choice(_search, seed=3)
    out = capsys.readouterr().out
    assert "Exercise 5.2 passed" in out and "drawn" in out


@pytest.mark.parametrize("choose, fragments", [
    (lambda ev, limit: _chunking(4096, 0), ["over the limit", "P99 TPOT"]),
    (lambda ev, limit: _chunking(256, 128) if limit < 20 else _chunking(128, 64),
     ["slower to the first token", "more than 10%"]),  # prompts spread over many steps
    (lambda ev, limit: {"max_num_batched_tokens": 512}, ["exactly the keys"]),
    (lambda ev, limit: _chunking(512, -1), ["long_prefill_token_threshold must be in"]),
])
def test_chunking_choices_that_miss_fail_saying_what_was_measured(choose, fragments):
    message = fails(checks.check_chunking_choice, choose, "Exercise 5.2", *fragments, seed=0)
    assert "grid search" in message or "Expected" in message


# -- 6.1 the block hash chain ----------------------------------------------------------------------

def _blake2_block(parent, token_ids, extra_keys):
    """A correct hash written differently from the package's: blake2b over JSON."""
    import hashlib
    import json

    data = json.dumps([parent.hex() if parent else None, list(token_ids), list(extra_keys or [])])
    return hashlib.blake2b(data.encode(), digest_size=20).digest()


def _chain(block_hash, salt_everywhere=False, chained=True, from_scratch=False):
    def update(request, block_size):
        hashes = request.block_hashes
        start = 0 if from_scratch else len(hashes)
        tokens = request.all_token_ids
        for i in range(start, len(tokens) // block_size):
            parent = hashes[i - 1] if i and chained else None
            salted = request.cache_salt is not None and (i == 0 or salt_everywhere)
            extra = [request.cache_salt] if salted else []
            hashes.append(block_hash(parent, tokens[i * block_size:(i + 1) * block_size], extra))
        return hashes

    return update


@pytest.mark.slow
def test_block_hash_check_passes_a_blake2_json_chain(capsys):
    checks.check_block_hashes(_blake2_block, _chain(_blake2_block))
    assert "Exercise 6.1 passed" in capsys.readouterr().out


def _python_hash_block(parent, token_ids, extra_keys):
    return hash((parent, tuple(token_ids), tuple(extra_keys or ()))).to_bytes(8, "little", signed=True)


def _parentless_block(parent, token_ids, extra_keys):
    return _blake2_block(None, token_ids, extra_keys)


@pytest.mark.parametrize("block_hash, update, fragments", [
    (_python_hash_block, _chain(_python_hash_block), ["built-in hash()", "hashlib.sha256"]),
    (_parentless_block, _chain(_parentless_block), ["parent_block_hash", "cover its parent's hash"]),
    (_blake2_block, _chain(_blake2_block, chained=False), ["ignores its parent"]),
    (_blake2_block, _chain(_blake2_block, salt_everywhere=True), ["block 0 only"]),
    (_blake2_block, _chain(_blake2_block, from_scratch=True), ["from len(request.block_hashes) on"]),
    (lambda p, t, e: _blake2_block(p, t, []), _chain(_blake2_block), ["extra_keys", "must count"]),
    (lambda p, t, e: _blake2_block(p, t, e).hex(), _chain(_blake2_block), ["expected bytes"]),
])
def test_block_hash_mistakes_fail_naming_them(block_hash, update, fragments):
    fails(checks.check_block_hashes, block_hash, "Exercise 6.1", *fragments, update_block_hashes=update)


def test_block_hash_check_refuses_pythons_hash_even_reached_at_run_time():
    def hashes_through_builtins(parent, token_ids, extra_keys):
        import builtins

        h = getattr(builtins, "ha" + "sh")((parent, tuple(token_ids)))
        return h.to_bytes(8, "little", signed=True)

    fails(checks.check_block_hashes, hashes_through_builtins, "built-in hash()", "while it ran",
          update_block_hashes=_chain(_blake2_block), error=checks.Delegated)


# -- 6.2 the block pool ----------------------------------------------------------------------------

class _OrderedDictPool:
    """A correct pool written differently: an OrderedDict as the free queue, no linked list."""

    def __init__(self, num_blocks, enable_caching=True):
        from collections import OrderedDict

        from minivllm.core.block_pool import KVCacheBlock

        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block = {}

    @property
    def free_block_queue(self):
        return list(self._free.values())

    def get_num_free_blocks(self):
        return len(self._free)

    def get_num_cached_free_blocks(self):
        return sum(b.block_hash is not None for b in self._free.values())

    def get_usage(self):
        return 1 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash):
        copies = self.cached_block_hash_to_block.get(block_hash)  # a list, earliest cached first
        return copies[0] if copies else None

    def _evict(self, b):
        copies = self.cached_block_hash_to_block[b.block_hash]
        copies.remove(b)
        if not copies:
            del self.cached_block_hash_to_block[b.block_hash]
        b.block_hash = None

    def get_new_blocks(self, num_blocks):
        taken = [self._free.popitem(last=False)[1] for _ in range(num_blocks)]
        for b in taken:
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
        return taken

    def touch(self, blocks):
        for b in blocks:
            self._free.pop(b.block_id, None)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks):
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def cache_full_blocks(self, blocks, block_hashes, num_cached_blocks, num_full_blocks):
        if not self.enable_caching:
            return
        for b, h in zip(blocks[num_cached_blocks:num_full_blocks],
                        block_hashes[num_cached_blocks:num_full_blocks]):
            if b.block_hash is None:
                b.block_hash = h
                self.cached_block_hash_to_block.setdefault(h, []).append(b)

    def reset_prefix_cache(self):
        if len(self._free) != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True


@pytest.mark.slow
def test_block_pool_check_passes_an_ordered_dict_pool(capsys):
    checks.check_block_pool(_OrderedDictPool)
    assert "Exercise 6.2 passed" in capsys.readouterr().out


class _ForwardFree(_OrderedDictPool):
    def free_blocks(self, ordered_blocks):  # "the request's blocks in their order"
        super().free_blocks(list(ordered_blocks)[::-1])


class _NoEviction(_OrderedDictPool):
    def _evict(self, block):
        pass


class _TouchKeepsQueued(_OrderedDictPool):
    def touch(self, blocks):
        for block in blocks:
            block.ref_cnt += 1


class _NewestFirst(_OrderedDictPool):
    def get_new_blocks(self, num_blocks):  # a stack: the most recently freed block first
        taken = [self._free.popitem(last=True)[1] for _ in range(num_blocks)]
        for b in taken:
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
        return taken


class _FreesSharedBlocks(_OrderedDictPool):
    def free_blocks(self, ordered_blocks):  # queues a block even when another request holds it
        for block in ordered_blocks:
            block.ref_cnt -= 1
            self._free[block.block_id] = block


@pytest.mark.parametrize("pool_cls, fragments", [
    (_ForwardFree, ["returned blocks [5]; expected [3]", "in the order free_blocks put them there"]),
    (_NoEviction, ["old hash survived", "evict it"]),
    (_TouchKeepsQueued, ["take it out of the free queue"]),
    (_NewestFirst, ["in the order free_blocks put them there"]),
    (_FreesSharedBlocks, ["random workload", "while other requests still hold them"]),
])
def test_block_pool_mistakes_fail_naming_them(pool_cls, fragments):
    fails(checks.check_block_pool, pool_cls, "Exercise 6.2", *fragments)


def _busy_sim():
    """A simulated engine mid-run: requests sharing a prefix, some finished (cached-free blocks)."""
    from minivllm.config import SchedulerConfig
    from minivllm.sim.engine import SimEngine

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48)
    sim = SimEngine(14, 4, scheduler_config=cfg)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    sim.add_request("done", prefix + [9, 9, 9, 9, 9], 1)
    sim.step()
    sim.step()
    for i in range(2):
        sim.add_request(f"r{i}", prefix + [20 + i] * 5, 6, arrival_time=sim.clock)
    sim.step()
    return sim


def _held(sim):
    manager = sim.kv_cache_manager
    return manager.get_blocks("r0")


def _corrupt_ref_cnt(sim):
    _held(sim)[0].ref_cnt += 1


def _corrupt_map(sim):
    pool = sim.kv_cache_manager.block_pool
    h = _held(sim)[0].block_hash
    pool.cached_block_hash_to_block[h] = {_held(sim)[-1].block_id: _held(sim)[-1]}


def _corrupt_stale_hash(sim):
    pool = sim.kv_cache_manager.block_pool
    block = _held(sim)[1]
    del pool.cached_block_hash_to_block[block.block_hash]
    block.block_hash = b"x" * 32
    pool.cached_block_hash_to_block[block.block_hash] = {block.block_id: block}


def _corrupt_free_and_held(sim):
    sim.kv_cache_manager.block_pool.free_block_queue.append(_held(sim)[-1])


@pytest.mark.parametrize("corrupt, fragment", [
    (_corrupt_ref_cnt, "live requests hold it"),
    (_corrupt_map, "the hash map sends"),
    (_corrupt_stale_hash, "(a stale hash)"),
    (_corrupt_free_and_held, "both in the free queue and referenced"),
])
def test_kv_cache_invariants_name_what_is_broken(corrupt, fragment):
    from minivllm.testing import kv_cache_violations

    sim = _busy_sim()
    assert kv_cache_violations(sim.scheduler) == []
    assert sim.kv_cache_manager.block_pool.get_num_cached_free_blocks() > 0  # a realistic state
    corrupt(sim)
    problems = kv_cache_violations(sim.scheduler)
    assert any(fragment in p for p in problems), problems


def test_block_hash_chain_that_returns_nothing_fails():
    def returns_none(request, block_size):
        _chain(_blake2_block)(request, block_size)

    fails(checks.check_block_hashes, _blake2_block, "returned None instead of request.block_hashes",
          update_block_hashes=returns_none)


# -- 11.2 an engine of the learner's own components ------------------------------------------------

def test_an_engine_of_the_package_components_is_refused():
    for classes in ((Sampler, _V1, _OrderedDictPool), (_variant(), Scheduler, _OrderedDictPool),
                    (_variant(), _V1, type("Pool", (BlockPool,), {}))):
        fails(checks.check_own_engine, *classes[:1], "Exercise 11.2",
              "the package's own answer", error=checks.Delegated,
              scheduler_cls=classes[1], block_pool_cls=classes[2])


@pytest.mark.slow
def test_an_engine_with_a_shared_generator_sampler_fails_on_the_seeded_request():
    """(That an engine of correct components passes, solutions/11 shows under nbval.)"""
    fails(checks.check_own_engine, _variant(use_own_generators=False), "Exercise 11.2",
          "the seeded request", scheduler_cls=_V1, block_pool_cls=_OrderedDictPool)
