"""KV cache events from KV Scope's own server, in vLLM's protocol (``--kv-events-config JSON``).

Every name the prefix cache gives a full page is a ``BlockStored`` (hash, parent hash, the page's token ids) and
every name it drops — a cached page taken for another allocation, a page written again, an arena given back —
a ``BlockRemoved``. So a tool written for vLLM's events (a KV-aware router, KV Scope's remote view) reads ours.

Who can read them. The endpoints are this machine's (loopback tcp, ipc, inproc; default ``tcp://127.0.0.1:5557``)
unless the server is started with ``--kv-events-allow-remote`` (``check_reach``), and the publisher binds every
endpoint it is given (it is the server; vLLM's publisher connects to a non-wildcard tcp address). The sockets
take no key, so tenants are kept apart in what is sent: a server with any API key publishes no token ids at all,
and an unkeyed one none for a request with ``cache_salt`` (its chain does not start at the public root) —
``BlockStored`` then carries block hashes only. A hash is SHA-256 down the chain from the tenant's own root,
which is SHA-256 over its key and salt (``engine.kv.paged.tenants``): without them a guessed text cannot be checked
against it. vLLM publishes every request's token ids to whoever connects.

The engine thread only appends to a deque and wakes the publisher thread (the pool's listener: no socket call on
the decode path); that thread, asleep otherwise, waits ``FLUSH_S`` for the rest of the step's events and sends
them as one batch (vLLM sends one per engine step: a step here is 2–40 ms), keeps the last ``buffer_steps``
batches for the replay socket (``engine.server.kv_replay``), and owns every ZMQ socket (they are not
thread-safe). A thread that fails says so on stderr once, and ``source()`` then answers None, so
``/kv_event_sources`` stops advertising events nobody sends.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from engine.kv.paged.prefix import ROOT, page_hash, salted_root
from engine.kv.paged.tenants import block_hash, tenant_of  # noqa: F401 - block_hash re-exported (tests, tools)
from engine.remote.wire import Batch, Cleared, Removed, Stored, encode_batch, seq_bytes
from engine.server.kv_replay import MAX_INBOUND_BYTES, Replay

FLUSH_S = 0.005
HEARTBEAT_S = 1.0  # an empty batch when nothing happened this long: subscribers can tell quiet from gone
REPLAY_POLL_S = 0.05  # how often a replay request is looked for while nothing is published
GROUP_KIND = {"full": "full_attention"}  # other groups are sliding windows: their pages are never named
SUB_RCVHWM = 1_000  # subscription messages queued from subscribers (one per SUBSCRIBE; a few per subscriber)
# vLLM's defaults are 10,000 batches and 100,000 messages; the caps keep a typo from reserving gigabytes (a
# batch of a 4,096-token prompt is ~15 KB: 100,000 of them ~1.5 GB)
LIMITS = {"buffer_steps": (1, 100_000), "hwm": (1, 10_000_000)}
TOPIC_MAX_BYTES = 255  # a subscriber's SUBSCRIBE carries it: it must fit MAX_INBOUND_BYTES with the handshake
WILDCARDS = ("*", "0.0.0.0", "::", "")
# chains whose token ids may be published on an unkeyed server: unkeyed, unsalted API requests; the app's chats
PUBLIC_ROOTS = (salted_root(tenant_of(None, None)), ROOT)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields (the ones a ZMQ publisher uses)."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"--kv-events-config: {name} {getattr(self, name)!r} is not {want}")

        if not isinstance(self.enable_kv_cache_events, bool):
            raise bad("enable_kv_cache_events", "true or false")
        if self.publisher not in ("zmq", "null"):
            raise bad("publisher", "'zmq' or 'null'")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise bad(name, "a tcp://, ipc:// or inproc:// address")
            if value.startswith("tcp://"):
                tcp_host(value, name)
        if self.replay_endpoint == self.endpoint and not self.endpoint.endswith((":*", ":0")):
            raise ValueError("--kv-events-config: replay_endpoint must differ from endpoint (both are bound)")
        for name, (lo, hi) in LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise bad(name, f"a whole number from {lo} to {hi:,}")
        if not isinstance(self.topic, str) or len(self.topic.encode()) > TOPIC_MAX_BYTES:
            raise bad("topic", f"a string of at most {TOPIC_MAX_BYTES} bytes")

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """The flag's JSON (``ValueError`` with one line for bad JSON, an unknown key or a bad value)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e.msg} at character {e.pos}") from None
        except RecursionError:
            raise ValueError("--kv-events-config is nested too deeply: give a flat JSON object") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**raw)

    @property
    def on(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def tcp_host(endpoint: str, name: str = "endpoint") -> tuple[str, str]:
    """(host, port) of ``tcp://HOST:PORT`` (``[v6]`` unbracketed); ``ValueError`` for another shape."""
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not (port == "*" or port.isdigit() and int(port) <= 65535):
        raise ValueError(f"--kv-events-config: {name} {endpoint!r} is not tcp://HOST:PORT (PORT 0..65535, or *)")
    return host.strip("[]"), port


def reachable_from_elsewhere(endpoint: str) -> bool:
    """Whether another machine can reach ``endpoint``: a wildcard or an address not loopback (a name is resolved
    by the system resolver: ``ValueError`` "cannot resolve host" when it knows none). ipc and inproc: no."""
    if not endpoint.startswith("tcp://"):
        return False
    host, _ = tcp_host(endpoint)
    if host in WILDCARDS:
        return True
    from engine.server.app import is_local_host

    try:
        return not is_local_host(host)
    except ValueError as e:
        raise ValueError(f"--kv-events-config: {endpoint}: {e}") from None


def check_reach(config: KVEventsConfig, allow_remote: bool) -> None:
    """``ValueError`` (one line) for an events or replay endpoint other machines reach, unless allowed."""
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(config, name)
        if value and reachable_from_elsewhere(value) and not allow_remote:
            raise ValueError(f"--kv-events-config: {name} {value} is reachable from other machines, and its KV "
                             "events take no key: use tcp://127.0.0.1:PORT, or start the server with "
                             "--kv-events-allow-remote")


def _advertised(given: str, bound: str) -> str:
    """``given`` as subscribers should use it: the port ZMQ chose for ``:*`` or ``:0`` (``bound``: its
    LAST_ENDPOINT), and ``*`` for ``0.0.0.0`` (vLLM's rule: a subscriber connects to a publisher on ``*``, at the
    server's host)."""
    if not given.startswith("tcp://"):
        return given
    host, _ = tcp_host(given)
    port = bound.rpartition(":")[2]
    if host in ("0.0.0.0", ""):
        host = "*"
    elif ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _reach_words(endpoint: str) -> str:
    if endpoint.startswith("ipc://"):
        return "this machine only; the socket file's permissions decide who may read it"
    if endpoint.startswith("inproc://"):
        return "this process only"
    try:
        far = reachable_from_elsewhere(endpoint)
    except ValueError:
        far = True
    return "reachable from other machines: --kv-events-allow-remote" if far else "this machine only"


class KVEventPublisher:
    """Publishes the model's prefix-cache names (``attach``) on ``config.endpoint``; ``close`` stops it.
    ``private``: publish no token ids at all (the server has API keys: every request is a tenant's)."""

    def __init__(self, config: KVEventsConfig, medium: str = "GPU", private: bool = False) -> None:
        import zmq

        self.config, self.medium, self.private = config, medium, private
        self.sent = 0  # batches published
        self.error: str | None = None  # why the publisher thread stopped
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pending: deque = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._public: set[bytes] = set()  # names of pages whose token ids are published (engine thread only)
        self._pub = self._ctx.socket(zmq.PUB)
        # a subscriber only sends its subscriptions: a larger frame (256 MB, say) disconnects it before ZMQ
        # allocates it; the send queue per subscriber is vLLM's ``hwm``, then ZMQ drops (as vLLM's PUB does)
        for opt, value in ((zmq.SNDHWM, config.hwm), (zmq.RCVHWM, SUB_RCVHWM), (zmq.MAXMSGSIZE, MAX_INBOUND_BYTES),
                           (zmq.LINGER, 0)):
            self._pub.setsockopt(opt, value)
        self.replay: Replay | None = None
        try:
            self._pub.bind(config.endpoint)  # always: this is the server (see the module's docstring)
            self.endpoint = _advertised(config.endpoint, self._pub.getsockopt_string(zmq.LAST_ENDPOINT))
            self.replay_endpoint = None
            if config.replay_endpoint:
                self.replay = Replay(self._ctx, config.replay_endpoint, self._buffer)
                self.replay_endpoint = _advertised(config.replay_endpoint, self.replay.bound)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot bind {config.endpoint}: {e}") from None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the engine thread when it queued an event
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-events", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def source(self) -> dict | None:
        """This engine's entry in ``GET /kv_event_sources`` (vLLM's field names, the endpoints as bound); None
        once the publisher thread has stopped."""
        if not self.alive:
            return None
        return {**asdict(self.config), "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint}

    def describe(self) -> str:
        """The startup line: where the events are, who can reach them, what they carry."""
        where = f"KV events on {self.endpoint} ({_reach_words(self.config.endpoint)})"
        if self.replay_endpoint:
            where += f", replay on {self.replay_endpoint} ({_reach_words(self.config.replay_endpoint)})"
        carry = ("no token ids, block hashes only (the server has API keys)" if self.private else
                 "token ids of unsalted requests (with cache_salt: block hashes only)")
        return f"{where}; {carry}"

    # -- the engine thread ------------------------------------------------------------------------------
    def attach(self, arenas) -> None:
        """Hear ``arenas`` (an ``ArenaRegistry``) from now on; tell subscribers the cache starts empty of names
        they knew (``AllBlocksCleared``), as vLLM does when its cache is reset."""
        self._pending.append(Cleared())
        self._wake.set()
        arenas.set_listener(self._heard)

    def _heard(self, arena, kind: str, page: int, digest: bytes, info) -> None:
        if self.error is not None:
            return  # nobody drains the queue any more: do not let it grow
        group = getattr(arena, "group", "full")
        if kind == "stored":
            parent, tokens = info
            shown = tokens if self._shown(digest, parent, tokens) else ()
            self._pending.append(Stored((block_hash(digest),), block_hash(parent), shown, arena.page_size,
                                        self.medium, 0, GROUP_KIND.get(group, "sliding_window")))
        else:
            self._public.discard(digest)
            self._pending.append(Removed((block_hash(digest),), self.medium, 0))
        if not self._wake.is_set():
            self._wake.set()

    def _shown(self, digest: bytes, parent: bytes | None, tokens) -> bool:
        """May this page's token ids be published? Never on a keyed server; else only down a chain from a public
        root (its first page's name is the root's hash of its tokens), so a salted request's never are. A page
        whose parent is not known public (a page restored from disk names no tokens) is not either."""
        if self.private:
            return False
        if parent is None:
            ok = bool(tokens) and any(page_hash(root, tokens) == digest for root in PUBLIC_ROOTS)
        else:
            ok = parent in self._public
        if ok:
            self._public.add(digest)
        return ok

    # -- the publisher thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - said once; /kv_event_sources stops advertising
            self.error = f"{type(e).__name__}: {e}"
            print(f"error: KV events stopped ({self.error}); GET /kv_event_sources now lists none", file=sys.stderr,
                  flush=True)
        finally:
            self._ctx.destroy(linger=0)

    def _loop(self) -> None:
        seq, last = 0, 0.0
        while not self._stop.is_set():
            if self.replay is not None:
                self.replay.serve()
            quiet = time.monotonic() - last
            if not self._pending and quiet < HEARTBEAT_S:
                # asleep until the engine queues an event (not awake 200 times a second taking the GIL)
                self._wake.wait(min(HEARTBEAT_S - quiet, REPLAY_POLL_S if self.replay is not None else HEARTBEAT_S))
                self._wake.clear()
                if self._pending:
                    time.sleep(FLUSH_S)  # the rest of this step's events join the batch
                continue
            last = time.monotonic()
            events = []
            while self._pending:
                events.append(self._pending.popleft())
            payload = encode_batch(Batch(time.time(), _merge(events), 0))
            try:
                self._pub.send_multipart([self.config.topic.encode(), seq_bytes(seq), payload],
                                         flags=self._zmq.NOBLOCK)
            except self._zmq.Again:  # no subscriber room (hwm): dropped, as vLLM's PUB drops
                pass
            self._buffer.append((seq, payload))
            seq += 1
            self.sent = seq

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(2.0)


def _merge(events: list) -> list:
    """Consecutive ``Stored`` of one chain (each the parent of the next, both with token ids or both without)
    become one event, and consecutive ``Removed`` one, as vLLM sends a request's new blocks of a step together."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if (isinstance(e, Stored) and isinstance(last, Stored) and e.parent == last.hashes[-1]
                and e.block_size == last.block_size and e.kind == last.kind
                and bool(e.token_ids) == bool(last.token_ids)):
            out[-1] = Stored(last.hashes + e.hashes, last.parent, last.token_ids + e.token_ids, last.block_size,
                             last.medium, last.group_idx, last.kind)
        elif isinstance(e, Removed) and isinstance(last, Removed):
            out[-1] = Removed(last.hashes + e.hashes, last.medium, last.group_idx)
        else:
            out.append(e)
    return out
