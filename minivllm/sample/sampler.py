"""From logits to next tokens: greedy, temperature, top-k, top-p, per-request seeds.

Every row of the batch may have its own parameters, so everything is done with per-row
tensors, no Python loop over requests (except to draw seeded noise, below).

Sampling uses the "exponential race": draw q ~ Exp(1) per token and take argmax(p / q). The
winner is distributed exactly as p (chapter 02 proves it), and the noise q can come from a
request's *own* ``torch.Generator`` — so a request with a seed gets the same tokens whatever
else shares its batch. ``exponential_race`` is the race in torch; on a CPU ``sample_race`` runs
it in C++ instead, the noise made from one key per row (drawn from the same generators).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from minivllm import cpu_kernels

_EPS = 1e-5


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [rows] float32; < 1e-5 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [rows] int64, 0 = off; None: no row uses it
    max_top_k: int | None = None  # the largest top_k, known on the host (spares a device sync)
    top_p: torch.Tensor | None = None  # [rows] float32, 1 = off; None: no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded RNG
    generator: torch.Generator | None = None  # for rows without a seed


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (0 = all), without sorting the vocabulary:
    ``topk`` of the largest k asked for gives every row's k-th largest value, its threshold."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    if max_k is None:  # read back from the device: two host syncs
        max_k = int(k[top_k > 0].max()) if bool((top_k > 0).any()) else vocab
    max_k = min(max_k, vocab)
    values = logits.topk(max_k, dim=-1).values  # [rows, max_k], descending
    threshold = values.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))
    threshold = torch.where((top_k > 0).unsqueeze(1), threshold, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. Top-p needs the whole sorted
    distribution (one sort, which then serves top-k too); top-k alone does not."""
    if top_p is None:
        return logits if top_k is None else apply_top_k(logits, top_k, max_top_k)
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - top_p).unsqueeze(1)  # the unlikely tail, mass <= 1 - p
    outside[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Each row's winner of argmax(p / q), q ~ Exp(1) per token, drawn as q = -log(u) with u
    uniform in [0, 1): on a CPU, ``uniform_`` then ``log_`` took 2.7 ms for 16 rows of
    SmolLM2's 49,152 tokens where ``exponential_`` took 14.9 ms (torch 2.13, 2 threads), a
    quarter of a decode step. u = 0 gives q = inf: that token cannot win."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.uniform_(generator=generator)
    for row, gen in generators.items():
        q[row].uniform_(generator=gen)
    q.log_().neg_()  # > 0: u < 1, so no 0/0 for masked tokens
    return probs.div(q).argmax(dim=-1)


def race_keys(rows: int, generators: dict[int, torch.Generator],
              generator: torch.Generator | None = None) -> torch.Tensor:
    """One random 64-bit key per row, drawn from the row's own generator where it has one (one
    draw per step, whatever else is in the batch), else from ``generator``."""
    keys = torch.empty(rows, dtype=torch.int64)
    if len(generators) < rows:
        keys.random_(generator=generator)
    for row, gen in generators.items():
        keys[row : row + 1].random_(generator=gen)
    return keys


def sample_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The exponential race's winners: on a CPU in float32, minivllm's C++ kernel
    (``race_sample`` in ``cpu_kernels.cpp``: each row's noise from a hash of its key and the
    token's index, made where it is used, in one pass over the row: 0.7-0.9 ms for 16 rows of
    49,152 tokens where ``exponential_race``'s uniform_, log_, division and argmax took 6.3-7.1
    ms, 2 threads, one after the other in one process on a busy machine); elsewhere
    ``exponential_race``. Both draw q ~ Exp(1) from the rows' generators, so a seeded request
    samples the same tokens in any batch; they draw different tokens for the same seed."""
    ops = cpu_kernels.library() if cpu_kernels.race_fits(probs) else None
    if ops is None:
        return exponential_race(probs, generators, generator)
    return ops.race_sample(probs, race_keys(probs.shape[0], generators, generator))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits.float()
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        is_greedy = meta.temperature < _EPS
        temperature = torch.where(is_greedy, 1.0, meta.temperature)
        greedy = logits.argmax(dim=-1) if not logits.is_cpu or bool(is_greedy.any()) else None
        logits = apply_top_k_top_p(logits / temperature.unsqueeze(1), meta.top_k, meta.top_p,
                                   meta.max_top_k)
        sampled = sample_race(logits.softmax(dim=-1), meta.generators, meta.generator)
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)
