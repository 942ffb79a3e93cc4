"""A hostile OpenAI-compatible server and KV events publisher for the attach tests, on 127.0.0.1 only.

``HostileServer`` answers like a small vLLM (one model, ``/metrics``, ``/kv_event_sources``, a streamed reply)
except where a test gives a route of its own; every route that would go on forever stops by itself after
``LIFETIME_S`` (or when the client hangs up), and the server shuts itself down then too. ``attach`` runs
``python -m engine attach`` as the user would and reports its exit code, output, peak RSS and time.
``Publisher`` is a real ZMQ PUB (and, if asked, a replay ROUTER) on loopback ports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIFETIME_S = 60.0  # nothing a test starts outlives this
ATTACH_TIMEOUT_S = 60.0  # a hang guard for one attach run (the bounds under test end each case in ~10 s at most)
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chunk(text: str = "", ids=(), finish=None, **extra) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish, "token_ids": list(ids)}
    return b"data: " + json.dumps({"choices": [choice], **extra}).encode() + b"\n\n"


def metrics_page(block_size: int = BLOCK, num_blocks: int | str = 64) -> bytes:
    return (f"vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.25\nvllm:prefix_cache_queries_total{{engine=\"0\"}} 10\n"
            f"vllm:prefix_cache_hits_total{{engine=\"0\"}} 4\nvllm:cache_config_info{{block_size=\"{block_size}\","
            f"engine=\"0\",num_gpu_blocks=\"{num_blocks}\"}} 1.0\n").encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        self._route("GET")

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length") or 0)
        self.body = json.loads(self.rfile.read(n) or b"{}")
        self._route("POST")

    def _route(self, method: str) -> None:
        server: HostileServer = self.server.owner
        server.requests.append((method, self.path))
        route = server.routes.get((method, self.path)) or DEFAULTS.get((method, self.path))
        try:
            if route is None:
                self.send_json({"error": "not found"}, 404)
            else:
                route(self)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            pass  # the client hung up: what it was meant to do
        self.close_connection = True

    # -- what routes use --------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.server.owner.running.is_set()

    def send_json(self, obj, status: int = 200) -> None:
        self.send_bytes(json.dumps(obj).encode(), status)

    def send_bytes(self, data: bytes, status: int = 200, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self, kind: str = "text/event-stream") -> None:
        """Headers of a body without a length (it ends when the connection closes)."""
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Connection", "close")
        self.end_headers()

    def endless(self, piece: bytes, pause: float = 0.0) -> None:
        """Write ``piece`` until the client hangs up or the server's life ends."""
        while self.alive:
            self.wfile.write(piece)
            if pause:
                self.wfile.flush()
                self.server.owner.stopped.wait(pause)  # returns at once when the server stops


def _models(h: Handler) -> None:
    h.send_json({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


def _metrics(h: Handler) -> None:
    h.send_bytes(h.server.owner.metrics, kind="text/plain")


def _sources(h: Handler) -> None:
    if h.server.owner.sources is None:
        h.send_json({"error": "not found"}, 404)
    else:
        h.send_json(h.server.owner.sources)


def _chat(h: Handler) -> None:
    """A short proper reply: prompt ids, two tokens, a finish and usage; the publisher's script goes first."""
    owner = h.server.owner
    if owner.on_chat is not None:
        owner.on_chat()
    h.start_stream()
    prompt = list(range(1, 2 * BLOCK + 2))
    h.wfile.write(chunk("Once", [7], prompt_token_ids=prompt) + chunk(" upon", [8], finish="length"))
    h.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": len(prompt),
                                                                   "completion_tokens": 2}}).encode() + b"\n\n")
    h.wfile.write(b"data: [DONE]\n\n")


DEFAULTS = {("GET", "/v1/models"): _models, ("GET", "/metrics"): _metrics,
            ("GET", "/kv_event_sources"): _sources, ("POST", "/v1/chat/completions"): _chat}


