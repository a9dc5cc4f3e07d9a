"""``minivllm serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn over ``AsyncLLM``).

Start-up order: bind the port (a busy port fails at once, before minutes of loading), load the
model (the engine core process prints its progress bar), start uvicorn on the bound socket,
then print the URL and a ready line. Shutdown (Ctrl-C, SIGTERM) stops uvicorn, then the engine
core process: nothing is left running.

Every client mistake is a 4xx with OpenAI's error shape ``{"error": {...}}``, and the server
keeps serving; a dead engine core makes /health and new requests answer 503.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import socket
import sys
from contextlib import asynccontextmanager

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.config import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.exceptions import EngineDeadError
from minivllm.entrypoints.openai.metrics import CONTENT_TYPE, PrometheusStatLogger
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    openapi_request_body,
    parse_request,
)
from minivllm.entrypoints.openai.serving import OpenAIServing, engine_dead_error, new_request_id
from minivllm.model_hub import BUNDLED_NAME


def error_response(err: RequestError) -> Response:
    # ASCII-escaped JSON: a message may quote what the client sent, lone surrogates included
    return Response(json.dumps(err.to_dict()), status_code=err.status, media_type="application/json")


MAX_REQUEST_BODY_BYTES = 16 * 2**20  # --max-request-body-bytes


class BodyTooLarge(Exception):
    pass


class LimitRequestBody:
    """ASGI middleware: a body over ``max_bytes`` gets 413 before it is read whole. A declared
    Content-Length over the limit is refused before a byte is read; a chunked body is counted
    as it arrives, and reading it fails (``BodyTooLarge``) as soon as it passes the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(self._error())(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> RequestError:
        return RequestError(f"the request body is larger than {self.max_bytes} bytes",
                            status=413, code="request_too_large")


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              stat_logger: PrometheusStatLogger | None = None,
              max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES, chat_stream=None) -> FastAPI:
    """``chat_stream``: replaces the function that streams chat completions (see
    ``serving.chat_completion_stream_generator``)."""
    serving = OpenAIServing(engine, served_model_names, chat_stream)
    limiter = LimitRequestBody(None, max_request_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()  # still inside uvicorn's shutdown: before any signal is re-raised

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.add_middleware(LimitRequestBody, max_bytes=max_request_body_bytes)

    if api_key is not None:  # only then: a middleware costs every request and every chunk

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return error_response(RequestError(
                        "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                        status=401, code="invalid_api_key"))
            return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(RequestError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # a bug: say so, keep serving
        return error_response(RequestError(f"internal error: {type(exc).__name__}: {exc}",
                                           status=500, type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return error_response(engine_dead_error(e))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = stat_logger.render() if stat_logger is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "minivllm",
             "root": engine.config.model_config.model_path,
             "max_model_len": engine.config.model_config.max_model_len}
            for name in served_model_names
        ]}

    async def handle(request: Request, chat: bool) -> Response:
        try:
            try:
                data = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"malformed JSON in the request body: {e}") from None
            except BodyTooLarge:
                raise limiter._error() from None
            req, _ = parse_request(ChatCompletionRequest if chat else CompletionRequest, data)
            model = serving.check_model(req)
            try:
                await engine.check_health()
            except EngineDeadError as e:
                raise engine_dead_error(e) from None
            request_id = new_request_id(chat)
            inputs = serving.chat_inputs(req, request_id) if chat else \
                serving.completion_inputs(req, request_id)
        except RequestError as err:
            return error_response(err)
        gens = serving.generators(inputs, request_id, stream=bool(req.stream))
        if req.stream:
            options = req.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = include_usage and options.continuous_usage_stats
            return StreamingResponse(
                serving.stream_response(chat, request_id, model, gens, include_usage, continuous),
                media_type="text/event-stream")
        try:
            body = await run_until_disconnected(
                request, serving.full_response(chat, request_id, model, gens))
        except EngineDeadError as e:
            return error_response(engine_dead_error(e))
        if body is None:
            return Response(status_code=499)  # the client left; its requests were aborted
        return JSONResponse(body)

    # the handlers read the raw body (strict validation, OpenAI-shaped errors, 413): the schema
    # still describes each body as its pydantic model, so clients and fuzzers know the fields
    @app.post("/v1/completions", openapi_extra=openapi_request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


async def run_until_disconnected(request: Request, coro):
    """Await ``coro``, unless the client disconnects first: then cancel it (aborting its
    requests, freeing their KV blocks) and return None."""
    task = asyncio.ensure_future(coro)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


# -- start-up ---------------------------------------------------------------------------------

def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(args) -> None:
    from minivllm.entrypoints.cli import resolve_model_folder

    names = args.served_model_name or [args.model or BUNDLED_NAME]
    sock = _bind(args.host, args.port)
    try:
        resolve_model_folder(args, "serve")  # converts the bundled model on first use
    except BaseException:
        sock.close()
        raise
    engine_args = EngineArgs.from_cli_args(args)  # includes --multiprocess
    host, port = sock.getsockname()[:2]
    mode = "engine core in its own process" if args.multiprocess else "engine core in-process"
    print(f"minivllm serve: loading {names[0]} ({mode})", flush=True)
    prometheus_client.disable_created_metrics()  # no *_created series, as vLLM
    stat_logger = PrometheusStatLogger(names[0])
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[stat_logger])
    try:
        app = build_app(engine, names, args.api_key, stat_logger,
                        getattr(args, "max_request_body_bytes", MAX_REQUEST_BODY_BYTES))
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=False,
                                timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{port}"
            cfg = engine.config
            print(f"minivllm serve: {names[0]} on {cfg.device_config.device.type}, max_model_len "
                  f"{cfg.model_config.max_model_len}, KV cache {engine.engine_core.num_kv_blocks} "
                  f"blocks of {cfg.cache_config.block_size} tokens", flush=True)
            print(f"minivllm serve: OpenAI-compatible API at {url}/v1 "
                  f"(also {url}/health, {url}/metrics)", flush=True)
            print("minivllm serve: ready. Press Ctrl-C to stop.", flush=True)
        await serving
    finally:
        engine.shutdown()
        sock.close()


def run_server(args) -> int:
    # SIGTERM ends the process like Ctrl-C: through the finally blocks that stop the engine core
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        asyncio.run(serve(args))
    except (KeyboardInterrupt, SystemExit):
        pass
    print("minivllm serve: stopped", flush=True)
    return 0
