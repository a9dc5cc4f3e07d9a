"""Small helpers every layer may use (no imports from the rest of the package)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` items."""
    return -(-a // b)


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


def exit_with_parent(thread_name: str) -> None:
    """In a spawned process: if the process that spawned it dies (even by SIGKILL), exit too, so
    no orphan keeps a model loaded. A daemon thread waits on the parent."""
    import multiprocessing
    import os
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name=thread_name).start()


def stop_processes(procs, grace_s: float = 5.0) -> None:
    """Stop child processes: SIGTERM to those alive, up to ``grace_s`` seconds (shared) for them
    to exit, then SIGKILL to any left."""
    import time

    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def owner_finalizer(owner, release):
    """Call ``release()`` exactly once: when ``owner`` is garbage-collected, when the returned
    finalizer is called (an explicit shutdown), or at interpreter exit — and there *before*
    multiprocessing's own exit hook, which terminates daemonic children and then joins every
    child without a timeout. ``release`` stops this owner's processes with a deadline of its own,
    so a child that ignores SIGTERM cannot hang the exit of the process that spawned it."""
    import multiprocessing.util
    import weakref

    at_exit = multiprocessing.util.Finalize(None, release, exitpriority=10)  # runs once
    weakref.finalize(owner, at_exit)
    return at_exit
