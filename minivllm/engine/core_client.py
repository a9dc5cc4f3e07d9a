"""How the front end reaches the engine core.

``InprocClient`` calls the core directly, in the same process: simplest to debug, and the
"before" picture of the multi-process split (``multiprocess=True``), where the same calls
travel over ZMQ to a core running in its own process.
"""

from __future__ import annotations

from minivllm.config import EngineConfig
from minivllm.core.request import EngineCoreRequest
from minivllm.core.sched_output import EngineCoreOutput
from minivllm.engine.core import EngineCore


class InprocClient:
    def __init__(self, config: EngineConfig, show_progress: bool = True) -> None:
        self.engine_core = EngineCore(config, show_progress=show_progress)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.engine_core.step()

    def call_utility(self, method: str, *args):
        """Call an inspection method of the core (get_stats, get_step_trace, ...)."""
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        pass


def make_client(config: EngineConfig, show_progress: bool = True):
    if config.multiprocess:
        from minivllm.engine.core_client_mp import SyncMPClient

        return SyncMPClient(config, show_progress=show_progress)
    return InprocClient(config, show_progress=show_progress)
