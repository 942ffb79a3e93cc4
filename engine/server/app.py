"""The HTTP routes (Starlette): ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/health``,
``/metrics``. Request handling only; the engine runs on the scheduler's thread (``engine.server.scheduler``).

Every error is OpenAI-shaped JSON (``engine.server.errors``): the route's own, Starlette's 404/405, and any
bug (500, no traceback). ``/v1/*``, ``/kv_event_sources`` and ``/metrics`` need ``Authorization: Bearer KEY``
when the server has a key (``/metrics`` not with ``--metrics-public``: a shared server's request and token counts
tell one tenant when another is busy); ``/health`` never does: it says "ok" to anyone (a load balancer has no
key), and its queue lengths and compiled-step state only to a key holder (or with ``--metrics-public``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
from typing import Any, AsyncIterator, Callable

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from engine.kv.paged.tenants import tenant_of
from engine.server.errors import ApiError, bad_request, from_exception
from engine.server.replies import Shape
from engine.server.schemas import check_model, parse_body, parse_chat, parse_completion

log = logging.getLogger("kvscope.server")
METRICS_WAIT_S = 10.0
LOOP_PARSE_BYTES = 64 * 1024  # request bodies parsed on the event loop; larger ones in a worker thread


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)  # type: ignore[arg-type]


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or "error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return error_response(ApiError(status, f"{detail}: {request.method} {request.url.path}", "invalid_request_error",
                                   None, code))


async def _bug(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, str(exc)[:200])
    return error_response(from_exception(exc))


def _check_key(request: Request) -> str | None:
    """The API key the request was sent with (None when the server has none); 401 for a wrong or missing one.
    Every key is compared, in constant time, so the time taken says nothing about which one came close."""
    keys = request.app.state.server.api_keys
    if not keys:
        return None
    given = request.headers.get("authorization", "")
    if not given and request.headers.get("x-api-key"):  # Anthropic's clients send the key this way
        given = "Bearer " + request.headers["x-api-key"]
    scheme, _, token = given.partition(" ")
    token_b = token.strip().encode("latin-1", "replace")
    found = None
    for key in keys:
        if hmac.compare_digest(token_b, key.encode()):
            found = key
    if scheme.lower() != "bearer" or found is None:
        raise ApiError(401, "Incorrect API key provided: send it as 'Authorization: Bearer KEY'" if given else
                       "Missing API key: send it as 'Authorization: Bearer KEY'", "invalid_request_error", None,
                       "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return found


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, 413 past ``limit`` bytes (told by Content-Length or found while reading)."""
    too_big = ApiError(413, f"the request body is larger than {limit} bytes", "invalid_request_error", None,
                       "request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def api(fn):
    """A route whose every failure is an OpenAI-shaped response (a bug: 500, one line in the log)."""

    async def route(request: Request) -> Response:
        try:
            return await fn(request)
        except ApiError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - a bug: one line in the log, no traceback to the client
            return await _bug(request, e)

    route.__name__ = fn.__name__
    return route


@api
async def models(request: Request) -> Response:
    _check_key(request)
    server = request.app.state.server
    info = server.lm.info
    return JSONResponse({"object": "list", "data": [{
        "id": server.model_id, "object": "model", "created": server.created, "owned_by": "kvscope",
        "max_model_len": info.context_length}]})


async def health(request: Request) -> Response:
    """Open to all (a load balancer has no key); with keys, the queue and step state only to a key holder."""
    server = request.app.state.server
    ok = server.scheduler.alive
    if server.api_keys and not server.options.metrics_public:
        try:
            _check_key(request)
        except ApiError:
            return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)
    fast = server.lm.fast_step  # read from this thread: a state string and its reason, both plain attributes
    off = {"state": "off", "reason": ""}
    step = {"state": fast.state, "reason": fast.reason} if fast is not None else off
    b = fast.batch if fast is not None else None
    batch = {"state": b.state, "reason": b.reason} if b is not None else off
    return JSONResponse({"status": "ok" if ok else "stopped", "model": server.model_id,
                         "running": server.scheduler.running, "waiting": server.scheduler.waiting,
                         "compiled_step": step, "compiled_batch_step": batch}, status_code=200 if ok else 503)


