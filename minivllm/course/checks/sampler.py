"""Exercise 2.1: a sampler (``forward(logits, SamplingMetadata) -> ids``), graded by chi-square
tests against softmax(top_k_top_p(logits / T)), greedy rows, per-row generators and the engine."""

from __future__ import annotations

import math

import torch

from minivllm.course.checks.common import (
    ENGINE_PROMPTS, Exercise, check_engine, compare_generations, greedy_token_ids, native_answer,
    reference_token_ids,
)
from minivllm.sample.sampler import SamplingMetadata, apply_top_k_top_p
from minivllm.testing import model_runner

VOCAB, SAMPLES = 24, 6000
Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4: a correct sampler fails 1 run in 10,000
CONVENTION = ("Expected, per row: greedy (argmax) when temperature < 1e-5; otherwise divide the "
              "logits by the temperature, keep the top_k most likely tokens (0 = all), then keep "
              "the smallest set of most likely tokens whose probability reaches top_p (computed on "
              "the top-k-renormalised distribution; 1 = all), and sample from the renormalised "
              "rest.")
# the package's sampler (refused in 2.1 and in 11.2's own engine)
SAMPLER = tuple(f"minivllm.sample.sampler:{name}" for name in (
    "Sampler", "apply_top_k_top_p", "apply_top_k", "exponential_race", "sample_race", "race_keys"))
ANSWER = SAMPLER + ("minivllm.cpu_kernels:library", "minivllm.course.checks.sampler:expected_probs")
ALLOWED = "torch (sort, cumsum, softmax, multinomial with meta.generator / meta.generators[row])"
SETTINGS = [  # (temperature, top_k, top_p), one at a time
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.6), (0.8, 4, 0.6),
]
MIXED = [(0.0, 0, 1.0), (1.0, 3, 1.0), (0.7, 0, 0.5), (1.3, 0, 1.0)]  # interleaved in one batch


def race_answer(answer: tuple[str, ...]) -> tuple[str, ...]:
    """``answer`` and, where the CPU kernels load, their C++ race (``race_sample``)."""
    return native_answer(answer, "race_sample")


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int,
                   top_p: float) -> torch.Tensor:
    """The reference distribution of one row."""
    k = torch.tensor([top_k]) if top_k else None
    p = torch.tensor([top_p]) if top_p < 1 else None
    return apply_top_k_top_p((logits / temperature)[None], k, p).softmax(-1)[0]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic (bins with an expected count < 5 pooled) and its critical value."""
    expected = probs.double() * counts.sum().item()
    big = expected >= 5
    obs, exp = counts[big].double().tolist(), expected[big].tolist()
    small = (probs > 0) & ~big
    if small.any():
        obs.append(counts[small].sum().item())
        exp.append(expected[small].sum().item())
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = max(len(exp) - 1, 1)  # the critical value by Wilson-Hilferty's approximation
    return stat, dof * (1 - 2 / (9 * dof) + Z_1E4 * math.sqrt(2 / (9 * dof))) ** 3


def _meta(settings, seed=0, generators=None) -> SamplingMetadata:
    """Metadata of one row per (temperature, top_k, top_p); no top_k / top_p if none uses it."""
    temps, ks, ps = (list(c) for c in zip(*settings))
    temps = torch.tensor(temps, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temps, all_greedy=bool((temps < 1e-5).all()),
        top_k=torch.tensor(ks, dtype=torch.long) if any(ks) else None,
        top_p=torch.tensor(ps, dtype=torch.float32) if min(ps) < 1 else None,
        generators=generators or {}, generator=torch.Generator().manual_seed(seed))


def _sample(ex, sampler, logits, meta, what) -> torch.Tensor:
    """The sampler's ids for ``logits``, failing unless they are one valid token id per row."""
    out = sampler(logits.clone(), meta)
    rows, vocab = logits.shape
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows,):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        ex.fail(f"{what}: expected a tensor of {rows} token ids (one per row), got {shape}")
    if out.dtype not in (torch.int64, torch.int32):
        ex.fail(f"{what}: expected integer token ids, got dtype {out.dtype}")
    if ((out < 0) | (out >= vocab)).any():
        ex.fail(f"{what}: token ids must lie in [0, {vocab}), got {out.min()}..{out.max()}")
    return out.long()


def _check_rows(ex, tokens, row, temperature, top_k, top_p, what) -> None:
    """``tokens``, drawn from ``row``'s logits: all argmax if greedy, else the expected law."""
    if temperature == 0.0:
        if not (tokens == row.argmax()).all():
            ex.fail(f"{what} must all be argmax.")
        return
    probs = expected_probs(row, temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=VOCAB)
    n = int(counts.sum())
    if (outside := ((probs == 0) & (counts > 0)).nonzero()).numel():
        t = int(outside[0])
        ex.fail(f"{what}: drew token {t} (the {int((row > row[t]).sum()) + 1}th most likely) "
                f"{int(counts[t])} times, but it has probability 0 under these parameters.")
    if (never := ((probs * n >= 30) & (counts == 0)).nonzero()).numel():
        t = int(never[0])
        ex.fail(f"{what}: never drew token {t} in {n} draws, though it has probability "
                f"{probs[t]:.3f} under these parameters.")
    stat, crit = chi_square(counts, probs)
    if stat > crit:
        emp = counts.double() / n
        worst = int(((emp - probs.double()).abs()).argmax())
        ex.fail(f"{what}: over {n} draws token {worst} came out with frequency {emp[worst]:.3f}, "
                f"expected probability {probs[worst]:.3f} (chi-square {stat:.0f} > {crit:.0f}: "
                "not the expected distribution).")


