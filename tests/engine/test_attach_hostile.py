"""``python -m engine attach`` against a hostile HTTP server (written here, on 127.0.0.1): endless bodies, endless
SSE lines, an endless token stream, byte drips, a pool or a rank count no server has, malformed bodies. Each
case ends as a user sees it: one line on stderr, exit 2, no "internal" and no traceback, the attach process
under 500 MB. The hostile server stops by itself (``hostile_remote.LIFETIME_S``); each run has a kill guard."""

from __future__ import annotations

import json

import pytest

from tests.engine.hostile_remote import HostileServer, attach, chunk, metrics_page, stream

MEMORY_MB = 500  # the closing note's bound for any hostile case (a clean attach run is ~60 MB)


def _endless(kind: str, head: bytes, piece: bytes, pause: float = 0.0):
    def route(h):
        h.start_stream(kind)
        h.wfile.write(head)
        h.endless(piece, pause)
    return route


def _declared(size: int):
    def route(h):
        h.send_response(200)
        h.send_header("Content-Length", str(size))
        h.end_headers()
        h.endless(b"x" * 65536)
    return route


def _raw(data: bytes, piece: bytes = b""):
    def route(h):
        h.wfile.write(data)
        if piece:
            h.endless(piece)
    return route


def _refused_endless(h):
    h.send_response(500)
    h.send_header("Connection", "close")
    h.end_headers()
    h.wfile.write(b"something broke\n")
    h.endless(b"x" * 65536)


def _json(obj):
    return lambda h: h.send_json(obj)


def _body(data: bytes):
    return lambda h: h.send_bytes(data)


GET_MODELS, GET_METRICS, GET_SOURCES, CHAT = (("GET", "/v1/models"), ("GET", "/metrics"),
                                              ("GET", "/kv_event_sources"), ("POST", "/v1/chat/completions"))
DATA_ERR = b'data: {"error": {"message": "boom\\u001b[31m red"}}\n\n'