class HostileServer:
    """``routes``: {(method, path): fn(handler)} replacing the well-behaved defaults."""

    def __init__(self, routes: dict | None = None, sources: dict | None = None, metrics: bytes | None = None,
                 on_chat=None) -> None:
        self.routes = routes or {}
        self.sources, self.metrics = sources, metrics if metrics is not None else metrics_page()
        self.on_chat = on_chat
        self.requests: list = []
        self.running, self.stopped = threading.Event(), threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"

    def __enter__(self) -> "HostileServer":
        self.running.set()
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        self._timer = threading.Timer(LIFETIME_S, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        if self.running.is_set():
            self.running.clear()
            self.stopped.set()
            self.httpd.shutdown()
            self.httpd.server_close()

    def __exit__(self, *_exc) -> None:
        self._timer.cancel()
        self.stop()


@dataclass
class Run:
    rc: int
    out: str
    err: str
    peak_mb: float
    seconds: float

    @property
    def err_lines(self) -> list[str]:
        return self.err.strip().splitlines()


def attach(url: str, *args: str, timeout: float = ATTACH_TIMEOUT_S, during=None) -> Run:
    """``python -m engine attach URL ARGS`` in a process of its own: exit code, stdout, stderr, peak RSS (MB, its
    VmHWM) and wall time. ``during(pid)``: called once it started (on this thread), e.g. to look at its sockets."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "engine", "attach", url, *args], cwd=ROOT, stdout=out,
                                stderr=err, env={**os.environ, "KVSCOPE_DEBUG": ""})
        guard = threading.Timer(timeout, lambda: os.kill(proc.pid, signal.SIGKILL))
        guard.start()
        peak = _Peak(proc.pid)
        try:
            if during is not None:
                during(proc.pid)
            _, status, _usage = os.wait4(proc.pid, 0)
        finally:
            guard.cancel()
            peak.done.set()
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        run = Run(proc.returncode, out.read().decode(), err.read().decode(), peak.kb / 1024, seconds)
    _record(run)
    return run


class _Peak:
    """The process's own peak RSS: VmHWM of /proc/PID/status, read every 10 ms until it exits (wait4's ru_maxrss
    is no use here: Linux carries the parent's high-water mark across fork and exec, ~90-150 MB of pytest)."""

    def __init__(self, pid: int) -> None:
        self.kb, self.done = 0, threading.Event()
        self._path = f"/proc/{pid}/status"
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.done.wait(0.01):
            try:
                for line in Path(self._path).read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.kb = max(self.kb, int(line.split()[1]))
            except (OSError, ValueError):
                pass  # exited (a zombie has no VmHWM), or between reads


def _record(run: Run) -> None:
    """With ``KVSCOPE_ATTACH_MEASURE=FILE`` (``measure_attach_hostile.py``), one JSON line per run: the case, the
    exit code, the last stderr line, peak RSS and time."""
    path = os.environ.get("KVSCOPE_ATTACH_MEASURE")
    if path:
        case = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "rc": run.rc, "stderr_lines": len(run.err_lines),
                                "line": run.err_lines[-1] if run.err_lines else "", "peak_mb": round(run.peak_mb, 1),
                                "seconds": round(run.seconds, 2)}) + "\n")


def listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            rows = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(_address(addr, width))
    return found


def _address(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def stream(*pieces: bytes):
    """A chat route that streams ``pieces`` as they are, then closes."""
    def route(h: Handler) -> None:
        h.start_stream()
        for piece in pieces:
            h.wfile.write(piece)
    return route


class Publisher:
    """A real ZMQ publisher on ``tcp://127.0.0.1:PORT`` (``connect_to``: one that connects there instead, as
    vLLM's does for a non-wildcard endpoint) and, with ``replay_fn``, a replay ROUTER that answers each request
    with ``replay_fn(publisher, identity, first)``. An XPUB, so ``wait_subscriber`` knows when a SUB is listening
    (no sleeping for the slow joiner)."""

    def __init__(self, connect_to: str | None = None, replay_fn=None) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every (re)subscription is seen, not only the first
        if connect_to:
            self.pub.connect(connect_to)
            self.endpoint = connect_to
        else:
            self.pub.bind("tcp://127.0.0.1:0")
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None
        self._stop = threading.Event()
        if replay_fn is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:0")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.requests: list[int] = []
            threading.Thread(target=self._serve_replay, args=(replay_fn,), daemon=True).start()

    def wait_subscriber(self, timeout: float = 20.0) -> bool:
        """True once a subscriber's SUBSCRIBE arrived (it then receives what is sent next)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.pub.poll(50) and self.pub.recv()[:1] == b"\x01":
                return True
        return False

    def send(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        self.pub.send_multipart([topic, seq.to_bytes(8, "big", signed=True), payload])

    def _serve_replay(self, replay_fn) -> None:
        end = time.monotonic() + LIFETIME_S
        while not self._stop.is_set() and time.monotonic() < end:
            if self.router.poll(50):
                ident, _, first = self.router.recv_multipart()
                self.requests.append(int.from_bytes(first, "big", signed=True))
                replay_fn(self, ident, int.from_bytes(first, "big", signed=True))

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        time.sleep(0.1)
        self.ctx.destroy(linger=0)
