"""The engine core in a process of its own, reached over ZMQ (``multiprocess=True``).

The front end binds two IPC sockets and spawns the core process, which connects to them:

    front end  --PUSH-- input  -->  PULL  engine core process   (add / abort / utility)
    front end  <--PULL-- output --  PUSH  engine core process   (EngineCoreOutputs)

Messages are msgpack (``serial.py``). The front end owns the process: it stops it on
shutdown, when the client is garbage-collected and at interpreter exit (``owner_finalizer``),
and the core exits by itself when the front end dies. When the core dies, every receive loop
here notices within ``POLL_MS`` (it checks the process whenever the socket stays quiet: the
liveness rule of ``minivllm.utils``, which the multiprocess executor's loops follow too) and
fails what is in flight with ``EngineDeadError``. The sockets, the spawn and the resources to
release are ``minivllm.utils``' helpers, shared with that executor.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import traceback
from collections import deque

try:
    import zmq
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "multiprocess=True needs pyzmq and msgspec: pip install 'minivllm[serve]'"
    ) from e

from minivllm.config import EngineConfig
from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.messages import EngineCoreOutput
from minivllm.engine import serial
from minivllm.engine.core_client import AsyncClientBase
from minivllm.engine.core_proc import run_engine_core
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequestType
from minivllm.utils import LIVENESS_POLL_MS, ProcessResources, owner_finalizer, recv_while_alive

POLL_MS = LIVENESS_POLL_MS  # how often a quiet receive loop checks that the core process is alive


class MPClient:
    """Spawn the core process, bind the sockets, wait until the model is loaded."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.resources = ProcessResources()
        self._finalizer = owner_finalizer(self, self.resources)  # SIGTERM ends the core's loop
        self.input_socket = self.resources.bind(zmq.PUSH, "input")
        self.output_socket = self.resources.bind(zmq.PULL, "output")
        self.proc = self.resources.spawn(
            run_engine_core, (config, self.resources.address("input"),
                              self.resources.address("output"), show_progress), "EngineCore")
        try:
            self.num_kv_blocks = self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_ready(self) -> int:
        def died(proc) -> RuntimeError:
            return RuntimeError(
                f"the engine core process exited (code {proc.exitcode}) while starting; its "
                "error is printed above (a script that starts it needs the "
                "`if __name__ == \"__main__\":` guard: the process is spawned)")

        ready = serial.decode_ready(recv_while_alive(self.output_socket, [self.proc], died))
        if not ready.ok:
            raise (ValueError if ready.error_is_value_error else RuntimeError)(ready.error)
        return ready.num_kv_blocks

    def _dead_detail(self) -> str:
        return f"its process exited unexpectedly (exit code {self.proc.exitcode})"

    def _send(self, kind: EngineCoreRequestType, payload) -> None:
        try:
            self.input_socket.send_multipart(serial.encode_request(kind, payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # no peer: the core process is gone
            raise EngineDeadError(self._dead_detail()) from None

    @property
    def core_pid(self) -> int | None:
        return self.proc.pid

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(MPClient):
    """For ``LLMEngine`` / ``LLM``: blocking calls, the same interface as ``InprocClient``."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        super().__init__(config, show_progress)
        self._pending: deque[EngineCoreOutputs] = deque()  # outputs that came in during a utility call
        self._call_ids = itertools.count()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def _recv(self) -> EngineCoreOutputs:
        outputs = serial.decode_outputs(recv_while_alive(
            self.output_socket, [self.proc], lambda _: EngineDeadError(self._dead_detail())))
        if outputs.engine_error is not None:
            raise EngineDeadError(f"it raised\n{outputs.engine_error}")
        return outputs

    def get_output(self) -> list[EngineCoreOutput]:
        """The outputs of the next step(s) the core finished (blocks until there are some)."""
        batch = self._pending.popleft() if self._pending else self._recv()
        return batch.outputs

    def call_utility(self, method: str, *args):
        call_id = next(self._call_ids)
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        while True:
            outputs = self._recv()
            u = outputs.utility_output
            if u is None:
                self._pending.append(outputs)
            elif u.call_id == call_id:
                if u.error is not None:
                    raise RuntimeError(u.error)
                return u.result


class AsyncMPClient(MPClient, AsyncClientBase):
    """For ``AsyncLLM``: a thread receives and decodes the outputs, the event loop dispatches them."""

    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        AsyncClientBase.__init__(self)
        self._receiver: threading.Thread | None = None
        MPClient.__init__(self, config, show_progress)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._receiver = threading.Thread(target=self._process_outputs_socket, args=(loop,),
                                          daemon=True, name="EngineCoreClientOutput")
        self._receiver.start()

    def _process_outputs_socket(self, loop: asyncio.AbstractEventLoop) -> None:
        """Receive and decode the core's outputs. Any failure here is fatal (no output could
        reach a request any more): every request in flight fails with EngineDeadError."""
        socket = self.output_socket  # used by this thread only from now on
        try:
            while not self.resources.shutting_down:
                if socket.poll(POLL_MS):
                    outputs = serial.decode_outputs(socket.recv())
                    loop.call_soon_threadsafe(self._dispatch, outputs)
                elif not self.proc.is_alive():
                    if not self.resources.shutting_down:
                        loop.call_soon_threadsafe(self._set_dead, self._dead_detail())
                    return
        except Exception as e:
            if self.resources.shutting_down:
                return
            traceback.print_exc()
            detail = f"the front end's output thread failed: {type(e).__name__}: {e}"
            try:
                loop.call_soon_threadsafe(self._set_dead, detail)
            except RuntimeError:  # the event loop was closed under us: nobody is listening
                pass

    @property
    def is_dead(self) -> bool:
        if self.dead_error is None and not self.resources.shutting_down and not self.proc.is_alive():
            return True  # noticed before the receiving thread did
        return self.dead_error is not None

    def check_alive(self) -> None:
        if self.is_dead:
            raise self.dead_error or EngineDeadError(self._dead_detail())

    def add_request(self, request: EngineCoreRequest) -> None:
        self._ensure_started()
        self.check_alive()
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            try:
                self._send(EngineCoreRequestType.ABORT, list(request_ids))
            except EngineDeadError:
                pass  # nothing left to abort

    def _send_utility(self, call_id: int, method: str, args: list) -> None:
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, args))

    def shutdown(self) -> None:
        self.resources.shutting_down = True
        if self._receiver is not None:
            self._receiver.join(timeout=2)
        MPClient.shutdown(self)
