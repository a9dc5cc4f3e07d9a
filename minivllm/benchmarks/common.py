"""Helpers shared by the benchmarks: workloads, machine description, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random


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


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stall_window(
    token_times: list[list[float]], arrival: float, window_end: float, steady_span: float
) -> tuple[list[float], list[float]]:
    """Split the gaps between consecutive output tokens around a long prompt's arrival.

    Returns (steady, window): ``steady`` holds the gaps that ended within ``steady_span`` seconds
    before ``arrival``; ``window`` the gaps that ended after it and began before ``window_end``
    (the long prompt's first token) — the decodes that shared the machine with its prefill.
    """
    steady, window = [], []
    for times in token_times:
        for a, b in zip(times, times[1:]):
            if arrival - steady_span < b <= arrival:
                steady.append(b - a)
            elif arrival < b and a < window_end:
                window.append(b - a)
    return steady, window
