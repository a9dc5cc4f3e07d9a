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


def child_process_setup(thread_name: str) -> None:
    """What a child spawned by ``ProcessResources.spawn`` does first: exit when its parent dies
    (``exit_with_parent``, the watching thread named ``thread_name``), and ignore Ctrl-C, which
    the terminal sends to the whole process group: the front end owns the shutdown and tells
    its children."""
    import signal

    exit_with_parent(thread_name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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


# -- child processes reached over ZMQ: the engine-core client and the multiprocess executor ------

# The liveness rule: a loop waiting for a child's message checks, whenever its socket stays
# quiet this long, that the child is still alive (a message ends the wait at once, whatever this is)
LIVENESS_POLL_MS = 100


def make_socket(ctx, kind: int, address: str, bind: bool):
    """A ZMQ socket of ``kind`` (``zmq.PUSH`` or ``zmq.PULL``) with no high-water mark (messages
    queue up, none is dropped or blocks on a limit), bound to or connected to ``address``."""
    import zmq

    s = ctx.socket(kind)
    s.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
    (s.bind if bind else s.connect)(address)
    return s


def recv_while_alive(socket, procs, dead) -> bytes:
    """The next message on ``socket``. While none comes, each of ``procs`` is checked every
    ``LIVENESS_POLL_MS``; a dead one raises ``dead(proc)``: one killed by a signal if any (the
    cause: the others may have exited because it left their collectives), else the first."""
    while not socket.poll(LIVENESS_POLL_MS):
        gone = [proc for proc in procs if not proc.is_alive()]
        if gone:
            killed = [proc for proc in gone if (proc.exitcode or 0) < 0]
            raise dead((killed or gone)[0])
    return socket.recv()


class ProcessResources:
    """What the owner of child processes must release even if it is never shut down: its ZMQ
    context and sockets, the temporary folder of their IPC addresses, and the children. Held by
    an ``owner_finalizer``; calling it releases everything (the children get SIGTERM)."""

    def __init__(self, prefix: str = "minivllm-") -> None:
        import tempfile

        import zmq

        self.ctx = zmq.Context()
        self.tmpdir = tempfile.mkdtemp(prefix=prefix)
        self.procs: list = []
        self.sockets: list = []
        self.shutting_down = False

    def address(self, name: str) -> str:
        return f"ipc://{self.tmpdir}/{name}"

    def bind(self, kind: int, name: str):
        """A socket of ``kind`` bound to ``address(name)`` for a child to connect to."""
        s = make_socket(self.ctx, kind, self.address(name), bind=True)
        self.sockets.append(s)
        return s

    def spawn(self, target, args: tuple, name: str):
        """Start ``target(*args)`` in a spawned daemonic process (no fork: torch and threads are
        live in the parent) that these resources stop."""
        import multiprocessing

        proc = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name,
                                                            daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def __call__(self) -> None:
        import shutil

        self.shutting_down = True
        stop_processes(self.procs)
        for s in self.sockets:
            s.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