def _order_matters(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> bool:
    """Would applying top-p before top-k keep a different set of tokens for this row?"""
    if not (top_k and top_p < 1):
        return True
    k_first = expected_probs(row, temperature, top_k, top_p) > 0
    p_first = expected_probs(row, temperature, 0, top_p) > 0
    p_first &= row >= row[p_first].topk(min(top_k, int(p_first.sum()))).values[-1]
    return not torch.equal(k_first, p_first)


def check_sampler(sampler_cls, exercise: str = "2.1", seed: int = 0, engine: bool = True) -> None:
    """``sampler_cls()`` must behave like ``minivllm.sample.sampler.Sampler``."""
    ex = Exercise(exercise, CONVENTION, race_answer(ANSWER), ALLOWED)
    sampler_cls = ex.take(sampler_cls, "sampler")
    g = torch.Generator().manual_seed(seed)
    sampler = sampler_cls()
    logits = torch.randn(64, VOCAB, generator=g) * 2
    out = _sample(ex, sampler, logits, _meta([(0.0, 0, 1.0)] * 64, seed), "all rows greedy")
    if not torch.equal(out, logits.argmax(-1)):
        ex.fail("with temperature 0 every row must return argmax(logits) exactly.")
    for i, (t, k, p) in enumerate(SETTINGS):  # many rows of the same logits
        for _ in range(1000):  # a row where the order of top-k and top-p matters, so it is tested
            row = torch.randn(VOCAB, generator=g) * 1.5
            if _order_matters(row, t, k, p):
                break
        what = f"temperature={t}, top_k={k}, top_p={p}"
        out = _sample(ex, sampler, row.repeat(SAMPLES, 1), _meta([(t, k, p)] * SAMPLES, seed + i),
                      what)
        _check_rows(ex, out, row, t, k, p, what)
    rows = [torch.randn(VOCAB, generator=g) * 1.5 for _ in MIXED]
    order = torch.arange(len(MIXED)).repeat(SAMPLES // 2)
    meta = _meta([MIXED[j] for j in order.tolist()], seed + 100)
    out = _sample(ex, sampler, torch.stack(rows)[order], meta, "a batch mixing four settings")
    for j, (t, k, p) in enumerate(MIXED):
        _check_rows(ex, out[order == j], rows[j], t, k, p, "in a batch mixing four settings, the "
                    f"rows with temperature={t}, top_k={k}, top_p={p}")
    for trial in range(40):  # a seeded row draws the same token whatever else is in the batch
        row, a, b = (torch.randn(n, VOCAB, generator=g) for n in (1, 6, 9))
        a[1], b[5] = row[0], row[0]
        drawn = []
        for x, i, shift in ((a, 1, 0), (b, 5, 7)):
            meta = _meta([(1.0, 0, 1.0)] * len(x), trial + shift,
                         {i: torch.Generator().manual_seed(1000 + trial)})
            drawn.append(_sample(ex, sampler, x, meta, "a batch with a seeded row")[i])
        if drawn[0] != drawn[1]:
            ex.fail(f"a row with its own generator (meta.generators[row]) must draw its randomness "
                    f"from that generator only, so a seeded request samples the same token "
                    f"whatever shares its batch: the same seeded row drew token {int(drawn[0])} "
                    f"as row 1 of a 6-row batch and {int(drawn[1])} as row 5 of a 9-row batch.")
    if engine:
        _check_in_engine(ex, sampler_cls)
    ex.passed(f"{sampler_cls.__name__} samples the expected distributions ({len(SETTINGS)} "
              "settings and a mixed batch, chi-square tests), is exact when greedy, reproducible "
              "with per-request seeds, and generates the reference text in the engine.")


def _check_in_engine(ex, sampler_cls) -> None:
    from minivllm import SamplingParams

    llm = check_engine()
    runner, expected = model_runner(llm), reference_token_ids()  # before the swap
    reference, runner.sampler = runner.sampler, sampler_cls()
    try:
        compare_generations(ex.number, f"with {sampler_cls.__name__}", llm, ENGINE_PROMPTS,
                            greedy_token_ids(llm, ENGINE_PROMPTS), expected)
        seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234,
                                ignore_eos=True)
        alone = llm.generate(ENGINE_PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
        others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        in_batch = llm.generate([ENGINE_PROMPTS[2], ENGINE_PROMPTS[0], ENGINE_PROMPTS[3]],
                                [others, seeded, others], use_tqdm=False)[1].outputs[0].token_ids
        if in_batch != alone:
            tok = llm.get_tokenizer()
            ex.fail(f"in the engine, a request with seed=1234 generated {tok.decode(alone)!r} "
                    f"alone but {tok.decode(in_batch)!r} in a batch with other requests: a "
                    "seeded row must use only its own generator (meta.generators[row]).")
    finally:
        runner.sampler = reference
        llm.llm_engine.reset_prefix_cache()
