"""Stop reaches a remote reply that waits on the server: a real HTTP server that answers the stream's headers and
then sends nothing (a long prefill, a queue) — the client returns soon after Stop, cancelled, without an error,
and the server sees the connection go."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.remote.client import RemoteClient

CHUNK = b'data: {"choices": [{"delta": {"content": "Once"}, "token_ids": [7]}]}\n\n'


class Stalling(BaseHTTPRequestHandler):
    """Streams one chunk, then waits until the client hangs up (and records when it did)."""

    hung_up = threading.Event()

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(CHUNK)
        self.wfile.flush()
        self.connection.settimeout(30)
        if self.connection.recv(1) == b"":  # the client closed its end
            Stalling.hung_up.set()

    def log_message(self, *_args) -> None:
        pass


def test_stop_ends_a_reply_that_waits_on_the_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = RemoteClient(f"http://127.0.0.1:{server.server_port}")
        cancel, deltas = threading.Event(), []

        def on_delta(text, ids):
            deltas.append((text, ids))
            threading.Timer(0.2, cancel.set).start()  # Stop, while the server sends nothing more

        t0 = time.monotonic()
        reply = client.chat("m", [{"role": "user", "content": "hi"}], on_delta=on_delta, cancel=cancel)
        took = time.monotonic() - t0
        assert deltas == [("Once", [7])] and reply.text == "Once" and reply.token_ids == [7]
        assert reply.finish_reason == "cancelled" and reply.error is None
        assert took < 10  # the server would have held the read for 30 s (and the old client until then)
        assert Stalling.hung_up.wait(5)
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_closes_mid_reply_is_still_an_error_without_stop():
    class Closing(Stalling):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(CHUNK)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Closing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reply = RemoteClient(f"http://127.0.0.1:{server.server_port}").chat(
            "m", [{"role": "user", "content": "hi"}], cancel=threading.Event())
        assert reply.text == "Once" and reply.finish_reason is None
        assert "ended without a finish reason" in reply.error
    finally:
        server.shutdown()
        server.server_close()
