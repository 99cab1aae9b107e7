"""The OpenAI-compatible HTTP API over the serving engine (docs/architecture.md, "Serving"): FastAPI on uvicorn.

`POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent events ending in `data: [DONE]`, or
one JSON answer), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus). Errors are OpenAI's JSON shape
(`{"error": {"message", "type", "param", "code"}}`) with the status the API gives them: 400 for a request the model
cannot run (malformed JSON, a field of the wrong type, a prompt past the context, max_tokens < 1, a negative
temperature, an option this server does not implement), 401 for a missing or wrong API key, 404 for an unknown
model or path, 429 when the queue is full. Every choice also carries `token_ids`, the ids its text decodes from (an
extension: what tests and tools compare with `k3compile generate`). The engine runs in its own thread; its events
reach each request's asyncio queue through the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3compile.prefix_cache import PrefixCache
from k3compile.serving.engine import BATCH_WAIT_S, Engine, Event, QueueFull, RequestError, Sampling
from k3compile.serving.engine import Request as EngineRequest
from k3compile.serving.metrics import Metrics

Number = StrictInt | StrictFloat
MAX_STOPS = 4  # as OpenAI's API
DEFAULT_CACHE_BYTES = 1 << 30


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Body(BaseModel):
    """What both endpoints take; fields this server does not know are ignored (clients send many), known ones are
    checked strictly (a string where a number goes is a 400, never coerced)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt = 1
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    ignore_eos: StrictBool = False  # an extension (as vLLM's): generate max_tokens tokens whatever the model picks


class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[_Part] | None = None


class ChatBody(_Body):
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    tools: Any = None


class CompletionBody(_Body):
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)] | Annotated[
        list[StrictStr], Field(min_length=1)] | Annotated[list[list[StrictInt]], Field(min_length=1)]
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


