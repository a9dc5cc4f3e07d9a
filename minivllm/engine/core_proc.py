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
from minivllm.utils import exit_with_parent

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


def configure_cpu_threads(config) -> None:
    import torch

    threads = engine_core_cpu_threads(config)
    if threads is not None:
        torch.set_num_threads(min(torch.get_num_threads(), threads))


class CpuShareGovernor:
    """Fits the engine core's torch threads to the cores other programs leave free, while it runs.

    torch's threads meet at the end of every parallel op; when another program takes the core
    of one of them, the others wait for it, op after op. On a 2-core machine that other
    programs also kept busy (load average about 10), a server whose core ran 2 threads
    streamed 4.8 output tokens/s against 37.9 with 1 (docs/serving_speed.md). So every
    ``interval`` seconds of stepping it samples how many threads of *other* processes are
    runnable (``/proc/stat``'s ``procs_running`` minus this process's own), and between steps
    sets ``max_threads - round(mean)`` threads (at least 1) once two windows in a row agree
    (a sample at most every ``interval / samples`` seconds, one per step when steps are longer).
    On a quiet machine the mean stays near 0 and the core keeps all its threads. Linux only
    (elsewhere, and with OMP_NUM_THREADS set, it does nothing)."""

    def __init__(self, max_threads: int, interval: float = 2.0, samples: int = 8) -> None:
        self.max_threads = max_threads
        self.interval = interval
        self.sample_every = interval / samples
        self.samples: list[int] = []
        self.last_sample = self.window_start = 0.0
        self.pending: int | None = None
        self.enabled = max_threads > 1 and os.path.exists("/proc/stat")

    @staticmethod
    def others_running() -> int:
        with open("/proc/stat", "rb") as f:
            running = next(int(line.split()[1]) for line in f if line.startswith(b"procs_running"))
        mine = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                    state = f.read().rpartition(b")")[2].split()[0]
            except (OSError, IndexError):
                continue
            mine += state == b"R"
        return max(0, running - mine)

    def tick(self) -> None:
        """Called between steps; cheap unless a sample is due."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last_sample < self.sample_every:
            return
        self.last_sample = now
        try:
            self.samples.append(self.others_running())
        except (OSError, StopIteration, ValueError):
            self.enabled = False
            return
        if now - self.window_start < self.interval:
            return
        self.window_start = now
        import torch

        busy = round(sum(self.samples) / len(self.samples))
        self.samples.clear()
        want = max(1, self.max_threads - busy)
        if want == torch.get_num_threads():
            self.pending = None
        elif self.pending == want:  # two windows in a row: switch
            torch.set_num_threads(want)
            self.pending = None
        else:
            self.pending = want


# -- the engine core process ------------------------------------------------------------------

def run_engine_core(config, input_address: str, output_address: str, show_progress: bool) -> None:
    """Entry point of the engine core process (started with multiprocessing's "spawn")."""
    import zmq

    from minivllm.engine import serial

    exit_with_parent("EngineCoreParentWatch")
    # Ctrl-C reaches the whole process group: the front end owns the shutdown and will tell us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    ctx = zmq.Context()
    out_socket = ctx.socket(zmq.PUSH)
    out_socket.setsockopt(zmq.SNDHWM, 0)
    out_socket.connect(output_address)
    in_socket = ctx.socket(zmq.PULL)
    in_socket.setsockopt(zmq.RCVHWM, 0)
    in_socket.connect(input_address)

    try:
        configure_cpu_threads(config)
        engine_core = EngineCore(config, show_progress=show_progress)
    except Exception as e:
        traceback.print_exc()
        ready = EngineCoreReady(ok=False, error=str(e), error_is_value_error=isinstance(e, ValueError))
        out_socket.send(serial.encode(ready))
        out_socket.close(linger=2000)
        sys.exit(1)
    out_socket.send(serial.encode(EngineCoreReady(ok=True, num_kv_blocks=engine_core.scheduler
                                                  .kv_cache_manager.num_blocks)))

    output_queue: queue.Queue = queue.Queue()
    threads = engine_core_cpu_threads(config)
    governor = CpuShareGovernor(threads) if threads is not None else None
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
