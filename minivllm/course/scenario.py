"""Chapters 04 and 05's workload (16 chats decoding when one long prompt arrives: one
scenario, so v0's stall and v1's chunked prefill compare side by side) and chapter 06's (a
museum help desk: one long system prompt, twelve questions)."""

from __future__ import annotations

# 16 chats of 16-token prompts decoding; a 512-token prompt arrives after 3 steps; 3 more
# steps of decodes after its first token
SCENARIO = dict(num_chats=16, chat_prompt_len=16, long_prompt_len=512, steady_steps=3,
                extra_steps=3)
V0 = dict(scheduler="v0", max_num_batched_tokens=2048)  # v0: a whole prompt in one step


def v1(chunk: int) -> dict:
    """v1 with v0's step budget and prefill chunks of at most ``chunk`` tokens."""
    return dict(scheduler="v1", long_prefill_token_threshold=chunk, max_num_batched_tokens=2048)


def chat_gaps(result: dict) -> list[float]:
    """The gaps (seconds) between consecutive tokens of every chat, once all chats decode."""
    chats = {rid: t for rid, t in result["token_times"].items() if rid.startswith("chat")}
    since = max(t[0] for t in chats.values())
    return [b - a for t in chats.values() for a, b in zip(t, t[1:]) if a >= since]


def describe(step: dict) -> str:
    """One step of the trace in words: how many decodes, which prefill chunks."""
    decodes = sum(1 for _, _, kind in step["scheduled"] if kind == "decode")
    prefills = [f"{rid} ({n} tokens)" for rid, n, kind in step["scheduled"] if kind == "prefill"]
    return f"{decodes:2d} decodes" + (", prefill " + ", ".join(prefills) if prefills else "")


# chapter 06: chats that share one system prompt (what prefix caching is for)
MUSEUM_SYSTEM_PROMPT = (
    "You are the help desk assistant of the City Science Museum. The museum is open from 9:00 "
    "to 17:00, Tuesday to Sunday, and closed on Mondays except on public holidays. Tickets cost "
    "14 euros for adults and 9 euros for students and seniors; children under 12 enter free. "
    "Planetarium shows start every hour on the hour and need a separate 5 euro ticket, sold at "
    "the entrance. The cafe on the ground floor serves lunch from 11:30 to 14:30. Lockers are "
    "free: they take a 1 euro coin that you get back. Strollers and wheelchairs are welcome on "
    "every floor, and the lifts are next to the main stairs. Photos without flash are allowed "
    "everywhere except in the special exhibition. Answer in one or two short, friendly "
    "sentences and never invent facts that are not written here."
)
MUSEUM_QUESTIONS = [
    "When does the museum open on Saturday?", "How much is a ticket for a student?",
    "Is the museum open on Mondays?", "Can my six-year-old daughter come in for free?",
    "Do I need a separate ticket for the planetarium?",
    "When does the next planetarium show start?", "Where can I have lunch?",
    "Are the lockers free?", "Can I bring a stroller?", "Is there a lift for wheelchairs?",
    "May I take photos?", "Can I use a flash in the special exhibition?",
]
