"""The workloads that ``minivllm bench``, the simulated engine and the course run, each stated
once: how many requests, how long their prompts and outputs are, when they arrive, and their
token ids (seeded).

* ``LongPromptAmongChats``: chats decoding when one long prompt arrives (what chunked prefill is
  for). ``LONG_PROMPT_CPU`` is ``bench long-prompt``'s default; ``LONG_PROMPT_GPU`` the
  simulated engine's production-scale one (``bench sim``, chapters 04-05).
* ``SharedPrefix``: requests that share one system prompt (what prefix caching is for).
  ``SHARED_PREFIX_CPU`` is ``bench shared-prefix``'s default; ``SHARED_PREFIX_GPU`` the
  simulated engine's (``bench sim``, chapter 06).
* ``chat_and_documents``: chats and now and then a long document, arriving as a Poisson process
  (``ServingWorkload``), for a simulated serving run at a request rate (chapter 11's goodput).

A workload says what arrives, not who serves it: ``benchmarks/long_prompt.py`` and
``benchmarks/shared_prefix.py`` run these on an engine, ``sim/scenarios.py`` on the simulated
engine. Nothing here imports torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# the token ids prompts are drawn from: ordinary tokens of any of the course's vocabularies,
# clear of the low ids where special tokens live
VOCAB = range(100, 30000)


@dataclass(frozen=True)
class LongPromptAmongChats:
    """``num_chats`` chats of ``chat_prompt_len``-token prompts decode; then one
    ``long_prompt_len``-token prompt arrives and asks for ``long_output_len`` tokens.

    It arrives once every chat has ``steady_steps`` output tokens (a run on an engine counts
    steps), or, with ``arrival_s``, at that many (simulated) seconds. The chats ask for
    ``chat_output_len`` tokens each; ``None``: as many as ``max_model_len`` leaves them (they
    keep decoding however long the window lasts)."""

    num_chats: int = 16
    chat_prompt_len: int = 48
    long_prompt_len: int = 2048
    steady_steps: int = 20
    chat_output_len: int | None = None
    long_output_len: int = 2
    arrival_s: float | None = None
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        """The longest request, with 64 tokens to spare."""
        return max(self.long_prompt_len, self.chat_prompt_len + (self.chat_output_len or 0)) + 64

    @property
    def chat_max_tokens(self) -> int:
        if self.chat_output_len is not None:
            return self.chat_output_len
        return self.max_model_len - self.chat_prompt_len

    def chat_ids(self) -> list[str]:
        return [f"chat-{i}" for i in range(self.num_chats)]

    def prompts(self) -> tuple[list[list[int]], list[int]]:
        """(the chats' prompts, the long prompt): token ids drawn from ``VOCAB`` with ``seed``;
        a chat's prompt has no repeated token."""
        rng = random.Random(self.seed)
        vocab = list(VOCAB)
        chats = [rng.sample(vocab, self.chat_prompt_len) for _ in range(self.num_chats)]
        return chats, [rng.choice(vocab) for _ in range(self.long_prompt_len)]


@dataclass(frozen=True)
class SharedPrefix:
    """``num_requests`` prompts, each one ``prefix_len``-token prefix (a system prompt) followed
    by ``suffix_len`` tokens of its own; ``output_len`` output tokens each.

    Request 0 arrives at 0; the others ``first_alone_s`` later, spread evenly over
    ``spread_s`` (both 0: all at once)."""

    num_requests: int = 64
    prefix_len: int = 1024
    suffix_len: int = 24
    output_len: int = 8
    first_alone_s: float = 0.0
    spread_s: float = 0.0
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len

    def prompts(self) -> list[list[int]]:
        """Token ids drawn from ``VOCAB`` with ``seed``: the prefix, then each suffix."""
        rng = random.Random(self.seed)
        vocab = list(VOCAB)
        prefix = [rng.choice(vocab) for _ in range(self.prefix_len)]
        return [prefix + [rng.choice(vocab) for _ in range(self.suffix_len)]
                for _ in range(self.num_requests)]

    def arrival_times(self) -> list[float]:
        n = self.num_requests
        return [0.0] + [self.first_alone_s + self.spread_s * i / n for i in range(1, n)]


# bench long-prompt's default: small enough for a CPU (a few hundred steps of a 135M model)
LONG_PROMPT_CPU = LongPromptAmongChats()
# production scale on the simulated engine: 64 chats of 512 tokens decoding 600 each when a
# 16k-token prompt arrives after 3 s (the initial prefills long done)
LONG_PROMPT_GPU = LongPromptAmongChats(num_chats=64, chat_prompt_len=512, long_prompt_len=16384,
                                       steady_steps=0, chat_output_len=600, long_output_len=16,
                                       arrival_s=3.0)
# bench shared-prefix's default: 64 requests arriving together, sharing a 1024-token prefix
SHARED_PREFIX_CPU = SharedPrefix()
# production scale on the simulated engine: 1000 sessions sharing a 30k-token system prompt;
# the first computes it alone, the others arrive from 5 s on, over 10 s
SHARED_PREFIX_GPU = SharedPrefix(num_requests=1000, prefix_len=30000, suffix_len=200,
                                 output_len=100, first_alone_s=5.0, spread_s=10.0)


@dataclass(frozen=True)
class ServingWorkload:
    """Requests as (prompt tokens, output tokens), in arrival order, and the gaps between their
    arrivals at one request per second (exponential: a Poisson process; at rate r each gap is
    divided by r, so every rate sees the same requests in the same pattern)."""

    requests: tuple[tuple[int, int], ...]
    unit_gaps: tuple[float, ...]
    description: str

    @property
    def max_model_len(self) -> int:
        return max(p + o for p, o in self.requests) + 16


def chat_and_documents(num_requests: int = 48, seed: int = 0, document_fraction: float = 1 / 8,
                       chat_prompt: tuple[int, int] = (100, 1000),
                       document_prompt: tuple[int, int] = (3000, 6000),
                       output: tuple[int, int] = (8, 32)) -> ServingWorkload:
    """Chats (short prompts) and, now and then, a document to summarise (a long prompt); short
    answers. Lengths uniform in the given ranges, seeded."""
    rng = random.Random(seed)
    requests, gaps = [], []
    for _ in range(num_requests):
        long = rng.random() < document_fraction
        prompt = rng.randint(*(document_prompt if long else chat_prompt))
        requests.append((prompt, rng.randint(*output)))
        gaps.append(rng.expovariate(1.0))
    desc = (f"{num_requests} requests: chats of {chat_prompt[0]}-{chat_prompt[1]} prompt tokens, "
            f"about 1 in {round(1 / document_fraction)} a document of {document_prompt[0]}-"
            f"{document_prompt[1]}; {output[0]}-{output[1]} output tokens each")
    return ServingWorkload(tuple(requests), tuple(gaps), desc)
