"""An OpenAI-compatible server over HTTP, as KV Scope's remote view needs it: models, KV event sources, Prometheus
metrics and streamed chat replies with their token ids. Standard library only (``http.client``), so the frozen
app needs no HTTP package; every failure is a ``RemoteError`` with one line a user can act on.

The server is not trusted: each request has a deadline over all of it (``engine.remote.guard.Watchdog``), each
answer a size cap, each streamed reply the bounds of ``engine.remote.sse``, and every field read is checked for
its type; what the server says is printed only as safe text.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from engine.errors import EngineError
from engine.remote import sse
from engine.remote.budget import is_context_refusal
from engine.remote.guard import (ERROR_BODY_BYTES, METRICS_MAX_BYTES, MODELS_MAX_BYTES, SOURCES_MAX_BYTES, TooLarge,
                                 Watchdog, printable, read_capped, size_words)
from engine.remote.metrics import Metrics, metrics_of, parse_prometheus  # noqa: F401 - their home before
from engine.remote.wire import MAX_RANKS

CHAT_FIRST_BYTE_S = 120.0  # a reply's headers and first token may wait on a long prefill or a queue
MAX_MODELS = 10_000
DETOKENIZE_MAX = 16  # token ids sent to /detokenize at once (a divergence is said in a few tokens)
DETOKENIZE_S = 3.0  # its deadline: the reply's account waits for it
MAX_ID = 512  # a model id (a path or a hub name with a LoRA suffix is under 200)
# Chunks parsed from one read are ~10 µs apart; no server streams a token in 50 µs (stories260K on its compiled
# step: ~0.8 ms apart on loopback, which a 1 ms "burst" rule took for one burst)
TOGETHER_S = 5e-5


class RemoteError(EngineError):
    """The server cannot be used as asked: refused, unreachable, wrong key, not OpenAI-compatible, gone."""


class ContextRefused(RemoteError):
    """The server refused a reply's ``max_tokens`` beside its prompt: more than the model's context."""


@dataclass
class Reply:
    """A streamed chat reply. ``error`` set: it ended early (the text so far is kept)."""
    text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    usage: dict = field(default_factory=dict)
    finish_reason: str | None = None
    ttft_s: float | None = None  # request sent → first token's text
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk with text (monotonic)
    token_reads: list[int] = field(default_factory=list)  # which socket read of the stream each of them came in
    error: str | None = None
    sent_at: float = 0.0  # when the request was sent, and when its stream ended (monotonic)
    finished_at: float = 0.0
    cache: Any = None  # why its prompt was recomputed (``engine.remote.why``: a CacheAccount), once known
    budget: Any = None  # ``engine.remote.budget.TokenBudget`` when max_tokens was fitted to the server's context

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        return cached if type(cached) is int and cached >= 0 else 0

    @property
    def decode_tokens_per_s(self) -> float:
        t = self.token_times
        n = max(len(self.token_ids), len(t)) - 1
        return n / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0

    def together(self, i: int) -> bool:
        """Chunk ``i`` came in the same socket read as the one before (buffered on the way: its arrival time is
        that read's, not the server's pace). Without read numbers (a reply built elsewhere): within
        ``TOGETHER_S`` of it."""
        if i < 1 or i >= len(self.token_times):
            return False
        if len(self.token_reads) == len(self.token_times):
            return self.token_reads[i] == self.token_reads[i - 1]
        return self.token_times[i] - self.token_times[i - 1] < TOGETHER_S

    @property
    def in_one_burst(self) -> bool:
        """All its chunks (more than two) came in one or two reads: their arrival says nothing of the pace."""
        n = len(self.token_times)
        return n > 2 and n - sum(self.together(i) for i in range(1, n)) <= 2


class RemoteClient:
    """One server at ``url`` (``http://host:port``, with or without ``/v1``). ``timeout``: seconds for a whole
    GET (connect, headers and body) and for each read of a streamed reply."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0) -> None:
        u = urlsplit(url.strip())
        try:
            port = u.port
        except ValueError:
            port = -1
        if u.scheme not in ("http", "https") or not u.hostname or port == -1:
            raise RemoteError(f"{printable(url)!r} is not a server address: give http://HOST:PORT (or https://)")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = port or (443 if u.scheme == "https" else 80)
        path = u.path.rstrip("/")
        self.prefix = path[:-3] if path.endswith("/v1") else path
        self.url = f"{u.scheme}://{u.netloc}{self.prefix}"
        if api_key and not (api_key.isprintable() and api_key.isascii() and not any(c.isspace() for c in api_key)):
            raise RemoteError("the API key has characters an HTTP header cannot carry: give it as printable ASCII "
                              "without spaces")
        self.api_key, self.timeout = api_key or None, timeout
        self.contexts: dict[str, int] = {}  # model id -> max_model_len, as /v1/models reported (``models``)

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _headers(self, body: bool = False) -> dict:
        h = {"Accept": "application/json"}
        if body:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _open(self, method: str, path: str, body: dict | None = None, timeout: float | None = None,
              total: float | None = None, cancel: threading.Event | None = None):
        """(connection, response, watchdog) once the headers came; ``timeout`` bounds each read, ``total`` the
        request until now (the watchdog stays armed for the caller, who closes it)."""
        t = self.timeout if timeout is None else timeout
        total = t if total is None else total
        conn = self._conn(t)
        wd = Watchdog(conn, time.monotonic() + total, f"{self.url} did not answer {method} {path} within "
                                                      f"{total:g} s", cancel)
        try:
            conn.request(method, self.prefix + path, json.dumps(body) if body is not None else None,
                         self._headers(body is not None))
            sock = wd.sock = conn.sock  # a response that closes the connection takes it over: ``conn.sock`` goes None
            resp = conn.getresponse()
            resp.stream_socket = sock
        except BaseException as e:
            wd.close()
            conn.close()
            if isinstance(e, Exception) and wd.fired:
                raise RemoteError(wd.fired) from None
            raise self._failure(e, t) from None
        if wd.fired:  # the headers were cut by the deadline: what came is not the server's answer
            wd.close()
            conn.close()
            raise RemoteError(wd.fired)
        if resp.status == 401:
            wd.close()
            conn.close()
            raise RemoteError(f"{self.url} refused the API key (401): give the key the server was started with")
        return conn, resp, wd

    def _failure(self, e: BaseException, read_s: float) -> BaseException:
        """The one line for a request that failed before its headers came (``e`` itself if not the network's)."""
        if isinstance(e, ConnectionRefusedError):
            return RemoteError(f"{self.url} refused the connection: is the server running on that port?")
        if isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
                          http.client.RemoteDisconnected)):
            return RemoteError(f"{self.url} closed the connection: the server went away or is restarting")
        if isinstance(e, socket.gaierror):
            return RemoteError(f"{self.host}: no such host")
        if isinstance(e, (socket.timeout, TimeoutError)):
            return RemoteError(f"{self.url} did not answer within {read_s:g} s")
        if isinstance(e, OSError):
            return RemoteError(f"{self.url}: {e.strerror or e}")
        if isinstance(e, http.client.HTTPException):  # a status line or headers that are not HTTP, or too many
            return RemoteError(f"{self.url} did not answer in HTTP ({type(e).__name__}: {printable(e, 80)})")
        return e

    def get(self, path: str, limit: int = MODELS_MAX_BYTES) -> tuple[int, bytes]:
        """(status, body) of ``GET path``: all of it within ``timeout`` seconds and ``limit`` bytes."""
        conn, resp, wd = self._open("GET", path)
        try:
            raw = read_capped(resp, limit)
            if wd.fired:
                raise RemoteError(wd.fired)
            return resp.status, raw
        except TooLarge as e:
            size = f" ({size_words(e.args[0])} declared)" if e.args[0] else ""
            raise RemoteError(f"{self.url}: GET {path} answered more than {size_words(limit)}{size}, more than any "
                              "server's: refused") from None
        except (socket.timeout, TimeoutError):
            raise RemoteError(wd.fired or f"{self.url}: GET {path} stalled (nothing for {self.timeout:g} s)") from None
        except (OSError, http.client.HTTPException) as e:
            raise RemoteError(wd.fired or f"{self.url}: GET {path} was cut off ({type(e).__name__})") from None
        finally:
            wd.close()
            conn.close()

    def _json(self, path: str, limit: int) -> tuple[int, object]:
        status, raw = self.get(path, limit)
        try:
            return status, json.loads(raw)
        except (ValueError, RecursionError):
            return status, None

    def models(self) -> list[str]:
        """The served model ids; ``RemoteError`` when the server does not answer like the OpenAI API."""
        status, data = self._json("/v1/models", MODELS_MAX_BYTES)
        data = data.get("data") if isinstance(data, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
            raise RemoteError(f"{self.url} is not an OpenAI-compatible server (GET /v1/models answered {status} "
                              f"without a model list)")
        ids = [m.get("id") for m in data[:MAX_MODELS + 1]]
        # each model's context (vLLM's and KV Scope's ``max_model_len``): a reply's max_tokens is fitted to it
        self.contexts = {m.get("id"): m["max_model_len"] for m in data[:MAX_MODELS]
                         if type(m.get("max_model_len")) is int and 0 < m["max_model_len"] < 1 << 40}
        if len(ids) > MAX_MODELS:
            raise RemoteError(f"{self.url}: GET /v1/models lists more than {MAX_MODELS:,} models")
        if not all(isinstance(i, str) and 0 < len(i) <= MAX_ID and i.isprintable() for i in ids):
            raise RemoteError(f"{self.url}: GET /v1/models lists model ids that are not names (printable text of "
                              f"at most {MAX_ID} characters)")
        return ids

    def event_sources(self) -> dict[int, dict]:
        """Each engine's KV events config by data-parallel rank (``{}``: events off, or the server lacks it);
        ``RemoteError`` for one that names ranks or fields no server sends."""
        status, data = self._json("/kv_event_sources", SOURCES_MAX_BYTES)
        if status != 200 or not isinstance(data, dict):
            return {}
        if len(data) > MAX_RANKS:
            raise RemoteError(f"{self.url} advertises {len(data):,} KV event sources (data-parallel ranks): more "
                              f"than the {MAX_RANKS} a remote view follows")
        out = {}
        for key, cfg in data.items():
            if not (key.isascii() and key.isdigit() and int(key) < MAX_RANKS):
                raise RemoteError(f"{self.url}: /kv_event_sources names rank {printable(key, 40)!r}: ranks are 0 to "
                                  f"{MAX_RANKS - 1}")
            if isinstance(cfg, dict):
                out[int(key)] = self._source(int(key), cfg)
        return out

    def _source(self, rank: int, cfg: dict) -> dict:
        on = cfg.get("enable_kv_cache_events", True)
        if not isinstance(on, bool):
            raise RemoteError(f"{self.url}: /kv_event_sources rank {rank}: enable_kv_cache_events is not true/false")
        out = {"enable_kv_cache_events": on}
        for name in ("endpoint", "replay_endpoint", "topic"):
            value = cfg.get(name)
            if value is not None and not (isinstance(value, str) and len(value) <= 256 and value.isprintable()):
                raise RemoteError(f"{self.url}: /kv_event_sources rank {rank}: {name} {printable(repr(value), 40)} "
                                  "is not an address or topic (printable text of at most 256 characters)")
            out[name] = value
        return out

    def metrics(self) -> Metrics:
        status, raw = self.get("/metrics", METRICS_MAX_BYTES)
        return metrics_of(raw.decode("utf-8", "replace")) if status == 200 else Metrics()

    def chat(self, model: str, messages: list[dict], max_tokens: int | None = None, temperature: float = 0.0,
             on_delta=None, cancel: threading.Event | None = None, reply: Reply | None = None) -> Reply:
        """Stream one chat reply (``on_delta(text, token_ids)`` per chunk). A failure before the first byte
        raises ``RemoteError``; one during the stream ends the ``Reply`` with ``error`` (text kept). ``reply``:
        the object to fill (an ``on_delta`` that holds it reads ``prompt_ids`` as soon as they arrive)."""
        body = {"model": model, "messages": messages, "stream": True, "temperature": temperature,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        idle = max(self.timeout, CHAT_FIRST_BYTE_S)
        caps = sse.StreamCaps.of(max_tokens or self.contexts.get(model), idle)
        sent = time.monotonic()
        reply = reply if reply is not None else Reply()
        reply.sent_at = sent
        conn, resp, wd = self._open("POST", "/v1/chat/completions", body, timeout=idle, total=idle, cancel=cancel)
        try:
            if resp.status != 200:
                why = self._error_body(resp)
                refused = ContextRefused if resp.status == 400 and is_context_refusal(why) else RemoteError
                raise refused(f"the server refused the request ({resp.status}): {why}")
            done = sse.read_stream(resp, reply, sent, on_delta, cancel, wd, caps, idle, self.url)
            if wd.fired and not done:
                reply.error = f"{wd.fired}; the text so far is kept"
        except sse.StreamError as e:
            reply.error = f"{e}; the text so far is kept"
        except (OSError, http.client.HTTPException) as e:
            if not (cancel is not None and cancel.is_set()):  # else: the read ended because Stop hung up
                reply.error = wd.fired or f"the server went away mid-reply ({e or type(e).__name__})"
                reply.error += "; the text so far is kept"
        finally:
            wd.close()
            conn.close()
            reply.finished_at = time.monotonic()
        if cancel is not None and cancel.is_set() and reply.error is None and reply.finish_reason is None:
            reply.finish_reason = "cancelled"
        if reply.error is None and reply.finish_reason is None:
            reply.error = "the stream ended without a finish reason (the server closed it); the text so far is kept"
        return reply

    def detokenize(self, model: str, ids: list[int]) -> str | None:
        """The text of a few token ids (vLLM's ``POST /detokenize``); None when the server has no such endpoint or
        answers something else."""
        body = {"model": model, "tokens": [int(i) for i in ids[:DETOKENIZE_MAX]]}
        try:
            conn, resp, wd = self._open("POST", "/detokenize", body, timeout=min(self.timeout, DETOKENIZE_S))
        except RemoteError:
            return None
        try:
            raw = read_capped(resp, ERROR_BODY_BYTES) if resp.status == 200 else b""
            text = json.loads(raw).get("prompt") if raw and not wd.fired else None
        except (TooLarge, OSError, http.client.HTTPException, ValueError, RecursionError, AttributeError):
            text = None
        finally:
            wd.close()
            conn.close()
        return printable(text.replace("\n", "\\n"), 200) if isinstance(text, str) else None

    @staticmethod
    def _error_body(resp) -> str:
        try:
            raw = resp.read(ERROR_BODY_BYTES)
        except (OSError, http.client.HTTPException):
            return "no body"
        try:
            return sse.error_message(json.loads(raw))
        except (ValueError, RecursionError):
            return printable(raw[:200].decode("utf-8", "replace").splitlines()[0]) if raw.strip() else "no body"
