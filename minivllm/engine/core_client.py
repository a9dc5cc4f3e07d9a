"""How the front end reaches the engine core.

``InprocClient`` calls the core directly, in the same process: simplest to debug, and the
"before" picture of the multi-process split (``multiprocess=True``), where the same calls
travel over ZMQ to a core running in its own process (``core_client_mp.py``).

The asyncio front end (``AsyncLLM``) needs a core that steps *by itself* while the event loop
serves HTTP: ``AsyncInprocClient`` runs the core's busy loop on a thread of this process,
``AsyncMPClient`` in a process of its own. Both hand ``EngineCoreOutputs`` to the loop through
``AsyncClientBase``, which also answers utility calls and turns a dead core into
``EngineDeadError`` for everyone waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

from minivllm.config import EngineConfig
from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.messages import EngineCoreOutput
from minivllm.engine.core import EngineCore
from minivllm.engine.core_proc import CpuShareGovernor, EngineCoreProc, configure_cpu_threads
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequestType
from minivllm.executor.abstract import WorkerDiedError


class InprocClient:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.engine_core = EngineCore(config, show_progress=show_progress)
        self.dead_error: EngineDeadError | None = None
        # offline too, the torch threads follow the cores other programs leave free
        self.governor = CpuShareGovernor.for_engine(config)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.dead_error is None:  # a dead engine holds nothing to abort
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        self._check_alive()
        if self.governor is not None:
            self.governor.tick()
        try:
            return self.engine_core.step()
        except WorkerDiedError as e:
            # the multi-process core's death path, in this process: every later call raises
            # too, and the surviving workers are stopped (they would wait on the dead one)
            self.dead_error = EngineDeadError(f"the engine core cannot go on: {e}")
            self.engine_core.shutdown()
            raise self.dead_error from e

    def call_utility(self, method: str, *args):
        """Call an inspection method of the core (get_stats, get_step_trace, ...)."""
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def make_client(config: EngineConfig, show_progress: bool = True):
    if config.multiprocess:
        from minivllm.engine.core_client_mp import SyncMPClient

        return SyncMPClient(config, show_progress=show_progress)
    return InprocClient(config, show_progress=show_progress)


class AsyncClientBase:
    """The event-loop side of an async client: output queue, utility futures, death.

    Subclasses deliver each ``EngineCoreOutputs`` to ``_dispatch`` on the event loop and
    implement ``add_request`` / ``abort_requests`` / ``_send_utility`` (never blocking), and
    ``_start()`` (called once, on the loop, before the first use).
    """

    def __init__(self) -> None:
        self._outputs: asyncio.Queue | None = None
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.dead_error: EngineDeadError | None = None

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def _ensure_started(self) -> None:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
            self._start()

    def _start(self) -> None:
        raise NotImplementedError

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        if outputs.utility_output is not None:
            u = outputs.utility_output
            future = self._utility_futures.pop(u.call_id, None)
            if future is not None and not future.done():
                if u.error is not None:
                    future.set_exception(RuntimeError(u.error))
                else:
                    future.set_result(u.result)
        elif outputs.engine_error is not None:
            self._set_dead(f"it raised\n{outputs.engine_error}")
        else:
            self._outputs.put_nowait(outputs)

    def _set_dead(self, detail: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(detail)
        self._outputs.put_nowait(self.dead_error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(self.dead_error)
        self._utility_futures.clear()

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next batch of outputs; raises EngineDeadError once the core is gone."""
        self._ensure_started()
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)  # every later call raises too
            raise item
        return item

    async def call_utility_async(self, method: str, *args):
        """Run an inspection method of the core (get_stats, get_step_trace, ...) between steps."""
        self._ensure_started()
        self.check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        self._send_utility(call_id, method, list(args))
        return await future

    def _send_utility(self, call_id: int, method: str, args: list) -> None:
        raise NotImplementedError


class AsyncInprocClient(AsyncClientBase):
    """The core's busy loop on a thread of this process (``multiprocess=False``)."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        super().__init__()
        self.engine_core = EngineCore(config, show_progress=show_progress)
        self.num_kv_blocks = self.engine_core.scheduler.kv_cache_manager.num_blocks
        self.proc = EngineCoreProc(self.engine_core, self._put_from_core_thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, daemon=True, name="EngineCore")
        self._thread.start()

    def _run(self) -> None:
        configure_cpu_threads(self.engine_core.config)
        self.proc.governor = CpuShareGovernor.for_engine(self.engine_core.config)
        try:
            self.proc.run_busy_loop()
        except Exception:
            pass  # already reported through output_put(engine_error=...)

    def _put_from_core_thread(self, outputs: EngineCoreOutputs) -> None:
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.proc.running = False

    def add_request(self, request: EngineCoreRequest) -> None:
        self._ensure_started()
        self.check_alive()
        self.proc.input_queue.put((EngineCoreRequestType.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            self.proc.input_queue.put((EngineCoreRequestType.ABORT, list(request_ids)))

    def _send_utility(self, call_id: int, method: str, args: list) -> None:
        self.proc.input_queue.put((EngineCoreRequestType.UTILITY, (call_id, method, args)))

    def shutdown(self) -> None:
        self.proc.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine_core.shutdown()


def make_async_client(config: EngineConfig, show_progress: bool = True):
    if config.multiprocess:
        from minivllm.engine.core_client_mp import AsyncMPClient

        return AsyncMPClient(config, show_progress=show_progress)
    return AsyncInprocClient(config, show_progress=show_progress)