@api
async def metrics(request: Request) -> Response:
    server = request.app.state.server
    if not server.options.metrics_public:
        _check_key(request)
    try:
        gauges = await asyncio.wait_for(asyncio.wrap_future(server.scheduler.call(server.scheduler.kv_gauges)),
                                        METRICS_WAIT_S)
        server.last_gauges = gauges
    except (asyncio.TimeoutError, RuntimeError, asyncio.CancelledError):
        gauges = dict(server.last_gauges, running=server.scheduler.running, waiting=server.scheduler.waiting)
    return PlainTextResponse(server.metrics.render(gauges), media_type="text/plain; version=0.0.4")


@api
async def kv_event_sources(request: Request) -> Response:
    """Each engine's KV events config, as vLLM answers it (one engine here: ``{"0": {...}}``; ``{}`` when off)."""
    _check_key(request)
    pub = request.app.state.server.kv_events
    source = pub.source() if pub is not None else None  # None: its thread stopped, nothing is published
    return JSONResponse({"0": source} if source is not None else {})


DETOKENIZE_MAX = 4096  # token ids a /detokenize request may hold (a remote account asks for a few)


@api
async def detokenize(request: Request) -> Response:
    """vLLM's ``POST /detokenize``: ``{"model", "tokens": [ids]}`` -> ``{"prompt": text}``. The vocabulary is the
    model's (nothing of any tenant's), so only the key is checked; decoded off the event loop."""
    _check_key(request)
    server = request.app.state.server
    body = parse_body(await _read_body(request, 64 << 10))
    ids, vocab = body.get("tokens"), server.lm.info.vocab_size
    if body.get("model") is not None and body["model"] not in server.model_ids:
        raise ApiError(404, f"The model `{body.get('model')}` does not exist: this server serves "
                       f"`{server.model_id}`", "invalid_request_error", "model", "model_not_found")
    if (not isinstance(ids, list) or len(ids) > DETOKENIZE_MAX
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)):
        raise bad_request(f"tokens: give a list of at most {DETOKENIZE_MAX} token ids (0..{vocab - 1})", "tokens")
    if server.lm.tokenizer is None:
        raise ApiError(503, "this model has no tokenizer", "server_error", None, "no_tokenizer")
    text = await asyncio.to_thread(server.lm.tokenizer.decode, ids)
    return JSONResponse({"prompt": text})


@api
async def chat_completions(request: Request) -> Response:
    return await _generate(request, parse_chat)


@api
async def completions(request: Request) -> Response:
    return await _generate(request, parse_completion)


async def _generate(request: Request, parse) -> Response:
    server = request.app.state.server
    key = _check_key(request)
    raw = await _read_body(request, server.max_body)
    if len(raw) > LOOP_PARSE_BYTES:  # a 3.9 MB body takes ~100 ms to parse: not on the loop every request shares
        body = await asyncio.get_running_loop().run_in_executor(None, parse_body, raw)
    else:
        body = parse_body(raw)
    req = parse(body)
    check_model(req, server.model_ids)
    tenant = tenant_of(key, req.cache_salt)
    prepared = await server.scheduler.prepare(req, tenant)  # rendered and tokenized off the engine thread; 400s here
    shape = Shape(req.kind, server.model_id)
    job = server.scheduler.submit(req, asyncio.get_running_loop(), prepared, shape.id, tenant)
    shape.prompt_ids = prepared.ids if req.return_token_ids else None
    if req.stream:  # the role chunk at once, queued or not; a later failure comes as the stream's last event
        return EventSourceResponse(_events(job, shape, req.include_usage), sep="\n", ping=15)
    return await whole_reply(request, job, shape.whole)


async def whole_reply(request: Request, job, body: Callable[[Any], dict]) -> Response:
    """A reply that is not streamed: ``body`` of the job's last event, once it is done (its error raised); a client
    that goes first cancels the job (499, nothing sent)."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        kind = ""
        while kind != "done":
            kind, data = await _next(job, gone)
            if kind == "error":
                raise data
        return JSONResponse(body(data))
    except ClientGone:
        job.cancel()
        return Response(status_code=499)
    except BaseException:
        job.cancel()
        raise
    finally:
        gone.cancel()


class ClientGone(Exception):
    """The client closed the connection before its reply was complete."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next(job, gone: asyncio.Future) -> tuple[str, Any]:
    """The job's next event, or ``ClientGone`` if the client leaves first (queued or generating)."""
    nxt = asyncio.ensure_future(job.next())
    done, _ = await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
    if nxt in done:
        return nxt.result()
    nxt.cancel()
    raise ClientGone


