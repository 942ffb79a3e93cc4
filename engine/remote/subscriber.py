"""The KV event subscriber: one thread per engine, a ZMQ SUB socket, batches applied to a ``RemoteView``.

Where the socket goes (``local_endpoint``). A publisher on ``tcp://*:PORT`` binds (vLLM's rule,
``engine.remote.wire.binds``), so we connect, at the server's host. A publisher given a loopback address either
connects to it (vLLM) or binds it (KV Scope's own server): we bind the same loopback address, and when it is taken
(the publisher holds it) we connect instead. What the server advertises never makes us listen on a non-loopback
address: anyone who reaches a listening SUB can feed it events. ``tcp://0.0.0.0:PORT`` is this machine's
loopback when the server is on it, its host otherwise; any other address is refused with one line unless the
user gave it (``--events``).

Sequence numbers count batches: a jump is a gap, filled from the replay endpoint when the server has one (a
DEALER asks for batches from the first missing number; the ROUTER answers each, then -1: at most
``REPLAY_MAX_FRAMES`` frames and ``REPLAY_MAX_S`` seconds are read, a replay that never ends stops there), else
the view starts over and says it resynchronised. Frames larger than ``MAX_MSG_BYTES`` disconnect the publisher
(ZMQ_MAXMSGSIZE) before they are allocated; the receive high-water mark bounds what waits in ZMQ; beyond it ZMQ
drops, which the next sequence number reveals (counted as ``dropped``). A frame or batch that is not what vLLM
sends is counted in the view (``RemoteView.malformed``) and skipped: the thread outlives anything it receives.
"""

from __future__ import annotations

import errno
import ipaddress
import threading
import time
from urllib.parse import urlsplit

from engine.remote.view import RemoteView
from engine.remote.wire import END_SEQ, binds, decode_batch, offset_port, seq_bytes, seq_of

# the largest frame taken: a batch is one engine step, at most max_num_batched_tokens (2,048-16,384 by default)
# token ids of ~5 bytes each, ~80 KB; 2 MiB is 25x that
MAX_MSG_BYTES = 2 << 20
# batches ZMQ may hold for us, all engines together (128 x 2 MiB: at most 256 MiB waiting); vLLM steps every
# 10-50 ms, and this thread applies a batch in well under 1 ms, so 128 is seconds of a stalled reader
RCV_HWM_TOTAL = 128
RCV_HWM_MIN = 4
REPLAY_WAIT_MS = 1000  # the replay socket's silence that ends a replay
REPLAY_MAX_S = 5.0  # a replay that keeps sending (and never says -1) stops here
REPLAY_MAX_FRAMES = 10_000  # vLLM's default replay buffer: it cannot answer more
RECONNECT_S = 0.1  # ZMQ's own first reconnect interval (RECONNECT_IVL below)
WILDCARD_HOSTS = ("*", "::", "")


class EndpointRefused(ValueError):
    """An events endpoint this client will not use: one line saying why and what to give instead."""


def _split(endpoint: str) -> tuple[str, str]:
    """(host, port) of ``tcp://HOST:PORT`` (``[v6]`` without its brackets); ``EndpointRefused`` otherwise."""
    rest = endpoint[len("tcp://"):]
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = rest.rpartition(":")
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise EndpointRefused(f"the KV events endpoint {endpoint!r} is not tcp://HOST:PORT with a port 1-65535")
    return host, port


