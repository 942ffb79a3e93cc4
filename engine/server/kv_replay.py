"""The KV events replay socket (vLLM's ``replay_endpoint``): a subscriber that missed batches asks for them.

A request is ZMQ multipart ``[b"", start]`` from a DEALER (the ROUTER puts the peer's identity first):
``start`` an 8-byte big-endian sequence number, 0 or more. The answer is each buffered batch from ``start`` on
(``[identity, b"", seq, payload]``), then ``[identity, b"", -1, b""]``. The socket takes no key and may be
reached by anyone who reaches the events, so its cost is bounded:

- anything else (another frame count, a start that is not 8 bytes, a negative one) is dropped and counted;
- a frame over ``MAX_INBOUND_BYTES`` disconnects its peer inside ZMQ, before a byte of it is allocated (a
  256 MB frame costs the server nothing);
- ``RATE`` requests a second are answered (a token bucket of ``BURST``, all peers together: a new identity
  costs an attacker nothing, so per-identity buckets would not bound the work); the rest are dropped, counted;
- an answer is the newest ``MAX_BATCHES`` batches from ``start`` at most, and a peer's unread answers wait up
  to a burst of answers (``BURST * (MAX_BATCHES + 1)`` messages, its send high-water mark), then ZMQ drops them.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import islice

from engine.remote.wire import END_SEQ, seq_bytes, seq_of

# a request is 8 bytes, but the limit also applies to ZMQ's handshake: a peer with a 255-byte identity sends a
# ~290-byte READY command, so 512 lets every well-behaved peer in and keeps a frame's cost under a kilobyte
MAX_INBOUND_BYTES = 512
RATE = 2.0  # answered requests a second: a view asks once when it joins and once per gap
BURST = 4
MAX_BATCHES = 256  # a gap of more than this many batches is not replayed: the view starts over instead
# requests read per call (20-200 calls a second: every 50 ms idle, every batch busy): a flood costs the thread
# ~32 reads of ~5 us per call, under 2% of a core, while ZMQ holds the rest (RCV_HWM) and then stops reading
# the flooder's connection; other peers' requests are read in turn with its (ZMQ queues each peer fairly)
DRAIN = 32
RCV_HWM = 256  # requests ZMQ queues for us before it stops reading a peer's socket


class TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Replay:
    """The ROUTER on ``endpoint`` answering from ``buffer`` (``(seq, payload)`` pairs, oldest first); used by the
    publisher thread only (``serve``)."""

    def __init__(self, ctx, endpoint: str, buffer: deque, rate: float = RATE, burst: int = BURST) -> None:
        import zmq

        self._zmq = zmq
        self.buffer = buffer
        self.bucket = TokenBucket(rate, burst)
        self.counts = {"answered": 0, "malformed": 0, "limited": 0}  # requests, by what became of them
        self.sock = ctx.socket(zmq.ROUTER)
        for opt, value in ((zmq.MAXMSGSIZE, MAX_INBOUND_BYTES), (zmq.RCVHWM, RCV_HWM),
                           (zmq.SNDHWM, burst * (MAX_BATCHES + 1)), (zmq.LINGER, 0)):
            self.sock.setsockopt(opt, value)
        self.sock.bind(endpoint)
        self.bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve(self) -> None:
        """Read the requests waiting (up to ``DRAIN``): answer the well-formed ones the bucket allows."""
        for _ in range(DRAIN):
            try:
                frames = self.sock.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8 or seq_of(frames[2]) < 0:
                self.counts["malformed"] += 1
            elif not self.bucket.take():
                self.counts["limited"] += 1
            else:
                self.counts["answered"] += 1
                self._answer(frames[0], seq_of(frames[2]))

    def _answer(self, ident: bytes, first: int) -> None:
        buf = self.buffer
        skip = max(0, first - buf[0][0], len(buf) - MAX_BATCHES) if buf else 0  # seqs in the buffer are consecutive
        send = self.sock.send_multipart
        try:  # a ROUTER drops what its peer's high-water mark has no room for; Again only if that changes
            for seq, payload in list(islice(buf, skip, None)):
                if seq >= first:
                    send([ident, b"", seq_bytes(seq), payload], flags=self._zmq.NOBLOCK)
            send([ident, b"", seq_bytes(END_SEQ), b""], flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass
