"""``minivllm bench soak``: a long run of mixed traffic that shows whether anything grows.

A multi-process ``minivllm serve`` (a tiny random-weight model by default, so the steps are
fast and the HTTP side, the front end and the core's bookkeeping are what is exercised) gets
``--num-requests`` requests, ``--concurrency`` at a time, each drawn from a mix:

* ``stream``      a streamed completion or chat, read to ``data: [DONE]``;
* ``full``        a non-streamed one, read whole;
* ``disconnect``  a stream the client walks away from after a chunk or two;
* ``abort``       a non-streamed request whose client gives up before the answer;
* ``invalid``     a request the server must refuse with a 4xx (bad JSON, out-of-range
                  fields, an unknown model, ...).

Resident memory (RSS) of the server's process and of the engine core's process is read after
the warm-up requests and at the end; the run passes when every valid request was answered, no
request got an unexpected status, and no KV block is in use once the traffic stops. The
figures are printed as JSON (``--json`` writes them to a file).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import tempfile
import time

from minivllm.benchmarks.common import ServerProcess, machine_info, write_json

KINDS = ("stream", "full", "disconnect", "abort", "invalid")
DEFAULT_MIX = "stream=30,full=30,disconnect=15,abort=10,invalid=15"
WORDS = ("the cat sat on a mat while quick brown foxes jump over lazy dogs near old river "
         "banks and small boats drift past green hills under a pale sky").split()

# bodies the server must refuse (4xx); each names why
INVALID_BODIES = [
    ("completions", b"{not json"),
    ("completions", {"prompt": "hi", "max_tokens": -1}),
    ("completions", {"prompt": "hi", "temperature": "hot"}),
    ("completions", {"prompt": "hi", "seed": 2**70}),
    ("completions", {"prompt": "hi", "top_k": 2**64}),
    ("completions", {"prompt": "hi", "top_p": 0}),
    ("completions", {"prompt": [10**12]}),
    ("completions", {"prompt": "hi", "n": 3}),
    ("completions", {"prompt": "hi", "stop": ""}),
    ("completions", {"prompt": "hi", "model": "no-such-model"}),
    ("chat/completions", {"messages": []}),
    ("chat/completions", {"messages": [{"role": "user"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}),
]


def add_parser(subparsers, add_engine_args=None) -> None:
    p = subparsers.add_parser(
        "soak", help="mixed traffic against a multi-process server; memory and KV blocks after")
    p.add_argument("--num-requests", type=int, default=20_000)
    p.add_argument("--duration-minutes", type=float, default=None,
                   help="stop sending new requests after this long, even before --num-requests")
    p.add_argument("--warmup-requests", type=int, default=500,
                   help="requests before the first memory reading")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--mix", default=DEFAULT_MIX, help=f"weights of {', '.join(KINDS)}")
    p.add_argument("--max-tokens", type=int, default=32, help="the most tokens a request asks for")
    p.add_argument("--server-args", default="",
                   help="`minivllm serve` flags (default: a tiny random-weight llama, "
                        "--max-model-len 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=main)


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name.strip() not in KINDS:
            raise ValueError(f"--mix: unknown kind {name.strip()!r}; kinds are {KINDS}")
        mix[name.strip()] = float(weight)
    if not any(mix.values()):
        raise ValueError("--mix: every weight is 0")
    return mix


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def core_pid_of(server_pid: int) -> int | None:
    """The engine core: the server's child started by multiprocessing's spawn."""
    try:
        import psutil
    except ImportError:
        return None
    for child in psutil.Process(server_pid).children():
        if "spawn_main" in " ".join(child.cmdline()):
            return child.pid
    return None


def tiny_model(folder: str) -> str:
    from minivllm.model_hub import bundled_model_path
    from minivllm.testing import make_checkpoint

    return make_checkpoint(folder, "llama", tokenizer_from=bundled_model_path(), seed=0)


class Soak:
    def __init__(self, base_url: str, model: str, rng: random.Random, mix: dict[str, float],
                 max_tokens: int) -> None:
        self.base_url = base_url
        self.model = model
        self.rng = rng
        self.kinds = list(mix)
        self.weights = [mix[k] for k in self.kinds]
        self.max_tokens = max_tokens
        self.outcomes: dict[str, int] = {}
        self.unexpected: list[str] = []  # the first few, for the report

    def _count(self, outcome: str, detail: str | None = None) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if detail is not None and len(self.unexpected) < 10:
            self.unexpected.append(detail)

    def _body(self, chat: bool, stream: bool, max_tokens: int) -> dict:
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 40)))
        body = {"model": self.model, "max_tokens": max_tokens, "stream": stream,
                "temperature": self.rng.choice([0.0, 0.7, 1.0]), "ignore_eos": self.rng.random() < .5}
        if self.rng.random() < 0.3:
            body["seed"] = self.rng.randint(0, 2**32)
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body

    async def one(self, client) -> None:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        chat = self.rng.random() < 0.4
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            if kind == "invalid":
                endpoint, body = self.rng.choice(INVALID_BODIES)
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await client.post(f"/v1/{endpoint}", content=content,
                                      headers={"content-type": "application/json"})
                ok = 400 <= r.status_code < 500 and "error" in r.json()
                self._count("invalid_refused" if ok else "unexpected",
                            None if ok else f"invalid {body!r}: {r.status_code} {r.text[:200]}")
            elif kind in ("stream", "disconnect"):
                max_tokens = self.rng.randint(1, self.max_tokens) if kind == "stream" else \
                    self.max_tokens * 4
                leave_after = self.rng.randint(1, 3)
                async with client.stream("POST", path, json=self._body(chat, True, max_tokens)) as r:
                    if r.status_code != 200:
                        await r.aread()
                        self._count("unexpected", f"{kind}: {r.status_code} {r.text[:200]}")
                        return
                    chunks, done = 0, False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        if '"error"' in line:
                            self._count("unexpected", f"{kind}: error chunk {line[:200]}")
                            return
                        chunks += 1
                        if kind == "disconnect" and chunks >= leave_after:
                            break  # leaving the `async with` closes the connection
                if kind == "disconnect":
                    self._count("disconnected")
                else:
                    self._count("stream_ok" if done else "unexpected",
                                None if done else "stream: ended without [DONE]")
            elif kind == "full":
                r = await client.post(path, json=self._body(chat, False,
                                                            self.rng.randint(1, self.max_tokens)))
                ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in (
                    "stop", "length")
                self._count("full_ok" if ok else "unexpected",
                            None if ok else f"full: {r.status_code} {r.text[:200]}")
            else:  # abort: give up on a long non-streamed request
                body = self._body(chat, False, self.max_tokens * 4)
                body["ignore_eos"] = True
                try:
                    await asyncio.wait_for(client.post(path, json=body),
                                           timeout=self.rng.uniform(0.005, 0.05))
                    self._count("abort_answered_first")  # it was quicker than the client
                except asyncio.TimeoutError:
                    self._count("aborted")
        except Exception as e:  # a connection reset, a timeout: none is expected
            self._count("unexpected", f"{kind}: {type(e).__name__}: {e}")

    async def run(self, num_requests: int, concurrency: int,
                  duration_s: float | None = None) -> tuple[int, float]:
        """Send up to ``num_requests`` (fewer if ``duration_s`` passes first): (sent, seconds)."""
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120, limits=limits) as client:
            queue = iter(range(num_requests))
            start = time.perf_counter()
            sent = 0

            async def worker() -> None:
                nonlocal sent
                for _ in queue:
                    if duration_s is not None and time.perf_counter() - start > duration_s:
                        return
                    sent += 1
                    await self.one(client)

            await asyncio.gather(*[worker() for _ in range(concurrency)])
            return sent, time.perf_counter() - start


def kv_blocks_used(base_url: str, timeout: float = 30.0) -> float:
    """KV blocks in use once the server is idle (waits for aborts to land, up to ``timeout``)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(base_url + "/metrics", timeout=10).text
        used = sum(float(v) for v in re.findall(
            r"^minivllm:kv_blocks_used(?:\{[^}]*\})? (\S+)$", text, re.M))
        running = sum(float(v) for v in re.findall(
            r"^minivllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? (\S+)$", text, re.M))
        if (used == 0 and running == 0) or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def main(args) -> int:
    import httpx

    mix = parse_mix(args.mix)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="minivllm-soak-") as tmp:
        flags = shlex.split(args.server_args)
        if not flags or flags[0].startswith("-"):  # no model given: a tiny random-weight llama
            flags = [tiny_model(os.path.join(tmp, "tiny")), "--max-model-len", "256", *flags]
        flags += ["--port", "0", "--served-model-name", "soak"]
        server = ServerProcess(flags)
        try:
            base_url = server.wait_ready()
            core_pid = core_pid_of(server.pid)
            soak = Soak(base_url, "soak", rng, mix, args.max_tokens)

            def memory() -> dict:
                out = {"server_rss_mb": round(rss_bytes(server.pid) / 2**20, 1)}
                if core_pid is not None:
                    out["core_rss_mb"] = round(rss_bytes(core_pid) / 2**20, 1)
                return out

            _, warm_s = asyncio.run(soak.run(args.warmup_requests, args.concurrency))
            kv_blocks_used(base_url)  # let the warm-up's aborts land before reading memory
            at_warmup = memory()
            warm_outcomes = dict(soak.outcomes)
            soak.outcomes = {}
            duration = args.duration_minutes * 60 if args.duration_minutes else None
            sent, run_s = asyncio.run(soak.run(args.num_requests, args.concurrency, duration))
            blocks = kv_blocks_used(base_url)
            at_end = memory()
            healthy = httpx.get(base_url + "/health", timeout=10).status_code == 200
        finally:
            code = server.stop()
    growth = {k: round(100 * (at_end[k] / at_warmup[k] - 1), 1) for k in at_warmup}
    result = {
        "num_requests": sent, "warmup_requests": args.warmup_requests,
        "concurrency": args.concurrency, "mix": mix, "duration_s": round(run_s, 1),
        "requests_per_s": round(sent / run_s, 1),
        "outcomes": dict(sorted(soak.outcomes.items())), "warmup_outcomes": warm_outcomes,
        "unexpected_examples": soak.unexpected,
        "rss_at_warmup": at_warmup, "rss_at_end": at_end, "rss_growth_percent": growth,
        "kv_blocks_used_at_end": blocks, "healthy_at_end": healthy, "server_exit_code": code,
        "warmup_s": round(warm_s, 1), "machine": machine_info(),
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
    ok = soak.outcomes.get("unexpected", 0) == 0 and blocks == 0 and healthy and code == 0
    print(f"soak {'passed' if ok else 'FAILED'}: {sent} requests in {run_s:.0f} s, "
          f"outcomes {result['outcomes']}, RSS growth {growth} %, KV blocks in use {blocks:.0f}")
    return 0 if ok else 1