def _unsupported(body: _Body) -> None:
    """Options of the API this server does not implement, refused rather than ignored (an answer that silently
    differs from what was asked is worse than an error)."""
    checks = [("n", body.n != 1, "n must be 1"), ("logprobs", bool(body.logprobs), "logprobs are not supported"),
              ("presence_penalty", body.presence_penalty != 0, "presence_penalty is not supported"),
              ("frequency_penalty", body.frequency_penalty != 0, "frequency_penalty is not supported"),
              ("logit_bias", bool(body.logit_bias), "logit_bias is not supported")]
    if isinstance(body, CompletionBody):
        checks += [("echo", body.echo, "echo is not supported"),
                   ("best_of", body.best_of not in (None, 1), "best_of must be 1"),
                   ("suffix", bool(body.suffix), "suffix is not supported")]
    if isinstance(body, ChatBody):
        checks.append(("tools", bool(body.tools), "tools are not supported"))
    for param, bad, message in checks:
        if bad:
            raise ApiError(400, message, param=param)


ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class _Gate:
    """The API key's check and the request counter (by endpoint and status), as plain ASGI middleware. Starlette's
    `@app.middleware("http")` (BaseHTTPMiddleware) passed every chunk of a streamed answer through a stream and a
    task switch of its own: ~40 % of the event loop's time per streamed token (k3-small, 8 streams, cProfile), time
    the loop takes from the model's threads on a machine of few cores (docs/architecture.md, "Serving")."""

    def __init__(self, app, api_key: str | None, metrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        known = path if path in ENDPOINTS else "other"
        if self.api_key is not None and path != "/health":
            header = Headers(scope=scope).get("authorization", "")
            given = header[7:] if header[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                self.metrics.requests.labels(known, "401").inc()
                await ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error",
                               code="invalid_api_key").response()(scope, receive, send)
                return

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(known, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def create_app(engine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The ASGI app over a started `engine` (serving/engine.py), answering to `model_name`."""
    app = FastAPI(title="k3compile", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics
    tokenizer = engine.tokenizer
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        else:
            message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid')}"
        return ApiError(400, message, param=".".join(where) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return ApiError(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else
                        "invalid_request_error").response()

    app.add_middleware(_Gate, api_key=api_key, metrics=metrics)

    @app.get("/health")
    async def health():
        failure = getattr(engine.backend, "failure", None)  # a sharded artifact whose rank died (backends/sharded.py)
        if failure is not None:
            return JSONResponse({"status": "failed", "model": model_name, "error": failure}, status_code=503)
        return {"status": "ok", "model": model_name, "running": engine.running, "queued": engine.queue_depth}

    @app.get("/metrics")
    async def _metrics():
        return Response(metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "k3compile", "max_model_len": engine.context}]}

    def sampling(body: _Body, prompt: list[int], max_tokens: int | None) -> Sampling:
        if body.model != model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist here (this server serves {model_name!r})",
                           "not_found_error", param="model", code="model_not_found")
        _unsupported(body)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOPS or any(not s for s in stop):
            raise ApiError(400, f"stop takes up to {MAX_STOPS} non-empty strings", param="stop")
        if max_tokens is None:
            max_tokens = engine.context - len(prompt)
            if max_tokens < 1:
                raise ApiError(400, f"the prompt's {len(prompt)} tokens fill the model's context of {engine.context} "
                                    "tokens", param="messages")
        s = Sampling(max_tokens, float(body.temperature), float(body.top_p), body.seed, tuple(stop), body.ignore_eos)
        try:
            engine.check(prompt, s)
        except RequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        return s

    def encode(fn, *args) -> list[int]:
        from k3compile.tokenizer import TokenizerError

        if tokenizer is None:
            raise ApiError(400, "this model ships no tokenizer: give the prompt as token ids (/v1/completions)",
                           param="prompt")
        try:
            return fn(*args)
        except TokenizerError as e:
            raise ApiError(400, str(e)) from None

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        messages = []
        for m in body.messages:
            if isinstance(m.content, list):
                if any(p.type != "text" or p.text is None for p in m.content):
                    raise ApiError(400, "message content parts must be text parts", param="messages")
                content = "".join(p.text for p in m.content)
            else:
                content = m.content or ""
            messages.append({"role": m.role, "content": content})
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        prompt = encode(tokenizer.encode_chat if tokenizer else None, messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, body, [prompt], sampling(body, prompt, max_tokens), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        p = body.prompt
        if isinstance(p, str):
            prompts = [encode(tokenizer.encode if tokenizer else None, p)]
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif all(isinstance(x, str) for x in p):
            prompts = [encode(tokenizer.encode if tokenizer else None, x) for x in p]
        else:
            prompts = [list(x) for x in p]
        if any(not x for x in prompts):
            raise ApiError(400, "a prompt encodes to no tokens", param="prompt")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        s = [sampling(body, x, max_tokens) for x in prompts][0]
        return await respond(request, body, prompts, s, chat=False)

    async def respond(http: Request, body: _Body, prompts: list[list[int]], s: Sampling, chat: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emitter(index: int):
            def emit(event: Event) -> None:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (index, event))
                except RuntimeError:  # the loop is closed: the server is going down
                    pass
            return emit

        requests = [EngineRequest(p, s, emitter(i)) for i, p in enumerate(prompts)]
        try:
            for r in requests:
                engine.submit(r)
        except QueueFull as e:
            for r in requests:
                r.cancel()
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        except RequestError as e:
            for r in requests:
                r.cancel()
            raise ApiError(400, str(e), param=e.param) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(queue, requests, rid, kind, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts = [""] * len(requests)
        ids: list[list[int]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        try:
            while any(f is None for f in finish):
                try:
                    index, event = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if await http.is_disconnected():
                        return Response(status_code=499)
                    continue
                if event.kind == "error":
                    raise ApiError(500, event.message, "server_error")
                if event.kind == "token":
                    texts[index] += event.text
                    ids[index] += event.token_ids
                elif event.kind == "done":
                    finish[index] = event.finish_reason
        finally:
            for r in requests:
                r.cancel()  # finished ones are gone already; the rest (an error, a client gone) free their rows
        choices = []
        for i in range(len(requests)):
            choice = {"index": i, "finish_reason": finish[i], "token_ids": ids[i]}
            choice.update({"message": {"role": "assistant", "content": texts[i]}} if chat
                          else {"text": texts[i], "logprobs": None})
            choices.append(choice)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name, "choices": choices,
                "usage": _usage(requests)}

    async def _stream(queue, requests, rid, kind, chat, include_usage):
        chunk_kind = "chat.completion.chunk" if chat else kind
        created_at = int(time.time())

        def chunk(choices, **extra) -> str:
            doc = {"id": rid, "object": chunk_kind, "created": created_at, "model": model_name, "choices": choices,
                   **extra}
            return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"

        open_ = len(requests)
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                             for i in range(len(requests))])
            while open_:
                index, event = await queue.get()
                if event.kind == "error":
                    yield f"data: {json.dumps(error_body(event.message, 'server_error'))}\n\n"
                    break
                if event.kind == "token":
                    body = {"delta": {"content": event.text}} if chat else {"text": event.text, "logprobs": None}
                    yield chunk([{"index": index, **body, "finish_reason": None, "token_ids": event.token_ids}])
                elif event.kind == "done":
                    open_ -= 1
                    body = {"delta": {}} if chat else {"text": "", "logprobs": None}
                    yield chunk([{"index": index, **body, "finish_reason": event.finish_reason, "token_ids": []}])
            if include_usage and not open_:
                yield chunk([], usage=_usage(requests))
            yield "data: [DONE]\n\n"
        finally:
            for r in requests:
                r.cancel()

    def _usage(requests) -> dict:
        prompt = sum(len(r.prompt) for r in requests)
        completion = sum(len(r.tokens) for r in requests)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in requests)}}

    return app


def create_server(backend, tokenizer, model_name: str, api_key: str | None = None, max_batch: int = 8,
                  max_queue: int = 64, prefill_chunk: int | None = None, cache_block: int = 256,
                  cache_bytes: int = DEFAULT_CACHE_BYTES, batch_wait: float = BATCH_WAIT_S):
    """(the ASGI app, its started engine) for `backend`: what `k3compile serve` runs."""
    cache = PrefixCache(backend.config, cache_block, cache_bytes) if cache_bytes else None
    engine = Engine(backend, tokenizer, max_batch, max_queue, prefill_chunk, cache, Metrics(), batch_wait).start()
    app = create_app(engine, model_name, api_key)
    app.state.model_name = model_name
    return app, engine


def serve(app: FastAPI, host: str, port: int, on_ready=None) -> None:
    """Run `app` on uvicorn, bound to host:port (port 0: a free one); `on_ready(host, port)` once it listens."""
    import socket

    import uvicorn

    from k3compile.errors import UserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    if on_ready is not None:
        on_ready(host, bound)
    server.run(sockets=[sock])