async def _events(job, shape: "Shape", include_usage: bool) -> AsyncIterator[dict]:
    """Server-sent events of a streamed reply (the SSE framing is sse-starlette's)."""
    try:
        if shape.kind == "chat":
            yield {"data": json.dumps(shape.first_chunk())}
        while True:
            kind, data = await job.next()
            if kind == "start":
                continue
            if kind == "delta":
                text, logprob, token = data
                yield {"data": json.dumps(shape.chunk(text, None, logprob, token))}
            elif kind == "error":
                yield {"data": json.dumps(data.body())}
                return
            elif kind == "done":
                for chunk in shape.tool_chunks(data):
                    yield {"data": json.dumps(chunk)}
                # the cache account rides with the usage: on its chunk, or on this last one when there is none
                yield {"data": json.dumps(shape.last_chunk(data, account=not include_usage))}
                if include_usage:
                    yield {"data": json.dumps(shape.usage_chunk(data))}
                yield {"data": "[DONE]"}
                return
    finally:
        if not job.finished:
            job.cancel()  # the client went away (or the server stops): free the request's pages


def is_loopback(host: str) -> bool:
    """A loopback literal or ``localhost`` (never resolved: the ``Host`` header of every request is asked)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_local_host(host: str) -> bool:
    """True when every address ``host`` names is loopback: a literal and ``localhost`` as they are, any other
    name through the system resolver (``ValueError`` "cannot resolve host" when it knows none)."""
    bare = host.strip("[]")
    if is_loopback(bare):
        return True
    try:
        ipaddress.ip_address(bare)
        return False
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # gaierror; a name the IDNA codec refuses ("a..b")
        raise ValueError(f"cannot resolve host {host!r}: give an address (127.0.0.1) or a name this machine "
                         "resolves") from None
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


class BrowserGuard:
    """Keeps web pages off a key-less local server (ASGI middleware, outermost). A page the user visits can
    POST to 127.0.0.1 (a "simple" text/plain request needs no preflight), and with DNS rebinding read the answer.
    So without an API key: the ``Host`` must name this machine (localhost, a loopback address), and a request
    carrying an ``Origin`` is refused unless ``--cors`` names that origin. With or without a key, a POST must be
    JSON (``Content-Type: application/json``), which a page cannot send cross-origin without a preflight."""

    def __init__(self, app, server, cors: tuple[str, ...]) -> None:
        self.app, self.server, self.cors = app, server, set(cors)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            err = self.refusal(scope)
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not self.server.api_key:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if host and not is_loopback(name.strip("[]")):
                return ApiError(403, f"this server has no API key, so it answers only to this machine (Host: {host}); "
                                "use http://127.0.0.1, or start it with --api-key", "invalid_request_error", None,
                                "host_not_allowed")
            origin = headers.get("origin")
            if origin is not None and origin not in self.cors and "*" not in self.cors:
                return ApiError(403, f"requests from web pages are refused (Origin: {origin}); start the server with "
                                f"--cors {origin} to allow that page", "invalid_request_error", None,
                                "origin_not_allowed")
        if scope.get("method") == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return ApiError(415, f"send the request as JSON (Content-Type: application/json, not "
                                f"{ctype or 'none'})", "invalid_request_error", None, "unsupported_media_type")
        return None


def build_app(server, cors: tuple[str, ...] = (), extra: tuple = ()) -> Starlette:
    """The ASGI app of ``server`` (``engine.server.service.KVServer``); ``extra``: more routes (Anthropic's)."""
    routes = [*extra,
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
    ]
    middleware = [Middleware(BrowserGuard, server=server, cors=tuple(cors))]
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type", "X-Api-Key",
                                                    "Anthropic-Version"]))
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _bug}
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)
    app.state.server = server
    return app


__all__ = ["build_app", "error_response"]
