"""Sampling: seeds reproduce whatever the batch; top-k / top-p restrict the support; the
sampled frequencies follow the (tempered, truncated) softmax."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.sample.sampler import Sampler, SamplingMetadata


@pytest.fixture(params=["c", "torch"])
def race_path(request, monkeypatch):
    """The sampler tests twice: the C++ race (``race_sample``, a CPU's default) and the torch
    one (``exponential_race``, a GPU's, and a CPU's with ``MINIVLLM_CPU_KERNELS=torch``)."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", request.param)
    return request.param


def _sample(logits_row, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    logits = logits_row.repeat(n, 1)
    meta = SamplingMetadata(
        temperature=torch.full((n,), temperature),
        all_greedy=False,
        top_k=torch.full((n,), top_k, dtype=torch.long) if top_k else None,
        top_p=torch.full((n,), top_p) if top_p < 1 else None,
        generator=torch.Generator().manual_seed(seed),
    )
    return Sampler()(logits, meta)


def _chi_square_ok(samples, probs):
    """Pearson chi-square against the expected distribution, at a 1e-4 significance level."""
    n = samples.numel()
    support = (probs > 0).nonzero().flatten()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    stat = (((counts - expected) ** 2) / expected)[support].sum().item()
    dof = len(support) - 1
    # Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4 (z = 3.719)
    crit = dof * (1 - 2 / (9 * dof) + 3.719 * (2 / (9 * dof)) ** 0.5) ** 3
    return stat < crit, stat, crit


LOGITS = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.usefixtures("race_path")
def test_temperature_frequencies_follow_softmax(temperature):
    samples = _sample(LOGITS, 40_000, temperature=temperature)
    ok, stat, crit = _chi_square_ok(samples, torch.softmax(LOGITS / temperature, -1))
    assert ok, (stat, crit)


@pytest.mark.usefixtures("race_path")
def test_top_k_restricts_support_and_renormalises():
    samples = _sample(LOGITS, 40_000, top_k=5)
    top5 = set(LOGITS.topk(5).indices.tolist())
    assert set(samples.tolist()) <= top5
    expected = torch.zeros_like(LOGITS)
    expected[list(top5)] = torch.softmax(LOGITS[list(top5)], -1)
    ok, stat, crit = _chi_square_ok(samples, expected)
    assert ok, (stat, crit)


@pytest.mark.usefixtures("race_path")
def test_top_p_restricts_support_to_nucleus():
    probs = torch.softmax(LOGITS, -1)
    sorted_p, order = probs.sort(descending=True)
    # the nucleus: the fewest most-likely tokens whose mass reaches p
    k = int((sorted_p.cumsum(0) < 0.6).sum()) + 1
    nucleus = order[:k]
    samples = _sample(LOGITS, 40_000, top_p=0.6)
    assert set(samples.tolist()) == set(nucleus.tolist())
    expected = torch.zeros_like(probs)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    ok, stat, crit = _chi_square_ok(samples, expected)
    assert ok, (stat, crit)


@pytest.mark.usefixtures("race_path")
def test_top_k_1_is_greedy():
    assert set(_sample(LOGITS, 500, top_k=1).tolist()) == {int(LOGITS.argmax())}


@pytest.mark.usefixtures("race_path")
def test_mixed_rows_greedy_and_random():
    logits = torch.stack([LOGITS, LOGITS])
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0]), all_greedy=False,
                            generator=torch.Generator().manual_seed(0))
    greedy = [Sampler()(logits, meta)[0].item() for _ in range(20)]
    assert set(greedy) == {int(LOGITS.argmax())}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, show_progress=False)


def test_seeded_request_same_tokens_alone_and_in_any_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate("a seeded prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"other prompt number {i}" for i in range(9)]
    batch = llm.generate(
        others[:4] + ["a seeded prompt"] + others[4:],
        [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 4 + [seeded]
        + [SamplingParams(temperature=0.8, max_tokens=10, seed=i, ignore_eos=True) for i in range(5)],
        use_tqdm=False,
    )
    assert batch[4].outputs[0].token_ids == alone
    again = llm.generate("a seeded prompt", seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_different_seeds_differ(llm):
    outs = llm.generate(["same prompt"] * 4, [SamplingParams(temperature=1.0, max_tokens=16, seed=s,
                                                             ignore_eos=True) for s in range(4)],
                        use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_top_k_1_in_engine_equals_greedy(llm):
    g = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0].token_ids
    k1 = llm.generate("hello world", SamplingParams(temperature=1.3, top_k=1, max_tokens=12,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert k1.outputs[0].token_ids == g
