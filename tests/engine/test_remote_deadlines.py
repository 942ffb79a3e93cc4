"""The whole-request deadlines of a streamed reply, which the CLI cases cannot reach in test time (a reply may
wait 120 s for its first byte and then 1 s a token): a hostile server that drips its headers, or keeps a stream
alive with one empty line a moment forever, ends the reply with the deadline's own words. The deadlines are
shortened here (module constants), the server is the real hostile one on 127.0.0.1."""

from __future__ import annotations

import pytest

from engine.remote import client as client_module
from engine.remote import sse
from engine.remote.client import RemoteClient, RemoteError
from tests.engine.hostile_remote import HostileServer, chunk


@pytest.fixture
def short(monkeypatch):
    monkeypatch.setattr(client_module, "CHAT_FIRST_BYTE_S", 2.0)
    monkeypatch.setattr(sse, "SECONDS_PER_TOKEN", 0.05)
    monkeypatch.setattr(sse, "LINE_S", 1.0)


def _drip_headers(h):
    h.wfile.write(b"HTTP/1.1 200 OK\r\n")
    h.endless(b"X", pause=0.2)


def _newlines_forever(h):
    h.start_stream()
    h.wfile.write(chunk("Once", [7]))
    h.endless(b"\n", pause=0.2)


def test_a_reply_whose_headers_drip_ends_at_the_first_byte_deadline(short):
    with HostileServer({("POST", "/v1/chat/completions"): _drip_headers}) as server:
        with pytest.raises(RemoteError) as e:
            RemoteClient(server.url, timeout=1.0).chat("tiny", [{"role": "user", "content": "hi"}], 4)
    assert str(e.value) == f"{server.url} did not answer POST /v1/chat/completions within 2 s"


def test_a_stream_kept_alive_with_empty_lines_ends_at_the_reply_deadline(short):
    """4 tokens asked: 68 allowed, so the reply may take 2 + 68 x 0.05 = 5.4 s; empty lines every 0.2 s are
    complete lines (no line is left half-sent) and fewer than the 528-line cap, so only the deadline ends it."""
    with HostileServer({("POST", "/v1/chat/completions"): _newlines_forever}) as server:
        reply = RemoteClient(server.url, timeout=1.0).chat("tiny", [{"role": "user", "content": "hi"}], 4)
    assert reply.text == "Once" and reply.token_ids == [7]
    assert reply.error == f"{server.url} did not finish the reply within 5 s; the text so far is kept"