# (case, routes, server keyword arguments, what the one line says)
CASES = [
    ("endless /v1/models", {GET_MODELS: _endless("application/json", b'{"data": [', b" " * 65536)}, {},
     "GET /v1/models answered more than 2 MiB, more than any server's: refused"),
    ("a declared 1 TB /v1/models", {GET_MODELS: _declared(10 ** 12)}, {},
     "GET /v1/models answered more than 2 MiB (953674 MiB declared)"),
    ("endless /metrics", {GET_METRICS: _endless("text/plain", b"", b"vllm:kv_cache_usage_perc 0.5\n" * 2000)}, {},
     "GET /metrics answered more than 8 MiB"),
    ("endless /kv_event_sources", {GET_SOURCES: _endless("application/json", b'{"0": {"topic": "', b"a" * 65536)},
     {}, "GET /kv_event_sources answered more than 1 MiB"),
    ("endless SSE line", {CHAT: _endless("text/event-stream", b'data: {"x": "', b"a" * 65536)}, {},
     "sent a line longer than 8 MiB; the text so far is kept"),
    ("endless token stream", {CHAT: _endless("text/event-stream", b"", chunk("tok", [5]))}, {},
     "the server streamed more than 68 tokens (max_tokens and a margin of 64): the reply was cut there"),
    ("endless text in one token", {CHAT: _endless("text/event-stream", b"", chunk("x" * 60000, [5]))}, {},
     "the server streamed more than 67,712 characters for 68 tokens"),
    ("endless keep-alive lines", {CHAT: _endless("text/event-stream", b"", b": ping\n")}, {},
     "sent more than 528 lines for 68 tokens"),
    ("a byte every second on /v1/models", {GET_MODELS: _endless("application/json", b"", b" ", pause=1.0)}, {},
     "did not answer GET /v1/models within 10 s"),
    ("a byte every second mid-line", {CHAT: _endless("text/event-stream", b"data: {", b" ", pause=1.0)}, {},
     "sent part of a line and not the rest within 10 s (a stalled or dripping stream); the text so far is kept"),
    ("endless headers", {GET_MODELS: _raw(b"HTTP/1.1 200 OK\r\n", b"X-Pad: a\r\n")}, {},
     "did not answer in HTTP (HTTPException: got more than 100 headers)"),
    ("a header line of 1 MB", {GET_MODELS: _raw(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (1 << 20))}, {},
     "did not answer in HTTP (LineTooLong: got more than 65536 bytes when reading header line)"),
    ("not HTTP", {GET_MODELS: _raw(b"HELLO THERE\r\n\r\n")}, {}, "did not answer in HTTP (BadStatusLine"),
    ("num_gpu_blocks of 3x10^8", {}, {"metrics": metrics_page(num_blocks=300_000_000)},
     "the server says its KV cache has 300,000,000 blocks: more than the 1,048,576 a remote view follows"),
    ("num_gpu_blocks of 5,000 digits", {}, {"metrics": metrics_page(num_blocks="9" * 5000)},
     "the server says its KV cache has 1,000,000,000,000,000,000 blocks"),
    ("block_size of 10^9", {}, {"metrics": metrics_page(block_size=10 ** 9)},
     "the server says its blocks hold 1,000,000,000 tokens: more than 65,536"),
    ("2,000 data-parallel ranks", {}, {"sources": {str(r): {"endpoint": "tcp://*:5557"} for r in range(2000)}},
     "advertises 2,000 KV event sources (data-parallel ranks): more than the 64 a remote view follows"),
    ("rank 10^9", {}, {"sources": {"1000000000": {"endpoint": "tcp://*:5557"}}},
     "/kv_event_sources names rank '1000000000': ranks are 0 to 63"),
    ("a rank that is not a number", {}, {"sources": {"x": {}}}, "/kv_event_sources names rank 'x'"),
    ("an endpoint that is a number", {}, {"sources": {"0": {"endpoint": 5}}},
     "/kv_event_sources rank 0: endpoint 5 is not an address or topic"),
    ("a topic that is a number", {}, {"sources": {"0": {"topic": 5}}}, "rank 0: topic 5 is not an address or topic"),
    ("events on as a string", {}, {"sources": {"0": {"enable_kv_cache_events": "yes"}}},
     "rank 0: enable_kv_cache_events is not true/false"),
    ("model ids that are numbers", {GET_MODELS: _json({"data": [{"id": 5}]})}, {},
     "GET /v1/models lists model ids that are not names (printable text of at most 512 characters)"),
    ("a model id with terminal escapes", {GET_MODELS: _json({"data": [{"id": "a\x1b[2Jb"}]})}, {},
     "lists model ids that are not names"),
    ("a model list that is a string", {GET_MODELS: _json({"data": "x"})}, {},
     "is not an OpenAI-compatible server (GET /v1/models answered 200 without a model list)"),
    ("a model list that is not JSON", {GET_MODELS: _body(b"<html>hello</html>")}, {},
     "is not an OpenAI-compatible server"),
    ("a model list nested 100,000 deep", {GET_MODELS: _body(b"[" * 100_000)}, {},
     "is not an OpenAI-compatible server"),
    ("a chunk that is a list", {CHAT: stream(b"data: [1, 2]\n\n")}, {},
     "the server sent a chunk that is not a JSON object; the text so far is kept"),
    ("a chunk that is not JSON", {CHAT: stream(b"data: {oops\n\n")}, {}, "sent a chunk that is not JSON"),
    ("a chunk nested 100,000 deep", {CHAT: stream(b"data: " + b"[" * 100_000 + b"\n\n")}, {},
     "sent a chunk that is not JSON (RecursionError)"),
    ("choices that are numbers", {CHAT: stream(b'data: {"choices": [5]}\n\n')}, {},
     "a chunk's choices are not a list of objects"),
    ("content that is a number", {CHAT: stream(b'data: {"choices": [{"delta": {"content": 5}}]}\n\n')}, {},
     "a chunk's delta.content is not text"),
    ("token ids that are a string", {CHAT: stream(b'data: {"choices": [{"token_ids": "abc"}]}\n\n')}, {},
     "a chunk's token_ids is not a list of token ids"),
    ("prompt ids that are negative", {CHAT: stream(b'data: {"prompt_token_ids": [-1], "choices": []}\n\n')}, {},
     "a chunk's prompt_token_ids is not a list of token ids"),
    ("a refusal with an endless body", {CHAT: _refused_endless}, {},
     "the server refused the request (500): something broke"),
    ("an error chunk with terminal escapes", {CHAT: stream(chunk("Once", [7]) + DATA_ERR)}, {},
     "the server ended the reply: boom?[31m red"),
    ("a stream that just stops", {CHAT: stream(chunk("Once", [7]))}, {},
     "the stream ended without a finish reason (the server closed it); the text so far is kept"),
]


