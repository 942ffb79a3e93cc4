"""KV cache events from KV Scope's own server, in vLLM's protocol (``--kv-events-config JSON``).

Every name the prefix cache gives a full page is a ``BlockStored`` (hash, parent hash, the page's token ids) and
every name it drops — a cached page taken for another allocation, a page written again, an arena given back —
a ``BlockRemoved``. So a tool written for vLLM's events (a KV-aware router, KV Scope's remote view) reads ours.

The engine thread only appends to a deque and wakes the publisher thread (the pool's listener: no socket call on
the decode path); that thread, asleep otherwise, waits ``FLUSH_S`` for the rest of the step's events and sends
them as one batch (vLLM sends one per engine step: a step here is 2–40 ms), keeps the last ``buffer_steps`` batches for the replay socket, and owns every ZMQ socket (they are
not thread-safe). A block hash is the first 8 bytes of the page's SHA-256 chain name as an unsigned int (vLLM's
default form: 64-bit ints; a collision inside one pool needs ~2^32 pages).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from engine.remote.wire import END_SEQ, Batch, Cleared, Removed, Stored, binds, encode_batch, seq_bytes, seq_of

FLUSH_S = 0.005
HEARTBEAT_S = 1.0  # an empty batch when nothing happened this long: subscribers can tell quiet from gone
REPLAY_POLL_S = 0.05  # how often a replay request is looked for while nothing is published
GROUP_KIND = {"full": "full_attention"}  # other groups are sliding windows: their pages are never named


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields (the ones a ZMQ publisher uses)."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {self.publisher!r} is not 'zmq' or 'null'")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not str(value).startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: {name} {value!r} is not a tcp://, ipc:// or inproc:// address")
        if self.buffer_steps < 1 or self.hwm < 1:
            raise ValueError("--kv-events-config: buffer_steps and hwm must be at least 1")

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """The flag's JSON (``ValueError`` with one line for bad JSON or an unknown key)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e.msg} at character {e.pos}") from None
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

    def source(self) -> dict:
        """This engine's entry in ``GET /kv_event_sources`` (vLLM's field names)."""
        return asdict(self)


def block_hash(digest: bytes | None) -> int | None:
    return None if digest is None else int.from_bytes(digest[:8], "big")


class KVEventPublisher:
    """Publishes the model's prefix-cache names (``attach``) on ``config.endpoint``; ``close`` stops it."""

    def __init__(self, config: KVEventsConfig, medium: str = "GPU") -> None:
        import zmq

        self.config = config
        self.medium = medium
        self.sent = 0  # batches published
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pending: deque = deque()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint}: {e}") from None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the engine thread when it queued an event
        self._thread = threading.Thread(target=self._run, name="kvscope-kv-events", daemon=True)
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------------------------
    def attach(self, arenas) -> None:
        """Hear ``arenas`` (an ``ArenaRegistry``) from now on; tell subscribers the cache starts empty of names
        they knew (``AllBlocksCleared``), as vLLM does when its cache is reset."""
        self._pending.append(Cleared())
        self._wake.set()
        arenas.set_listener(self._heard)

    def _heard(self, arena, kind: str, page: int, digest: bytes, info) -> None:
        group = getattr(arena, "group", "full")
        if kind == "stored":
            parent, tokens = info
            self._pending.append(Stored((block_hash(digest),), block_hash(parent), tokens, arena.page_size,
                                        self.medium, 0, GROUP_KIND.get(group, "sliding_window")))
        else:
            self._pending.append(Removed((block_hash(digest),), self.medium, 0))
        if not self._wake.is_set():
            self._wake.set()

    # -- the publisher thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        seq, last = 0, 0.0
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            quiet = time.monotonic() - last
            if not self._pending and quiet < HEARTBEAT_S:
                # asleep until the engine queues an event (not awake 200 times a second taking the GIL)
                self._wake.wait(min(HEARTBEAT_S - quiet, REPLAY_POLL_S if self._replay is not None else HEARTBEAT_S))
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
        self._ctx.destroy(linger=0)

    def _serve_replay(self) -> None:
        """A subscriber asked for the batches from a sequence number on: [identity, b"", start]."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        ident, _, start = frames
        first = seq_of(start)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([ident, b"", seq_bytes(seq), payload])
        self._replay.send_multipart([ident, b"", seq_bytes(END_SEQ), b""])

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(2.0)


def _merge(events: list) -> list:
    """Consecutive ``Stored`` of one chain (each the parent of the next) become one event, and consecutive
    ``Removed`` one, as vLLM sends a request's new blocks of a step together."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if (isinstance(e, Stored) and isinstance(last, Stored) and e.parent == last.hashes[-1]
                and e.block_size == last.block_size and e.kind == last.kind):
            out[-1] = Stored(last.hashes + e.hashes, last.parent, last.token_ids + e.token_ids, last.block_size,
                             last.medium, last.group_idx, last.kind)
        elif isinstance(e, Removed) and isinstance(last, Removed):
            out[-1] = Removed(last.hashes + e.hashes, last.medium, last.group_idx)
        else:
            out.append(e)
    return out
