"""An OpenAI-compatible server over HTTP, as KV Scope's remote view needs it: models, KV event sources, Prometheus
metrics and streamed chat replies with their token ids. Standard library only (``http.client``), so the frozen
app needs no HTTP package; every failure is a ``RemoteError`` with one line a user can act on.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engine.errors import EngineError


class RemoteError(EngineError):
    """The server cannot be used as asked: refused, unreachable, wrong key, not OpenAI-compatible, gone."""


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
    error: str | None = None

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    @property
    def decode_tokens_per_s(self) -> float:
        t = self.token_times
        n = max(len(self.token_ids), len(t)) - 1
        return n / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0


@dataclass(frozen=True)
class Metrics:
    """The ``vllm:`` facts of ``/metrics`` a cache view uses (0 where the server does not say)."""
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    block_size: int = 0
    num_blocks: int = 0
    cache_info: dict = field(default_factory=dict)  # every label of ``vllm:cache_config_info``


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of each sample line of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = {}
        for part in rest.rstrip("}").split('",'):
            k, eq, v = part.partition('="')
            if eq:
                labels[k.strip(",")] = v.rstrip('"')
        try:
            out.append((name, labels, float(value)))
        except ValueError:
            continue
    return out


def metrics_of(text: str) -> Metrics:
    """The cache facts of a ``/metrics`` page; several engines (data-parallel ranks): usage averaged, counters
    summed, blocks summed."""
    sums: dict[str, list[float]] = {}
    info: dict = {}
    blocks = 0
    for name, labels, value in parse_prometheus(text):
        sums.setdefault(name, []).append(value)
        if name == "vllm:cache_config_info":
            info = labels
            blocks += int(labels.get("num_gpu_blocks") or 0) if labels.get("num_gpu_blocks", "None") != "None" else 0

    def total(n: str) -> float:
        return sum(sums.get(n, [0.0]))

    usage = sums.get("vllm:kv_cache_usage_perc") or sums.get("vllm:gpu_cache_usage_perc") or [0.0]
    bs = info.get("block_size", "0")
    return Metrics(sum(usage) / len(usage), total("vllm:prefix_cache_queries_total"),
                   total("vllm:prefix_cache_hits_total"), total("vllm:num_preemptions_total"),
                   int(bs) if bs.isdigit() else 0, blocks, info)


class RemoteClient:
    """One server at ``url`` (``http://host:port``, with or without ``/v1``)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 10.0) -> None:
        u = urlsplit(url.strip())
        if u.scheme not in ("http", "https") or not u.hostname:
            raise RemoteError(f"{url!r} is not a server address: give http://HOST:PORT (or https://)")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        path = u.path.rstrip("/")
        self.prefix = path[:-3] if path.endswith("/v1") else path
        self.url = f"{u.scheme}://{u.netloc}{self.prefix}"
        self.api_key, self.timeout = api_key or None, timeout

    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        t = self.timeout if timeout is None else timeout
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=t, context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=t)

    def _headers(self, body: bool = False) -> dict:
        h = {"Accept": "application/json"}
        if body:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _open(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        conn = self._conn(timeout)
        try:
            conn.request(method, self.prefix + path, json.dumps(body) if body is not None else None,
                         self._headers(body is not None))
            sock = conn.sock  # a response that closes the connection takes it over, and ``conn.sock`` goes None
            resp = conn.getresponse()
            resp.stream_socket = sock
        except ConnectionRefusedError:
            conn.close()
            raise RemoteError(f"{self.url} refused the connection: is the server running on that port?") from None
        except (ConnectionResetError, ConnectionAbortedError, http.client.RemoteDisconnected):
            conn.close()
            raise RemoteError(f"{self.url} closed the connection: the server went away or is restarting") from None
        except socket.gaierror:
            conn.close()
            raise RemoteError(f"{self.host}: no such host") from None
        except (socket.timeout, TimeoutError):
            conn.close()
            raise RemoteError(f"{self.url} did not answer within {self.timeout:g} s") from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise RemoteError(f"{self.url}: {e.strerror or e}" if isinstance(e, OSError) else f"{self.url}: {e}") \
                from None
        if resp.status == 401:
            conn.close()
            raise RemoteError(f"{self.url} refused the API key (401): give the key the server was started with")
        return conn, resp

    def get(self, path: str) -> tuple[int, bytes]:
        conn, resp = self._open("GET", path)
        try:
            return resp.status, resp.read()
        finally:
            conn.close()

    def models(self) -> list[str]:
        """The served model ids; ``RemoteError`` when the server does not answer like the OpenAI API."""
        status, raw = self.get("/v1/models")
        try:
            data = json.loads(raw)["data"]
            return [m["id"] for m in data]
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"{self.url} is not an OpenAI-compatible server (GET /v1/models answered {status} "
                              f"without a model list)") from None

    def event_sources(self) -> dict[int, dict]:
        """Each engine's KV events config by data-parallel rank (``{}``: events off, or the server lacks it)."""
        status, raw = self.get("/kv_event_sources")
        if status != 200:
            return {}
        try:
            data = json.loads(raw)
            return {int(k): v for k, v in data.items() if isinstance(v, dict)}
        except (ValueError, AttributeError):
            return {}

    def metrics(self) -> Metrics:
        status, raw = self.get("/metrics")
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
        sent = time.monotonic()
        conn, resp = self._open("POST", "/v1/chat/completions", body, timeout=max(self.timeout, 120.0))
        if resp.status != 200:
            raw = resp.read()
            conn.close()
            raise RemoteError(f"the server refused the request ({resp.status}): {_message(raw)}")
        reply = reply if reply is not None else Reply()
        done = threading.Event()
        if cancel is not None:  # Stop ends a read that waits on the server (a long prefill, a queue), not only
            threading.Thread(target=_hang_up_on, args=(resp.stream_socket, cancel, done), daemon=True,  # the next chunk
                             name="kvscope-remote-stop").start()
        try:
            self._read_stream(resp, reply, sent, on_delta, cancel)
        except (OSError, http.client.HTTPException) as e:
            if not (cancel is not None and cancel.is_set()):  # else: the read ended because Stop hung up
                reply.error = f"the server went away mid-reply ({e or type(e).__name__}); the text so far is kept"
        finally:
            done.set()
            conn.close()
        if cancel is not None and cancel.is_set() and reply.error is None and reply.finish_reason is None:
            reply.finish_reason = "cancelled"
        if reply.error is None and reply.finish_reason is None:
            reply.error = "the stream ended without a finish reason (the server closed it); the text so far is kept"
        return reply

    @staticmethod
    def _read_stream(resp, reply: Reply, sent: float, on_delta, cancel) -> None:
        for raw in resp:
            if cancel is not None and cancel.is_set():
                reply.finish_reason = "cancelled"
                return
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                reply.error = f"the server ended the reply: {_message(data.encode())}"
                return
            reply.prompt_ids = chunk.get("prompt_token_ids") or reply.prompt_ids
            if chunk.get("usage"):
                reply.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                ids = choice.get("token_ids") or []
                reply.token_ids += ids
                if text or ids:
                    now = time.monotonic()
                    reply.token_times.append(now)
                    if reply.ttft_s is None:
                        reply.ttft_s = now - sent
                reply.text += text
                reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
                if on_delta is not None and (text or ids):
                    on_delta(text, ids)


STOP_POLL_S = 0.05  # how soon Stop reaches a read that waits: 50 ms, a wake-up the reply's thread never sees


def _hang_up_on(sock: socket.socket | None, cancel: threading.Event, done: threading.Event) -> None:
    """Shut the stream's socket once ``cancel`` is set while the reply is still being read: the blocked read
    returns at once, and the server sees the client go (vLLM and ``engine serve`` then abort the request)."""
    while not done.is_set():
        if cancel.wait(STOP_POLL_S):
            if not done.is_set() and sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed meanwhile
            return


def _message(raw: bytes) -> str:
    try:
        err = json.loads(raw)
        err = err.get("error", err)
        msg = err.get("message") if isinstance(err, dict) else str(err)
        return str(msg or raw[:200]).splitlines()[0]
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace").splitlines()[0] if raw else "no body"
