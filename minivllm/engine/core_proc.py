"""The engine core's busy loop, and the engine core process built around it.

``EngineCoreProc`` drives an ``EngineCore``: take every message waiting in ``input_queue``
(add, abort, a utility call), run one step, hand the outputs to ``output_put``, repeat; sleep
on the queue when no request is left. It never touches a socket itself:

* in its own process (``run_engine_core``, ``multiprocess=True``) two more threads move bytes:
  one reads the input socket and decodes into ``input_queue``, one encodes and writes the
  outputs. zmq and torch release the GIL, so requests arrive and tokens leave *while* the
  model runs, and the front end's HTTP handling, tokenizing and detokenizing live in another
  process, on another core, with a GIL of their own;
* in the front end's process (``multiprocess=False``) the same loop runs on a thread there, and
  competes for that one GIL with everything the front end does: the "before" picture.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from minivllm.engine.core import EngineCore
from minivllm.engine.messages import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequestType,
    UtilityOutput,
)
from minivllm.utils import child_process_setup, make_socket

ADD, ABORT, UTILITY, SHUTDOWN = (
    EngineCoreRequestType.ADD,
    EngineCoreRequestType.ABORT,
    EngineCoreRequestType.UTILITY,
    EngineCoreRequestType.SHUTDOWN,
)
# put in the input queue by a thread of the core process that failed: the busy loop raises it,
# so the front end hears of it (EngineDeadError) instead of waiting forever for that thread
THREAD_FAILED = "thread_failed"


class EngineCoreProc:
    def __init__(self, engine_core: EngineCore, output_put: Callable[[EngineCoreOutputs], None],
                 governor: "CpuShareGovernor | None" = None):
        self.engine_core = engine_core
        self.governor = governor
        self.input_queue: queue.Queue = queue.Queue()  # (EngineCoreRequestType, payload)
        self.output_put = output_put
        self.running = True

    def run_busy_loop(self) -> None:
        """Until SHUTDOWN: handle what arrived, step, send. A fatal error is reported, then raised."""
        try:
            while self.running:
                handled = self._process_input_queue()
                if not self.running:
                    break
                if self.governor is not None:
                    self.governor.tick()
                outputs = self.engine_core.step()
                if outputs or handled:  # something changed: new tokens, or at least the stats
                    self.output_put(EngineCoreOutputs(
                        outputs=outputs,
                        scheduler_stats=self.engine_core.get_stats(),
                        timestamp=time.time(),
                    ))
        except Exception:
            self.output_put(EngineCoreOutputs(engine_error=traceback.format_exc()))
            raise

    def _process_input_queue(self) -> bool:
        handled = False
        if not self.engine_core.has_unfinished_requests():
            self._handle(*self.input_queue.get())  # nothing to compute: sleep until a message
            handled = True
        while self.running:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                break
            self._handle(*item)
            handled = True
        return handled

    def _handle(self, kind: EngineCoreRequestType, payload) -> None:
        if kind == ADD:
            self.engine_core.add_request(payload)
        elif kind == ABORT:
            self.engine_core.abort_requests(payload)
        elif kind == UTILITY:
            call_id, method, args = payload
            self.output_put(EngineCoreOutputs(utility_output=self._call_utility(call_id, method, args)))
        elif kind == SHUTDOWN:
            self.running = False
        elif kind == THREAD_FAILED:
            raise RuntimeError(payload)

    def _call_utility(self, call_id: int, method: str, args) -> UtilityOutput:
        if method.startswith("_") or not callable(getattr(self.engine_core, method, None)):
            return UtilityOutput(call_id, error=f"EngineCore has no utility method {method!r}")
        try:
            return UtilityOutput(call_id, result=getattr(self.engine_core, method)(*args))
        except Exception as e:
            return UtilityOutput(call_id, error=f"{type(e).__name__}: {e}")


# From this many cores up, a CPU engine core leaves one to the API server (see
# engine_core_cpu_threads; the measurements are in docs/serving_speed.md).
RESERVE_SERVER_CORE_FROM = 8


def usable_cpu_cores() -> int:
    """The cores torch would use here: its default thread count (physical cores), never more
    than the CPUs this process may run on (``taskset``, a container's cpuset)."""
    import torch

    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        allowed = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), allowed))


def engine_core_cpu_threads(config) -> int | None:
    """On a CPU, the torch threads an engine core beside an API server should use.

    All the cores on a small machine: the server's share of a core is small (about 1-3 % of
    one core while it streams a saturated engine's tokens on 2 cores), and the cost of sharing
    is only that: a torch op stalls while the server holds one of its threads' cores. Leaving
    a core to the server instead costs 1/N of the engine's compute, which is cheaper only when
    N is large and the server busy: from ``RESERVE_SERVER_CORE_FROM`` cores up it gets one.
    An explicit OMP_NUM_THREADS wins (None: leave torch alone; so does a GPU, where the core
    mostly launches kernels)."""
    if config.device_config.device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = usable_cpu_cores()
    return cores - 1 if cores >= RESERVE_SERVER_CORE_FROM else cores


