"""``KVServer``: one loaded model behind the OpenAI API, and the ways to run it (``ServerThread`` for tests
and the app, ``serve`` for ``python -m engine serve``).

Security: the server listens on 127.0.0.1 unless told otherwise, and any other address needs an API key
(``check_bind``); the key is compared in constant time; no CORS headers unless origins are given. KV events
stay on this machine unless ``--kv-events-allow-remote``, and carry no token ids for keyed or salted requests
(``engine.server.kv_events``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import CacheConfig
from engine.server.app import build_app, is_local_host, is_loopback  # noqa: F401 - is_loopback re-exported
from engine.server.conn import GuardedH11
from engine.server.limits import ConnLimits, StreamLimits
from engine.server.metrics import Metrics
from engine.server.scheduler import Scheduler

DEFAULT_MAX_BODY = 4 << 20
API_KEY_ENV = "KVSCOPE_API_KEY"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()  # more keys: each one a tenant of its own (prefix caches are not shared)
    cors: tuple[str, ...] = field(default_factory=tuple)
    max_body: int = DEFAULT_MAX_BODY  # bytes of a request body (413 beyond)
    # requests stepped in turn: as many as one batched forward carries (``engine.core.records.MAX_BATCH``); at 8,
    # 16 clients of the SmolLM2 shape waited for the first 8 to finish: median TTFT 14.7 s, 45 tok/s; at 16: 6.2 s, 56
    max_running: int = 16
    max_waiting: int = 32  # requests queued beyond those (429 beyond)
    max_idle: int = 4  # finished conversations kept with their cache
    access_log: bool = False
    limits: StreamLimits = field(default_factory=StreamLimits)  # longest reply, a stream's unsent events
    conn: ConnLimits = field(default_factory=ConnLimits)  # request head / body deadlines, open connections
    speculative: Any = None  # engine.config.SpecConfig for every conversation (None: off)
    draft_lm: Any = None  # its draft model, loaded once (``--speculative draft:PATH``)
    kv_events: Any = None  # engine.server.kv_events.KVEventsConfig: publish KV cache events as vLLM does
    kv_events_allow_remote: bool = False  # events / replay endpoints other machines can reach (wildcard, LAN)
    metrics_public: bool = False  # /metrics (and /health's counts) without a key on a keyed server


def check_cors(cors, api_key: str | None) -> None:
    """``ValueError`` (one line) for ``--cors '*'`` without a key: every web page could use the server."""
    if "*" in (cors or ()) and not api_key:
        raise ValueError("--cors '*' lets every web page use this server: give --api-key KEY too, or name the "
                         "origins that may (--cors http://localhost:3000)")


def check_bind(host: str, api_key: str | None) -> None:
    """``ValueError`` (one line) for a non-loopback address without an API key, or a key no client can send."""
    if api_key and (not api_key.isascii() or not api_key.isprintable() or " " in api_key):
        raise ValueError("--api-key: use printable ASCII without spaces (an HTTP Authorization header carries no "
                         "other characters, so no client could send this key)")
    if not is_local_host(host) and not api_key:  # a name is resolved: "cannot resolve host" before this
        raise ValueError(f"--host {host} is reachable from other machines: give --api-key KEY (or set "
                         f"{API_KEY_ENV}), or serve on 127.0.0.1")


def model_id(lm, source: str | None) -> str:
    """The name clients use: ``demo``, a hub id as given, or a local folder's name."""
    if lm.info.is_demo:
        return "demo"
    if source and not Path(source).exists():
        return source
    return Path(lm.path or source or lm.info.name).name or lm.info.name


