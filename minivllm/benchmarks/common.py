"""Helpers shared by the benchmarks: workloads, machine description, JSON output, and a
``minivllm serve`` child process (also used by the tests)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import time

from minivllm.utils import percentile, stall_window  # noqa: F401  (re-exported)


def machine_info() -> dict:
    import torch

    info = {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _bookkeeping() -> None:
    """A fixed piece of the per-request Python an engine's host side runs: 256 requests, each
    step appending a token, counting it and reporting it, for 100 steps."""
    requests = [{"id": i, "tokens": [1, 2, 3], "n": 0} for i in range(256)]
    report = []
    for _ in range(100):
        for r in requests:
            r["tokens"].append(r["n"])
            r["n"] += 1
            report.append((r["id"], r["n"]))
        report.clear()


def sync(device) -> None:
    """Wait for the device's queued work (a CUDA device); nothing on a CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, repeats: int, device) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call, synchronised with
    ``device`` around each."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return percentile(times, 50)


def event_median_time(fn, iters: int, device) -> float:
    """Median seconds per call of ``fn`` after one warm-up call: timed with CUDA events on a
    CUDA device (what the GPU spent, without host-side gaps), with the wall clock elsewhere."""
    import statistics

    import torch

    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def host_speed(repeats: int = 7) -> dict:
    """How fast this machine runs host-side work now, timed in the same run as the figures it
    qualifies: ``python_ms``, the median time of a fixed pure-Python loop (``_bookkeeping``), and
    ``torch_op_us``, of one small in-place torch op. A shared machine's speed drifts by more than
    an engine change moves its overhead; two runs' overheads compare only next to these."""
    import torch

    x, cpu = torch.zeros(256), torch.device("cpu")

    def thousand_ops():
        for _ in range(1000):
            x.add_(1)

    return {"python_ms": median_time(_bookkeeping, repeats, cpu) * 1e3,
            "torch_op_us": median_time(thousand_ops, repeats, cpu) * 1e3}


def random_token_prompts(
    rng: random.Random, lengths: list[int], vocab_size: int, avoid: set[int]
) -> list[list[int]]:
    """Prompts of random ordinary token ids (no special tokens), one per length."""
    pool = [t for t in range(min(vocab_size, 32000)) if t not in avoid]
    return [[rng.choice(pool) for _ in range(n)] for n in lengths]


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


class ServerProcess:
    """``minivllm serve ...`` as a child process: wait for its ready line, know its URL, stop it.

    Start it with ``--port 0`` and the URL it prints is read back, so parallel runs never fight
    over a port. Its stderr (progress bars, tracebacks) is kept for error messages.
    """

    READY = "minivllm serve: ready"

    def __init__(self, serve_args: list[str], env: dict | None = None,
                 command: list[str] | None = None) -> None:
        """``serve_args``: the flags after ``minivllm serve``. ``command``: how to invoke
        ``minivllm`` (default: this Python, ``-m minivllm.entrypoints.cli``)."""
        import subprocess
        import sys
        import threading

        command = command or [sys.executable, "-m", "minivllm.entrypoints.cli"]
        self.argv = [*command, "serve", *serve_args]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.url: str | None = None
        self.ready = threading.Event()
        for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=self._read, args=(stream, sink), daemon=True).start()

    def _read(self, stream, sink: list[str]) -> None:
        import re

        for line in stream:
            sink.append(line)
            m = re.search(r"API at (http://\S+)/v1", line)
            if m:
                self.url = m.group(1)
            if line.startswith(self.READY):
                self.ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 600) -> str:
        import time

        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"`{' '.join(self.argv)}` did not become ready (exit code "
                    f"{self.proc.returncode}):\n{''.join(self.stderr)[-3000:]}"
                )
        return self.url

    def stop(self, sig: int | None = None, timeout: float = 30) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if sig is None else sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
