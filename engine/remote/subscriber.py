"""The KV event subscriber: one thread per engine, a ZMQ SUB socket, batches applied to a ``RemoteView``.

Endpoints follow vLLM's publisher rule (``engine.remote.wire.binds``): a publisher given ``tcp://*:5557`` binds,
so we connect (to the server's host); given ``tcp://127.0.0.1:5557`` it connects, so we bind that address.
Sequence numbers count batches: a jump is a gap, filled from the replay endpoint when the server has one (a
DEALER asks for batches from the first missing number; the ROUTER answers each, then -1), else the view
starts over and says it resynchronised. The socket's receive high-water mark bounds what waits in ZMQ; beyond
it ZMQ drops, which the next sequence number reveals (counted as ``dropped``).
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

from engine.remote.view import RemoteView
from engine.remote.wire import END_SEQ, WireError, binds, decode_batch, offset_port, seq_bytes, seq_of

RCV_HWM = 10_000  # batches ZMQ may hold for us before it drops (a batch is one engine step)
REPLAY_WAIT_MS = 1000


def local_endpoint(endpoint: str, server_url: str) -> tuple[str, bool]:
    """(address our socket uses, True if it binds) for a publisher ``endpoint`` of the server at ``server_url``:
    a wildcard publisher is reached at the server's host."""
    if binds(endpoint):
        host = urlsplit(server_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return endpoint.replace("*", host).replace("tcp://[::]", f"tcp://{host}"), False
    return endpoint, True


class EventSubscriber:
    """Receives one engine's KV events into ``view`` on a thread of its own (``start`` / ``stop``)."""

    def __init__(self, view: RemoteView, endpoint: str, server_url: str, topic: str = "",
                 replay_endpoint: str | None = None, rank: int = 0) -> None:
        self.view, self.rank, self.topic = view, rank, topic
        self.endpoint, self.binding = local_endpoint(offset_port(endpoint, rank), server_url)
        self.replay = local_endpoint(offset_port(replay_endpoint, rank), server_url)[0] if replay_endpoint else None
        self.received = 0  # batches applied
        self.dropped = 0  # batches missed and not replayed
        self.replayed = 0  # batches recovered from the replay endpoint
        self.error: str | None = None  # why the socket could not be opened
        self._expected: int | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvscope-kv-events-{rank}", daemon=True)

    def start(self, timeout: float = 5.0) -> None:
        """Open the socket (``ValueError`` with one line when it cannot be) and start receiving."""
        self._thread.start()
        self._ready.wait(timeout)
        if self.error:
            raise ValueError(self.error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RCV_HWM)
        # a server that restarts is reconnected to by ZMQ itself: after 100 ms, backing off to 5 s between tries
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            (sub.bind if self.binding else sub.connect)(self.endpoint)
        except zmq.ZMQError as e:
            self.error = f"cannot {'bind' if self.binding else 'connect to'} the KV events endpoint {self.endpoint}: {e}"
            self._ready.set()
            ctx.destroy(linger=0)
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) == 3:
                    self._receive(ctx, seq_of(frames[1]), frames[2])
        finally:
            ctx.destroy(linger=0)

    def _receive(self, ctx, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except WireError:
            return  # another publisher's topic on the same socket: not ours to draw
        expected = 0 if self._expected is None else self._expected  # joined late: batches 0.. came before us
        if seq > expected:
            missing = seq - expected
            got = self._replay(ctx, expected, seq)
            self.view.gap(self.rank, missing, replayed=got == missing)
            if got != missing:
                self.dropped += missing - got
        elif self._expected is not None and seq < self._expected:  # the server restarted: numbers start again
            self.view.gap(self.rank, 0, replayed=False)
        batch.rank = batch.rank or self.rank
        self.view.apply(batch)
        self.received += 1
        self._expected = seq + 1

    def _replay(self, ctx, first: int, until: int) -> int:
        """Ask the replay endpoint for batches ``first .. until-1`` and apply them; how many came."""
        if self.replay is None:
            return 0
        import zmq

        sock = ctx.socket(zmq.DEALER)
        got = 0
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", seq_bytes(first)])
            while sock.poll(REPLAY_WAIT_MS):
                _, seq_b, payload = sock.recv_multipart()
                seq = seq_of(seq_b)
                if seq == END_SEQ:
                    break
                if first <= seq < until:
                    try:
                        self.view.apply(decode_batch(payload), live=False)
                    except WireError:
                        continue
                    got += 1
        except (zmq.ZMQError, ValueError):
            pass
        finally:
            sock.close(linger=0)
        self.replayed += got
        return got