class KVServer:
    """The model, the API's scheduler on an engine core and the ASGI app. ``start()`` attaches to the core (and
    starts the engine thread when the core is the server's own)."""

    def __init__(self, lm, cache: CacheConfig | None = None, options: ServerOptions | None = None,
                 source: str | None = None, core=None) -> None:
        self.lm = lm
        self.cache = cache or CacheConfig()
        self.options = options or ServerOptions()
        self.api_keys = tuple(dict.fromkeys(k for k in (self.options.api_key, *self.options.api_keys) if k))
        for key in self.api_keys:
            check_bind("127.0.0.1", key)
        self.api_key = self.api_keys[0] if self.api_keys else None
        self.max_body = self.options.max_body
        self.model_id = model_id(lm, source)
        self.model_ids = tuple(dict.fromkeys(x for x in (self.model_id, source, lm.info.name) if x))
        self.created = int(time.time())
        self.metrics = Metrics()
        self.metrics.runner = lm.runner
        o = self.options
        if o.kv_events is not None and o.kv_events.on:
            from engine.server.kv_events import check_reach

            check_reach(o.kv_events, o.kv_events_allow_remote)  # before the scheduler and its thread exist
        # ``core``: the app's engine core (the API's requests run beside its chats); None: one of its own
        self.scheduler = Scheduler(lm, self.cache, self.metrics, o.max_running, o.max_waiting, o.max_idle, core,
                                   o.limits, speculation=(o.speculative, o.draft_lm))
        if not self.api_keys:  # one user: its accounts say where a prompt diverged, to the token (tenants: whole pages)
            from engine.kv.paged.tenants import tenant_of

            self.scheduler.idle.exact_tenant = tenant_of(None, None)
        self.last_gauges: dict[str, float] = {}
        check_cors(o.cors, self.api_key)
        self.kv_events = None
        if o.kv_events is not None and o.kv_events.on:
            from engine.server.kv_events import KVEventPublisher

            # keyed: every request is a tenant's, so no page's token ids are published (salted ones never are)
            self.kv_events = KVEventPublisher(o.kv_events, medium="GPU" if lm.device.type == "cuda" else "CPU",
                                              private=bool(self.api_keys))
            self.kv_events.attach(lm.kv_arenas)
        self.metrics.kv_events = self.kv_events
        from engine.server.anthropic import routes as anthropic_routes

        self.app = build_app(self, tuple(o.cors), anthropic_routes())

    def start(self) -> None:
        self.scheduler.start()

    def close(self) -> None:
        self.scheduler.stop()
        if self.kv_events is not None:
            self.kv_events.close()
            self.lm.kv_arenas.set_listener(None)
            self.kv_events = None


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound socket (port 0: a free one); ``ValueError`` with one line when the address cannot be used."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without it Nagle
        # and delayed ACKs added ~45 ms to every request after the first on a keep-alive connection
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(server: KVServer, on_ready):
    """A uvicorn server for ``server.app`` that calls ``on_ready()`` once it listens."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                on_ready()

        async def shutdown(self, sockets=None) -> None:
            # Ctrl+C or stop(): end the running requests first (the engine thread joins in a worker thread, so
            # this loop goes on sending their last events), then uvicorn has no open stream to wait for
            await asyncio.get_running_loop().run_in_executor(None, server.close)
            await super().shutdown(sockets=sockets)

    c = server.options.conn
    protocol = GuardedH11.guarded(c.header_timeout_s, c.body_timeout_s, c.max_connections, server.metrics)
    config = uvicorn.Config(server.app, log_level="warning", access_log=server.options.access_log,
                            lifespan="off", timeout_graceful_shutdown=5, http=protocol)
    return _Server(config)


class ServerThread:
    """Serve ``server`` from a background thread (tests, the app): ``start()`` returns the base URL."""

    def __init__(self, server: KVServer, host: str = "127.0.0.1", port: int = 0) -> None:
        check_bind(host, server.api_key)
        self.server = server
        self.sock = listen_socket(host, port)
        self.url = url_of(self.sock)
        self._ready = threading.Event()
        self._uv = _uvicorn_server(server, self._ready.set)
        self._thread = threading.Thread(target=self._run, name="kvscope-http", daemon=True)

    @property
    def open_connections(self) -> int:
        """HTTP connections open now (uvicorn's own count; those refused past the limit are never in it)."""
        return len(self._uv.server_state.connections)

    def _run(self) -> None:
        self._uv.run(sockets=[self.sock])
        self._ready.set()

    def start(self, timeout: float = 60.0) -> str:
        self.server.start()
        self._thread.start()
        self._ready.wait(timeout)
        if not self._uv.started:
            self.stop()
            raise RuntimeError(f"the server did not start on {self.url}")
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        """End the running requests first (each stream finishes with "the server is shutting down"), then the
        HTTP server: its graceful shutdown then has no open stream to wait for (it waited up to 5 s and cut them)."""
        self._uv.should_exit = True  # its shutdown closes the scheduler first (``_uvicorn_server``)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.server.close()  # also when uvicorn never ran
        self.sock.close()


def server_threads(lm) -> None:
    """A server's CPU threads (``engine.model.threads.for_server``: every physical core, vLLM's rule) instead of
    the app's (idle cores at load), applied and kept in the model's info (startup line, ``/metrics``)."""
    from engine.model.threads import apply, for_server

    from engine.quant.modules import parameter_count
    n, why = for_server(parameter_count(lm.model), lm.device.type)
    apply(n)
    lm.info = dataclasses.replace(lm.info, threads=n, threads_reason=why)


def _say_ready(server: KVServer, url: str) -> None:
    info = server.lm.info
    threads = f"; CPU threads: {info.threads_reason}" if info.device == "cpu" and info.threads_reason else ""
    print(f"KV Scope serves {server.model_id} at {url}/v1 (OpenAI API; metrics at {url}/metrics"
          f"{'' if server.options.metrics_public or not server.api_keys else ' with a key'}{threads}; Ctrl+C stops)",
          flush=True)
    if server.kv_events is not None:
        print(server.kv_events.describe(), flush=True)


def _options_from(a) -> ServerOptions:
    """The server's options from ``serve``'s flags, each refusal (a bind without a key, CORS, KV events' reach)
    raised before anything is loaded."""
    keys = tuple(a.api_key or ()) or tuple(k for k in [os.environ.get(API_KEY_ENV)] if k)
    api_key = keys[0] if keys else None
    for key in keys or (None,):
        check_bind(a.host, key)  # before anything is loaded
    check_cors(a.cors, api_key)
    options = ServerOptions(host=a.host, port=a.port, api_key=api_key, api_keys=keys[1:], cors=tuple(a.cors or ()),
                            max_body=a.max_body, max_running=a.max_running, max_waiting=a.max_queued,
                            max_idle=a.max_idle, access_log=a.access_log,
                            limits=StreamLimits(max_tokens=a.max_tokens),
                            conn=ConnLimits(a.header_timeout, a.body_timeout, a.max_connections),
                            kv_events_allow_remote=getattr(a, "kv_events_allow_remote", False),
                            metrics_public=getattr(a, "metrics_public", False))
    if getattr(a, "kv_events_config", None):
        from engine.server.kv_events import KVEventsConfig, check_reach

        events = KVEventsConfig.parse(a.kv_events_config)
        if events.on:
            check_reach(events, options.kv_events_allow_remote)  # before anything is loaded
        options = dataclasses.replace(options, kv_events=events)
    return options


def serve(a, cache: CacheConfig, spec) -> int:
    """``python -m engine serve``: load, listen, print the URL, serve until Ctrl+C."""
    options = _options_from(a)
    from engine.config import SpecConfig

    speculative = SpecConfig.parse(getattr(a, "speculative", "off"), getattr(a, "draft_tokens", 0))
    sock = listen_socket(a.host, a.port)  # a busy port is told before the model loads
    from engine.model.hf_load import print_notes
    from engine.model.loader import load_model
    from engine.model.prepack import set_workload

    set_workload("server")  # batches: float32 linears oneDNN-packed, not blocked for one-row steps

    lm = load_model(spec, print_notes)  # a GGUF's dequantization and its memory said before the weights load
    server_threads(lm)
    if lm.tokenizer is None:
        raise ValueError("this model has no tokenizer: the server needs one")
    from engine.kv.tier.disk import configure_flag

    configure_flag(lm, a)  # pages of every conversation kept on disk (--kv-disk DIR) or not
    if speculative.method != "off":
        from engine.speculation.draft_model import load_drafter

        drafter = load_drafter(speculative, lm, spec)  # loaded and checked once; each conversation drafts with it
        options = dataclasses.replace(options, speculative=speculative,
                                      draft_lm=drafter.lm if drafter is not None else None)
        if drafter is not None:
            drafter.close()
    server = KVServer(lm, cache, options, source=a.model)
    lm.fast.waker = server.scheduler.core.wake  # its build's end wakes the engine thread to take it up
    lm.fast.start()  # the compiled decode step (engine.model.fast_step): built in a child, requests run eager meanwhile
    url = url_of(sock)
    uv = _uvicorn_server(server, lambda: _say_ready(server, url))
    server.start()
    try:
        uv.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it stopped on: the normal way to stop a server
        pass
    finally:
        server.close()
        lm.fast.close()
    print("KV Scope server stopped", flush=True)
    return 0

