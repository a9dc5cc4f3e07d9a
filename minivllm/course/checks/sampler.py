"""Checker for chapter 02's exercise: a sampler (``forward(logits, SamplingMetadata) -> ids``).

Statistical: for each setting, thousands of draws against softmax(top_k_top_p(logits / T)) by
a chi-square test, tokens outside the support never; then greedy rows exact, per-row
parameters, per-row generators reproducible whatever shares the batch, and the real engine.
"""

from __future__ import annotations

import math

import torch

from minivllm.course.checks.common import (
    ENGINE_PROMPTS, Exercise, check_engine, compare_generations, fail, greedy_token_ids, passed,
)
from minivllm.sample.sampler import SamplingMetadata, apply_top_k_top_p
from minivllm.testing import model_runner

VOCAB = 24
SAMPLES = 6000
Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4: a correct sampler fails 1 run in 10,000

CONVENTION = ("Expected, per row: greedy (argmax) when temperature < 1e-5; otherwise divide the "
              "logits by the temperature, keep the top_k most likely tokens (0 = all), then keep the "
              "smallest set of most likely tokens whose probability reaches top_p (computed on the "
              "top-k-renormalised distribution; 1 = all), and sample from the renormalised rest.")


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The reference distribution of one row."""
    k = torch.tensor([top_k]) if top_k else None
    p = torch.tensor([top_p]) if top_p < 1 else None
    return apply_top_k_top_p((logits / temperature)[None], k, p).softmax(-1)[0]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic (bins with an expected count < 5 pooled) and its critical value."""
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= 5
    obs = counts[big].double().tolist()
    exp = expected[big].tolist()
    small = (probs > 0) & ~big
    if small.any():
        obs.append(counts[small].sum().item())
        exp.append(expected[small].sum().item())
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = max(len(exp) - 1, 1)
    # Wilson-Hilferty approximation of the chi-square quantile
    crit = dof * (1 - 2 / (9 * dof) + Z_1E4 * math.sqrt(2 / (9 * dof))) ** 3
    return stat, crit


def _meta(temps, top_ks=None, top_ps=None, seed=0, generators=None) -> SamplingMetadata:
    temps = torch.tensor(temps, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temps,
        all_greedy=bool((temps < 1e-5).all()),
        top_k=None if top_ks is None else torch.tensor(top_ks, dtype=torch.long),
        top_p=None if top_ps is None else torch.tensor(top_ps, dtype=torch.float32),
        generators=generators or {},
        generator=torch.Generator().manual_seed(seed),
    )


def _call(exercise, sampler, logits, meta, what) -> torch.Tensor:
    out = sampler(logits.clone(), meta)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (logits.shape[0],):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        fail(exercise, f"{what}: expected a tensor of {logits.shape[0]} token ids (one per row), "
                       f"got {shape}")
    if out.dtype not in (torch.int64, torch.int32):
        fail(exercise, f"{what}: expected integer token ids, got dtype {out.dtype}")
    if ((out < 0) | (out >= logits.shape[1])).any():
        fail(exercise, f"{what}: token ids must lie in [0, {logits.shape[1]}), "
                       f"got {out.min()}..{out.max()}")
    return out.long()


def _check_distribution(exercise, tokens, logits_row, temperature, top_k, top_p, what) -> None:
    probs = expected_probs(logits_row, temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=VOCAB)
    outside = ((probs == 0) & (counts > 0)).nonzero().flatten().tolist()
    if outside:
        t = outside[0]
        rank = int((logits_row > logits_row[t]).sum()) + 1
        fail(exercise, f"{what}: drew token {t} (the {rank}th most likely) {int(counts[t])} times, "
                       f"but it has probability 0 under these parameters. {CONVENTION}")
    never = ((probs * counts.sum() >= 30) & (counts == 0)).nonzero().flatten().tolist()
    if never:
        t = never[0]
        fail(exercise, f"{what}: never drew token {t} in {int(counts.sum())} draws, though it has "
                       f"probability {probs[t]:.3f} under these parameters. {CONVENTION}")
    stat, crit = chi_square(counts, probs)
    if stat > crit:
        emp = counts.double() / counts.sum()
        worst = int(((emp - probs.double()).abs()).argmax())
        fail(exercise, f"{what}: over {int(counts.sum())} draws token {worst} came out with frequency "
                       f"{emp[worst]:.3f}, expected probability {probs[worst]:.3f} (chi-square "
                       f"{stat:.0f} > {crit:.0f}: not the expected distribution). {CONVENTION}")


ANSWER = ("minivllm.sample.sampler:Sampler", "minivllm.sample.sampler:apply_top_k_top_p",
          "minivllm.sample.sampler:apply_top_k", "minivllm.sample.sampler:exponential_race",
          "minivllm.course.checks.sampler:expected_probs")
ALLOWED = "torch (sort, cumsum, softmax, multinomial with meta.generator / meta.generators[row])"

SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.6), (0.8, 4, 0.6),
]


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
    sampler_cls = Exercise(exercise, answer=ANSWER, allowed=ALLOWED).take(sampler_cls, "sampler")
    g = torch.Generator().manual_seed(seed)
    sampler = sampler_cls()

    # greedy rows are exact
    logits = torch.randn(64, VOCAB, generator=g) * 2
    out = _call(exercise, sampler, logits, _meta([0.0] * 64, seed=seed), "all rows greedy")
    if not torch.equal(out, logits.argmax(-1)):
        fail(exercise, "with temperature 0 every row must return argmax(logits) exactly. " + CONVENTION)

    # one setting at a time, many rows of the same logits
    for i, (t, k, p) in enumerate(SETTINGS):
        for _ in range(1000):  # a row where the order of top-k and top-p matters, so it is tested
            row = torch.randn(VOCAB, generator=g) * 1.5
            if _order_matters(row, t, k, p):
                break
        meta = _meta([t] * SAMPLES, [k] * SAMPLES if k else None, [p] * SAMPLES if p < 1 else None,
                     seed=seed + i)
        what = f"temperature={t}, top_k={k}, top_p={p}"
        out = _call(exercise, sampler, row.repeat(SAMPLES, 1), meta, what)
        _check_distribution(exercise, out, row, t, k, p, what)

    # a mixed batch: each row follows its own parameters
    kinds = [(0.0, 0, 1.0), (1.0, 3, 1.0), (0.7, 0, 0.5), (1.3, 0, 1.0)]
    rows = [torch.randn(VOCAB, generator=g) * 1.5 for _ in kinds]
    n = SAMPLES // 2
    order = torch.arange(len(kinds)).repeat(n)  # rows of the four kinds interleaved
    logits = torch.stack([rows[j] for j in order.tolist()])
    meta = _meta([kinds[j][0] for j in order.tolist()], [kinds[j][1] for j in order.tolist()],
                 [kinds[j][2] for j in order.tolist()], seed=seed + 100)
    out = _call(exercise, sampler, logits, meta, "a batch mixing four settings")
    for j, (t, k, p) in enumerate(kinds):
        mine = out[order == j]
        what = f"in a batch mixing four settings, the rows with temperature={t}, top_k={k}, top_p={p}"
        if t == 0.0:
            if not (mine == rows[j].argmax()).all():
                fail(exercise, f"{what} must all be argmax. {CONVENTION}")
        else:
            _check_distribution(exercise, mine, rows[j], t, k, p, what)

    # a row with its own generator samples the same token whatever else is in the batch
    for trial in range(40):
        row = torch.randn(VOCAB, generator=g)
        a = torch.randn(6, VOCAB, generator=g)
        a[1] = row
        b = torch.randn(9, VOCAB, generator=g)
        b[5] = row
        ta = _call(exercise, sampler, a, _meta([1.0] * 6, seed=trial, generators={
            1: torch.Generator().manual_seed(1000 + trial)}), "a batch with a seeded row")[1]
        tb = _call(exercise, sampler, b, _meta([1.0] * 9, seed=trial + 7, generators={
            5: torch.Generator().manual_seed(1000 + trial)}), "a batch with a seeded row")[5]
        if ta != tb:
            fail(exercise, f"a row with its own generator (meta.generators[row]) must draw its "
                           f"randomness from that generator only, so a seeded request samples the same "
                           f"token whatever shares its batch: the same seeded row drew token "
                           f"{int(ta)} as row 1 of a 6-row batch and {int(tb)} as row 5 of a 9-row "
                           "batch.")

    if engine:
        _check_in_engine(exercise, sampler_cls)
    passed(exercise, f"{sampler_cls.__name__} samples the expected distributions ({len(SETTINGS)} "
                     "settings and a mixed batch, chi-square tests), is exact when greedy, "
                     "reproducible with per-request seeds, and generates the reference text in the "
                     "engine.")


def _check_in_engine(exercise: str, sampler_cls) -> None:
    from minivllm import SamplingParams

    llm = check_engine()
    runner = model_runner(llm)
    expected = greedy_token_ids(llm, ENGINE_PROMPTS)
    reference = runner.sampler
    runner.sampler = sampler_cls()
    try:
        got = greedy_token_ids(llm, ENGINE_PROMPTS)
        compare_generations(exercise, f"with {sampler_cls.__name__}", llm, ENGINE_PROMPTS, got, expected)
        seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
        alone = llm.generate(ENGINE_PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
        others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        in_batch = llm.generate([ENGINE_PROMPTS[2], ENGINE_PROMPTS[0], ENGINE_PROMPTS[3]],
                                [others, seeded, others], use_tqdm=False)[1].outputs[0].token_ids
        if in_batch != alone:
            tok = llm.get_tokenizer()
            fail(exercise, f"in the engine, a request with seed=1234 generated {tok.decode(alone)!r} "
                           f"alone but {tok.decode(in_batch)!r} in a batch with other requests: a "
                           "seeded row must use only its own generator (meta.generators[row]).")
    finally:
        runner.sampler = reference
        llm.llm_engine.reset_prefix_cache()