# glibc malloc's settings in the engine core process (``keep_freed_memory``)
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest: smaller blocks come from the heap
MALLOC_TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept, up to this much


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a step frees for the next step, rather than give it
    back to the kernel and fault it in again. Left to itself, in the engine core process's main
    thread (where the busy loop runs), it took 60-90 thousand page faults a second with the
    bundled model on 512-token prompts, 8 at a time on 2 cores, against a few hundred in 3 s
    with these settings, which gave 2 % more output tok/s (``docs/serving_speed.md``). The same
    settings as the environment variables ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_``; nothing happens where either is set, or off glibc. Returns
    whether they were applied."""
    import platform

    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
                and mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


def configure_cpu_threads(config) -> None:
    import torch

    threads = engine_core_cpu_threads(config)
    if threads is not None:
        torch.set_num_threads(min(torch.get_num_threads(), threads))


class CpuShareGovernor:
    """Fits the engine core's torch threads to the cores other programs leave free, while it runs.

    torch's threads meet at the end of every parallel op; when another program holds the core
    of one of them, the others wait for it, op after op. On a 2-core machine that other
    programs kept busy, a server whose core ran 2 threads streamed 4.8 output tokens/s against
    37.9 with 1 (docs/serving_speed.md). But the server's own API process and a local client
    are runnable too, in short bursts between steps, and those cost the threads little:
    counting them as load cost a quiet machine a third of its served throughput.

    So it measures the cost itself: every ``interval`` seconds of stepping, the share of the
    time this process's threads were runnable that they spent waiting for a core (the kernel's
    run-queue delay, ``/proc/self/task/*/schedstat``). At ``contended`` or more, it gives up a
    thread, once two windows in a row agree. With fewer threads than it may use, it tries one
    more for a window from time to time (after 4 windows, then 8, 16, ... up to 64 while the
    tries fail) and keeps it if the waiting stays low. Linux only (elsewhere, and with
    OMP_NUM_THREADS set, it does nothing)."""

    MAX_BACKOFF = 64

    def __init__(self, max_threads: int, interval: float = 2.0, contended: float = 0.2) -> None:
        self.max_threads = max_threads
        self.interval = interval
        self.contended = contended
        self.window_start = 0.0
        self.high = 0  # windows in a row at or above ``contended``
        self.backoff = 4  # windows to wait before trying one more thread
        self.since_change = 0
        self.trying: int | None = None  # the thread count to go back to if the try fails
        self.enabled = max_threads > 1 and os.path.exists("/proc/self/schedstat")
        self.last_sched = self.own_run_and_wait() if self.enabled else (0, 0)

    @classmethod
    def for_engine(cls, config) -> "CpuShareGovernor | None":
        """A governor over the torch threads this process has now, where the thread rule
        applies (a CPU engine, no OMP_NUM_THREADS), else None."""
        if engine_core_cpu_threads(config) is None:
            return None
        import torch

        return cls(torch.get_num_threads())

    @staticmethod
    def own_run_and_wait() -> tuple[int, int]:
        """Nanoseconds this process's live threads have run, and waited runnable for a core."""
        ran = waited = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                    r, w = f.read().split()[:2]
            except (OSError, ValueError):
                continue  # the thread ended
            ran, waited = ran + int(r), waited + int(w)
        return ran, waited

    def wait_share(self) -> float:
        """The share of the time since the last call that this process's threads spent waiting
        for a core, of the time they were runnable (ran or waited)."""
        ran, waited = self.own_run_and_wait()
        d_ran = max(0, ran - self.last_sched[0])
        d_waited = max(0, waited - self.last_sched[1])
        self.last_sched = (ran, waited)
        return d_waited / (d_ran + d_waited) if d_ran + d_waited else 0.0

    def decide(self, current: int, share: float) -> int:
        """The thread count for the next window, given this window's wait share."""
        self.since_change += 1
        if self.trying is not None:  # the window of a try just ended
            back, self.trying = self.trying, None
            if share >= self.contended:
                self.backoff = min(self.MAX_BACKOFF, self.backoff * 2)
                self.high = 0
                return back
            self.backoff = 4
        self.high = self.high + 1 if share >= self.contended else 0
        if self.high >= 2 and current > 1:
            self.high = self.since_change = 0
            return current - 1
        if current < self.max_threads and self.since_change >= self.backoff:
            self.trying, self.since_change = current, 0
            return current + 1
        return current

    def tick(self) -> None:
        """Called between steps; cheap unless a window ended."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.window_start < self.interval:
            return
        self.window_start = now
        try:
            share = self.wait_share()
        except OSError:
            self.enabled = False
            return
        import torch

        current = torch.get_num_threads()
        want = self.decide(current, share)
        if _GOVERNOR_LOG:
            print(f"governor threads={current} wait_share={share:.3f} want={want}",
                  file=sys.stderr, flush=True)
        if want != current:
            torch.set_num_threads(want)


_GOVERNOR_LOG = os.environ.get("MINIVLLM_GOVERNOR_LOG") == "1"


# -- the engine core process ------------------------------------------------------------------

def run_engine_core(config, input_address: str, output_address: str, show_progress: bool) -> None:
    """Entry point of the engine core process (started with multiprocessing's "spawn")."""
    import zmq

    from minivllm.engine import serial

    child_process_setup("EngineCoreParentWatch")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    ctx = zmq.Context()
    out_socket = make_socket(ctx, zmq.PUSH, output_address, bind=False)
    in_socket = make_socket(ctx, zmq.PULL, input_address, bind=False)

    try:
        configure_cpu_threads(config)
        engine_core = EngineCore(config, show_progress=show_progress)
    except Exception as e:
        traceback.print_exc()
        ready = EngineCoreReady(ok=False, error=str(e), error_is_value_error=isinstance(e, ValueError))
        out_socket.send(serial.encode(ready))
        out_socket.close(linger=2000)
        sys.exit(1)
    keep_freed_memory()  # after loading: only the steps' allocations need it
    out_socket.send(serial.encode(EngineCoreReady(ok=True, num_kv_blocks=engine_core.scheduler
                                                  .kv_cache_manager.num_blocks)))

    output_queue: queue.Queue = queue.Queue()
    governor = CpuShareGovernor.for_engine(config)  # after configure_cpu_threads
    proc = EngineCoreProc(engine_core, output_queue.put, governor)
    stop = threading.Event()
    reader = threading.Thread(target=_process_input_socket, args=(in_socket, proc.input_queue, stop),
                              daemon=True, name="EngineCoreInput")
    writer = threading.Thread(target=_process_output_socket,
                              args=(out_socket, output_queue, proc.input_queue),
                              daemon=True, name="EngineCoreOutput")
    reader.start()
    writer.start()
    code = 0
    try:
        proc.run_busy_loop()
    except SystemExit:
        pass
    except Exception:
        traceback.print_exc()
        code = 1
    finally:
        engine_core.shutdown()  # stop the tensor-parallel workers, if any
        stop.set()
        output_queue.put(None)  # let the writer flush what is left (an engine_error, say)
        reader.join(timeout=2)
        writer.join(timeout=2)
        ctx.term()
    sys.exit(code)


def _exit_on_sigterm(*_) -> None:
    """Leave the busy loop through its clean exit (SystemExit), with a deadline: SIGTERM can
    arrive anywhere, even before that loop and its ``finally`` are reached, and a clean exit that
    hangs (a socket still open when the ZMQ context ends) must not keep the process alive. After
    5 s, SIGALRM's default action ends it."""
    if hasattr(signal, "alarm"):  # POSIX only
        signal.alarm(5)
    sys.exit(0)


def _process_input_socket(socket, input_queue: queue.Queue, stop: threading.Event) -> None:
    """Read and decode messages into the busy loop's queue. Any failure here (a message that
    does not decode, a socket error) is fatal: without this thread no request can arrive."""
    from minivllm.engine import serial

    try:
        while not stop.is_set():
            if socket.poll(100):
                input_queue.put(serial.decode_request(socket.recv_multipart(copy=False)))
    except Exception:
        input_queue.put((THREAD_FAILED, f"the engine core's input thread failed:\n"
                                        f"{traceback.format_exc()}"))
    finally:
        socket.close(linger=0)


def _process_output_socket(socket, output_queue: queue.Queue, input_queue: queue.Queue) -> None:
    """Encode and send what the busy loop produced. A failure is fatal too: it tries to tell
    the front end directly (a plain error message still encodes), then stops the busy loop,
    whose process exits (which the front end notices even if the message could not go)."""
    from minivllm.engine import serial

    try:
        while (item := output_queue.get()) is not None:
            socket.send(serial.encode(item))
    except Exception:
        error = f"the engine core's output thread failed:\n{traceback.format_exc()}"
        try:
            socket.send(serial.encode(EngineCoreOutputs(engine_error=error)))
        except Exception:
            pass
        input_queue.put((THREAD_FAILED, error))
    finally:
        socket.close(linger=1000)
