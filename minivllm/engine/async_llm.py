"""AsyncLLM: the asyncio front end a server is built on (vLLM's ``AsyncLLM``).

    engine = AsyncLLM.from_engine_args(EngineArgs(multiprocess=True))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
        print(out.outputs[0].text)          # the text so far, after every new token

Many ``generate`` calls run at once, one per HTTP request. The engine core steps on its own
(another process, or a thread here) and one task, the output handler, turns each batch of new
token ids into text (``OutputProcessor``: incremental detokenization, stop strings) and hands
every request its latest ``RequestOutput``. A consumer slower than the engine never builds up
a backlog: its collector keeps only the newest output (merging DELTA outputs it has not taken).

Leaving the ``async for`` early, or being cancelled (the client disconnected), aborts the
request: the core frees its KV blocks at its next step.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncGenerator

from minivllm.config import EngineArgs, EngineConfig
from minivllm.engine.messages import EngineCoreOutput
from minivllm.engine.core_client import make_async_client
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.processor import Processor, PromptType, load_tokenizer
from minivllm.outputs import RequestOutput, RequestOutputKind
from minivllm.sampling_params import SamplingParams


class RequestOutputCollector:
    """One request's mailbox: the newest output (DELTA outputs not yet taken are merged into
    one), or the error that ended it."""

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.output: RequestOutput | Exception | None = None
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if isinstance(self.output, Exception):  # an error is final
            pass
        elif self.aggregate and isinstance(self.output, RequestOutput) and not isinstance(
                output, Exception):
            self.output.add(output)
        else:
            self.output = output
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


class StatLoggerBase:
    """Receives what /metrics reports; the server's Prometheus logger implements it."""

    def record(
        self,
        scheduler_stats: dict | None,
        core_outputs: list[EngineCoreOutput],
        finished: list[RequestOutput],
    ) -> None:
        raise NotImplementedError


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        show_progress: bool = True,
        stat_loggers: list[StatLoggerBase] | None = None,
    ) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else load_tokenizer(mc.tokenizer_path)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, config.detokenizer_cls)
        self.engine_core = make_async_client(config, show_progress=show_progress)
        self.stat_loggers = list(stat_loggers or [])
        self.scheduler_stats: dict | None = None  # the core's latest counters
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.output_handler: asyncio.Task | None = None
        self.dead_error: EngineDeadError | None = None  # set when the output handler gave up

    @classmethod
    def from_engine_args(cls, args: EngineArgs, show_progress: bool = True, **kwargs) -> "AsyncLLM":
        return cls(args.create_config(), show_progress=show_progress, **kwargs)

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output each time it has new text (cumulative by default, see
        ``SamplingParams.output_kind``); the last one is finished."""
        self._start_output_handler()
        await self.check_health()
        if request_id in self.collectors:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        core_request, text = self.processor.process(request_id, prompt, sampling_params)
        collector = RequestOutputCollector(core_request.sampling_params.output_kind)
        self.collectors[request_id] = collector
        self.output_processor.add_request(
            request_id, text, core_request.prompt_token_ids, core_request.sampling_params,
            core_request.arrival_time,
        )
        finished = False
        try:
            self.engine_core.add_request(core_request)
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            self.collectors.pop(request_id, None)
            if not finished:  # cancelled, closed early, or failed: free its KV blocks
                self._abort([request_id])

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests from outside: their ``generate`` ends with finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        states = self.output_processor.abort_requests(ids)
        self.engine_core.abort_requests(ids)
        for state in states:
            collector = self.collectors.get(state.request_id)
            if collector is not None:
                state.finish_reason = "abort"
                collector.put(state.to_output())

    def _abort(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    # -- the output handler ------------------------------------------------------------------
    def _start_output_handler(self) -> None:
        if self.output_handler is None:
            self.output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                core = await self.engine_core.get_output_async()
                request_outputs, to_abort = self.output_processor.process_outputs(core.outputs)
                for out in request_outputs:
                    collector = self.collectors.get(out.request_id)
                    if collector is not None:
                        collector.put(out)
                if to_abort:  # stop strings the core cannot see
                    self.engine_core.abort_requests(to_abort)
                if core.scheduler_stats is not None:
                    self.scheduler_stats = core.scheduler_stats
                finished = [o for o in request_outputs if o.finished]
                for logger in self.stat_loggers:
                    logger.record(core.scheduler_stats, core.outputs, finished)
        except Exception as e:
            if not isinstance(e, EngineDeadError):  # a bug here: fail loudly, never hang
                traceback.print_exc()
                e = EngineDeadError(f"the output handler failed: {type(e).__name__}: {e}")
            self.dead_error = e
            for collector in self.collectors.values():
                collector.put(e)
            self.output_processor.requests.clear()

    # -- health and inspection ---------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None or self.engine_core.is_dead

    @property
    def is_running(self) -> bool:
        return not self.errored

    async def check_health(self) -> None:
        """Raises EngineDeadError if the core is gone (or the front end cannot reach it)."""
        if self.dead_error is not None:
            raise self.dead_error
        self.engine_core.check_alive()

    async def get_stats(self) -> dict:
        return await self.engine_core.call_utility_async("get_stats")

    async def get_step_trace(self) -> list[dict]:
        return await self.engine_core.call_utility_async("get_step_trace")

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        if self.output_handler is not None:
            self.output_handler.cancel()
        self.engine_core.shutdown()