@pytest.mark.parametrize("case,routes,kwargs,says", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_answer_is_one_line_and_exit_2(case, routes, kwargs, says):
    with HostileServer(routes, **kwargs) as server:
        run = attach(server.url, "--prompt", "hi", "--max-new-tokens", "4", "--events-timeout", "1")
    assert run.rc == 2, (case, run.err)
    assert len(run.err_lines) == 1 and run.err_lines[0].startswith("error: "), run.err
    assert says in run.err_lines[0]
    assert "internal" not in run.err and "Traceback" not in run.err
    assert run.peak_mb < MEMORY_MB


def test_a_well_behaved_server_still_works_and_metrics_junk_reads_as_zero():
    """The same server with nothing hostile (and /metrics samples that are NaN or words): exit 0, the reply and the
    facts it gave. The bounds above cost a proper server nothing."""
    page = metrics_page() + b"vllm:prefix_cache_hits_total{engine=\"1\"} NaN\nvllm:kv_cache_usage_perc nonsense\n"
    with HostileServer(metrics=page) as server:
        run = attach(server.url, "--prompt", "hi", "--max-new-tokens", "4", "--json")
    assert run.rc == 0 and run.err == ""
    out = json.loads(run.out)
    assert out["text"] == "Once upon" and out["usage"]["completion_tokens"] == 2
    assert (out["block_size"], out["num_blocks"], out["kv_usage"]) == (16, 64, 0.25)
    assert out["prefix_cache"] == {"queries": 10.0, "hits": 4.0}
    assert out["events"]["malformed"] == 0


NUMBERS = [
    ("--watch", "inf", "--watch inf: give seconds from 0 to 604800 (a week)"),
    ("--watch", "nan", "--watch nan: give seconds from 0 to 604800 (a week)"),
    ("--watch", "-1", "--watch -1.0: give seconds from 0 to 604800 (a week)"),
    ("--events-timeout", "nan", "--events-timeout nan: give seconds from 0 to 604800 (a week)"),
    ("--max-new-tokens", "0", "--max-new-tokens 0: give 1 to 1,048,576"),
]


@pytest.mark.parametrize("flag,value,says", NUMBERS, ids=[f"{f} {v}" for f, v, _ in NUMBERS])
def test_bad_numbers_are_one_line_before_any_request(flag, value, says):
    with HostileServer() as server:
        run = attach(server.url, "--prompt", "hi", flag, value)
        assert server.requests == []  # refused before the network
    assert run.rc == 2 and run.err_lines == [f"error: {says}"]


def test_messages_from_a_device_are_refused_by_name():
    with HostileServer() as server:
        run = attach(server.url, "--messages", "/dev/zero")
        assert server.requests == []
    assert run.rc == 2
    assert run.err_lines == ["error: messages file /dev/zero is a device, not a file: give a JSON list of "
                             "{role, content}"]
    assert run.peak_mb < MEMORY_MB
