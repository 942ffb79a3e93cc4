"""Anthropic's Messages API on the same engine core, keys, tenants and limits as the OpenAI routes:
``POST /v1/messages`` (whole, or streamed as Anthropic's events) and ``POST /v1/messages/count_tokens``.

The key comes as ``x-api-key`` (Anthropic's clients) or ``Authorization: Bearer``. Usage is Anthropic's: the
prompt's tokens the prefix cache held are ``cache_read_input_tokens`` and ``input_tokens`` counts only those
computed (their sum is the prompt); ``cache_creation_input_tokens`` is 0 (caching is automatic, nothing is billed
for writing it). A stream is ``message_start``, ``ping``, then per content block ``content_block_start`` /
``content_block_delta`` (``text_delta``, ``input_json_delta``) / ``content_block_stop``, then ``message_delta``
(stop reason, output tokens) and ``message_stop``; a failure mid-stream is an ``error`` event. Errors are
Anthropic-shaped: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.kv.paged.tenants import tenant_of
from engine.server.anthropic_request import openai_body, parse_messages
from engine.server.app import _check_key, _read_body, log, whole_reply
from engine.server.errors import ApiError, from_exception
from engine.server.schemas import check_model, parse_body, parse_chat

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def anthropic_route(fn):
    async def route(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as e:  # noqa: BLE001 - every failure Anthropic-shaped; a bug is one line in the log
            err = from_exception(e)
            if not isinstance(e, ApiError):
                log.error("%s %s failed: %s: %s", request.method, request.url.path, type(e).__name__, str(e)[:200])
            return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)

    route.__name__ = fn.__name__
    return route


def usage(data: dict) -> dict:
    cached = data.get("cached_tokens", 0)
    return {"input_tokens": data["prompt_tokens"] - cached, "output_tokens": data.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(data: dict) -> tuple[str, str | None]:
    seq = data.get("stop_sequence")
    if seq is not None and data["finish_reason"] == "stop":
        return "stop_sequence", seq
    return STOP_REASONS.get(data["finish_reason"], "end_turn"), None


def blocks(data: dict) -> list[dict]:
    out = [{"type": "text", "text": data["text"]}] if data["text"] else []
    for c in data.get("tool_calls") or []:
        out.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
    return out


def whole(msg_id: str, model: str, data: dict) -> dict:
    reason, seq = stop_reason(data)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": blocks(data),
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(data),
            "kvscope": {"cache": data["cache"]} if data.get("cache") is not None else {}}


async def _start(request: Request, parse):
    server = request.app.state.server
    key = _check_key(request)
    raw = await _read_body(request, server.max_body)
    body = await asyncio.get_running_loop().run_in_executor(None, parse_body, raw) if len(raw) > 65536 \
        else parse_body(raw)
    req = parse(body)
    check_model(req, server.model_ids)
    return server, req, tenant_of(key, req.cache_salt)


@anthropic_route
async def messages(request: Request) -> Response:
    server, req, tenant = await _start(request, parse_messages)
    prepared = await server.scheduler.prepare(req, tenant)
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    job = server.scheduler.submit(req, asyncio.get_running_loop(), prepared, msg_id, tenant)
    if req.stream:
        return EventSourceResponse(_events(job, msg_id, server.model_id), sep="\n", ping=15)
    return await whole_reply(request, job, lambda data: whole(msg_id, server.model_id, data))


def _event(kind: str, **fields) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **fields})}


async def _events(job, msg_id: str, model: str) -> AsyncIterator[dict]:
    """Anthropic's event sequence for one streamed reply."""
    index, text_open = 0, False
    try:
        kind, data = await job.next()
        if kind == "error":
            yield _event("error", error=error_body(data)["error"])
            return
        start = {"prompt_tokens": data["prompt_tokens"], "cached_tokens": data["cached_tokens"]}
        yield _event("message_start", message={"id": msg_id, "type": "message", "role": "assistant", "model": model,
                                               "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": usage(start)})
        yield _event("ping")
        while True:
            kind, data = await job.next()
            if kind == "delta" and data[0]:
                if not text_open:
                    yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": data[0]})
            elif kind == "error":
                yield _event("error", error=error_body(data)["error"])
                return
            elif kind == "done":
                if text_open:
                    yield _event("content_block_stop", index=index)
                    index += 1
                for c in data.get("tool_calls") or []:
                    yield _event("content_block_start", index=index,
                                 content_block={"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
                    yield _event("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": c.arguments})
                    yield _event("content_block_stop", index=index)
                    index += 1
                reason, seq = stop_reason(data)
                yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                             usage={"output_tokens": data["completion_tokens"]})
                yield _event("message_stop")
                return
    finally:
        if not job.finished:
            job.cancel()


@anthropic_route
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model's template renders it (no reply is generated)."""
    from engine.server.render import render_messages

    server, req, tenant = await _start(request, lambda body: parse_chat(openai_body(body, count_only=True)))
    tok, tokenizing = server.lm.tokenizer, server.scheduler.tokenizing
    if tok is None:
        raise ApiError(503, "this model has no tokenizer", "server_error", None, "no_tokenizer")

    def count() -> int:  # as a request would feed it: the ids of this tenant's earlier replies spliced in
        return len(tokenizing.with_replies(render_messages(tok, req.messages, req.tools), req.messages, tenant))

    return JSONResponse({"input_tokens": await asyncio.get_running_loop().run_in_executor(tokenizing.small, count)})


def routes() -> tuple[Route, ...]:
    return (Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]))


__all__ = ["routes"]