def _tcp(host: str, port: str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def is_loopback(host: str) -> bool:
    """``host`` names this machine's loopback (literal addresses and ``localhost``; no name is looked up)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_endpoint(endpoint: str, server_url: str, given: bool = False) -> tuple[str, bool]:
    """(address our socket uses, True to bind it first) for a publisher ``endpoint`` of the server at
    ``server_url``; ``given``: the user typed it (``--events``), so it is bound even on a non-loopback address,
    as vLLM's rule says. ``EndpointRefused`` (one line) for one we will not use. A bind that finds the address
    taken or not ours connects instead (``EventSubscriber``)."""
    server = urlsplit(server_url).hostname or "127.0.0.1"
    if endpoint.startswith("ipc://"):
        return endpoint, False  # the publisher binds its socket file; only a process on its machine reaches it
    if endpoint.startswith("inproc://"):
        raise EndpointRefused(f"the KV events endpoint {endpoint} lives inside the server's process: no other "
                              "process can subscribe to it")
    if not endpoint.startswith("tcp://"):
        raise EndpointRefused(f"the KV events endpoint {endpoint!r} is not a tcp:// or ipc:// address")
    host, port = _split(endpoint)
    if host in WILDCARD_HOSTS:  # the publisher binds every interface: it is reached at the server's host
        return _tcp(server, port), False
    if host == "0.0.0.0":  # vLLM connects there, to its own machine; a server that binds it is at its host
        return (_tcp("127.0.0.1", port), True) if is_loopback(server) else (_tcp(server, port), False)
    if is_loopback(host):
        if not is_loopback(server) and not given:
            raise EndpointRefused(f"the server at {server} publishes its KV events on its own loopback ({endpoint}):"
                                  " only a subscriber on that machine can read them; start it with an endpoint "
                                  "others reach (vLLM: tcp://*:PORT), or give the events endpoint")
        return _tcp(host, port), not binds(endpoint)
    if given:
        return endpoint, not binds(endpoint)
    if host == server:
        return endpoint, False  # the server's own address: a publisher there binds it
    raise EndpointRefused(f"the server's KV events publisher connects out to {endpoint}, so a subscriber would have "
                          "to listen there, open to anyone who reaches it; KV Scope listens only on loopback for a "
                          "server's say-so: give the events endpoint yourself to listen there")


def replay_address(endpoint: str | None, server_url: str) -> str | None:
    """Where the DEALER connects for the replay socket a server advertised (its ROUTER always binds); None when
    no subscriber here can reach it (its own loopback, another machine, a bad address)."""
    if not endpoint:
        return None
    try:
        address, _ = local_endpoint(endpoint, server_url)
    except EndpointRefused:
        return None
    return address


class EventSubscriber:
    """Receives one engine's KV events into ``view`` on a thread of its own (``start`` / ``stop``).
    ``EndpointRefused`` at construction for an endpoint it will not use."""

    def __init__(self, view: RemoteView, endpoint: str, server_url: str, topic: str = "",
                 replay_endpoint: str | None = None, rank: int = 0, given: bool = False, engines: int = 1) -> None:
        self.view, self.rank, self.topic = view, rank, topic
        self.endpoint, self.binding = local_endpoint(offset_port(endpoint, rank), server_url, given)
        self.replay = replay_address(offset_port(replay_endpoint, rank), server_url)
        self.hwm = max(RCV_HWM_MIN, RCV_HWM_TOTAL // max(1, engines))
        self.received = 0  # batches applied
        self.dropped = 0  # batches missed and not replayed
        self.replayed = 0  # batches recovered from the replay endpoint
        self.reconnects = 0  # connections dropped (the server went, or sent a frame over MAX_MSG_BYTES)
        self.error: str | None = None  # why the socket could not be opened
        self._expected: int | None = None
        self._new_stream = threading.Event()  # the server came back: the next batch may begin its numbers anew
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvscope-kv-events-{rank}", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def came_back(self) -> None:
        """The server answered again after failing to (any thread). A restarted server numbers its batches from 0
        again, and its first batches may have gone out before ZMQ reconnected; when the first one heard has a number
        at or above the last one's, nothing in the numbers says so. So the next batch starts a new stream: the
        view starts over and the replay endpoint is asked for everything before it (a server that only dropped
        the connection replays what the view had: the same state)."""
        self._new_stream.set()

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

    def _socket(self, ctx, kind: int, hwm: int):
        import zmq

        sock = ctx.socket(kind)
        for opt, value in ((zmq.MAXMSGSIZE, MAX_MSG_BYTES), (zmq.RCVHWM, hwm), (zmq.LINGER, 0),
                           # a server that restarts is reconnected to by ZMQ itself: after 100 ms, then up to 5 s
                           (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 5000)):
            sock.setsockopt(opt, value)
        return sock

    def _open(self, ctx):
        import zmq

        sub = self._socket(ctx, zmq.SUB, self.hwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if self.binding:
            try:
                sub.bind(self.endpoint)
                return sub
            except zmq.ZMQError as e:  # taken (the publisher binds it: KV Scope's server) or not ours: connect
                if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                    raise
                self.binding = False
        sub.connect(self.endpoint)
        return sub

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        try:
            sub = self._open(ctx)
        except zmq.ZMQError as e:
            how = "bind" if self.binding else "connect to"
            self.error = f"cannot {how} the KV events endpoint {self.endpoint}: {e}"
            self._ready.set()
            ctx.destroy(linger=0)
            return
        self._ready.set()
        # a connection ZMQ drops for a protocol error (a frame over MAXMSGSIZE) is not reconnected by ZMQ itself
        # (libzmq 4.3): it is watched for and reconnected here, or one oversized frame would leave us deaf
        monitor = None if self.binding else sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        for sock in (sub, monitor):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(100))
                    if monitor is not None and monitor in ready:
                        self._reconnect(sub, monitor)
                    if sub in ready:
                        self._receive(ctx, sub.recv_multipart())
                except zmq.ZMQError:
                    if self._stop.is_set():
                        break
                    time.sleep(0.1)  # a socket error is ZMQ's to recover from (it reconnects)
                except Exception as e:  # noqa: BLE001 - the thread outlives any frame: counted, said once, skipped
                    self.view.skip(1, f"{type(e).__name__}: {str(e)[:120]}")
        finally:
            ctx.destroy(linger=0)

    def _reconnect(self, sub, monitor) -> None:
        while monitor.poll(0):
            monitor.recv_multipart()
        self.reconnects += 1
        time.sleep(RECONNECT_S)
        sub.disconnect(self.endpoint)
        sub.connect(self.endpoint)

    def _receive(self, ctx, frames: list) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.view.skip(1, f"a message of {len(frames)} frames, not [topic, 8-byte sequence number, batch]")
            return
        seq = seq_of(frames[1])
        if self._new_stream.is_set():  # the server came back (``came_back``): its numbers may have begun again
            self._new_stream.clear()
            self.view.gap(self.rank, 0, replayed=False)  # starts over
            self._expected = 0
        expected = 0 if self._expected is None else self._expected  # joined late: batches 0.. came before us
        if seq > expected:
            missing = seq - expected
            got = self._replay(ctx, expected, seq)
            self.view.gap(self.rank, missing, replayed=got == missing)
            if got != missing:
                self.dropped += missing - got
        elif self._expected is not None and seq < self._expected:  # the server restarted: numbers start again
            self.view.gap(self.rank, 0, replayed=False)
        self._expected = seq + 1  # a malformed batch still took its number: not a gap
        try:
            batch = decode_batch(frames[2])
        except ValueError as e:
            self.view.skip(1, f"batch {seq}: {e}")
            return
        batch.rank = batch.rank or self.rank
        self.view.apply(batch)
        self.received += 1

    def _replay(self, ctx, first: int, until: int) -> int:
        """Ask the replay endpoint for batches ``first .. until-1`` and apply them; how many came. Reads at most
        ``REPLAY_MAX_FRAMES`` frames (and a few strays) for ``REPLAY_MAX_S``: a replay that never says -1 ends."""
        if self.replay is None:
            return 0
        import zmq

        sock = self._socket(ctx, zmq.DEALER, 64)
        got, frames, seen = 0, 0, set()
        end = time.monotonic() + REPLAY_MAX_S
        budget = min(until - first, REPLAY_MAX_FRAMES) + 16
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", seq_bytes(first)])
            while frames < budget and not self._stop.is_set():
                left_ms = int((end - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(min(REPLAY_WAIT_MS, left_ms)):
                    break
                parts = sock.recv_multipart()
                frames += 1
                if len(parts) != 3 or len(parts[1]) != 8:
                    self.view.skip(1, f"a replay message of {len(parts)} frames, not [empty, sequence, batch]")
                    break
                seq = seq_of(parts[1])
                if seq == END_SEQ:
                    break
                if first <= seq < until and seq not in seen:  # a batch sent twice counts once
                    seen.add(seq)
                    try:
                        batch = decode_batch(parts[2])
                    except ValueError as e:
                        self.view.skip(1, f"replayed batch {seq}: {e}")
                        continue
                    batch.rank = batch.rank or self.rank
                    self.view.apply(batch, live=False)
                    got += 1
        except zmq.ZMQError:
            pass  # the replay socket went away: what came is kept, the rest is a gap
        finally:
            sock.close(linger=0)
        self.replayed += got
        return got
