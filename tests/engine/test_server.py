"""The OpenAI-compatible server (``python -m engine serve``) on the real stories260K model, in-process on a free
port of 127.0.0.1, driven by the real ``openai`` package (and httpx where the client would hide the wire).

Greedy replies are compared with ``python -m engine generate`` and with fresh ``ChatSession``s; the engine's
side (pages, turn stats) is read on the engine thread through ``Scheduler.call``.
"""

from __future__ import annotations

import json
import threading
import time
from unittest import mock

import httpx
import openai
import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.metrics import parse as parse_metrics
from slow_forward import SlowForward

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}  # /metrics and /health's counts need it on a keyed server
MODEL = "stories260K"
PAGE = 16
MAX_BODY = 64 * 1024
MAX_WAITING = 4
DEADLINE_S = 120.0  # how long a poll waits for the server before the test fails (never a speed check)


@pytest.fixture(scope="module")
def served(stories_path):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))  # the server's own copy: references run on the `stories` fixture's
    server = KVServer(lm, CacheConfig(page_size=PAGE), ServerOptions(api_key=KEY, max_body=MAX_BODY,
                                                                     max_waiting=MAX_WAITING), source=str(stories_path))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=DEADLINE_S)


def on_engine(server, fn):
    """``fn()`` run on the engine thread (between two rounds, also while paused)."""
    return server.scheduler.call(fn).result(DEADLINE_S)


def wait_for(cond, what: str):
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def record(server, request_id: str):
    return next(r for r in server.scheduler.records if r.request_id == request_id)


def reference(lm, messages=None, prompt=None, max_tokens=32):
    """Greedy reply of a fresh session: (text, generated ids, TurnStats)."""
    from engine.core.session import ChatSession

    s = ChatSession(lm, CacheConfig(page_size=PAGE))
    sampling = SamplingConfig(max_new_tokens=max_tokens)
    s.start(messages, sampling) if messages is not None else s.start_completion(prompt, sampling)
    while not (r := s.step()).done:
        pass
    out = (r.text, s.generated_ids, r.stats)
    s.close()
    return out


def cli_generate(capsys, stories_path, tmp_path, args):
    from engine.tools.cli import main

    capsys.readouterr()
    assert main(["generate", "--model", str(stories_path), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def assert_openai_error(resp: httpx.Response, status: int, param=..., code=...):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    if param is not ...:
        assert body["error"]["param"] == param, body
    if code is not ...:
        assert body["error"]["code"] == code, body
    return body["error"]


# -- replies ------------------------------------------------------------------------------------------------
def test_chat_equals_generate_streamed_and_not(served, client, capsys, stories_path, tmp_path):
    server, _ = served
    messages = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": "Sara saw a big dog."}]
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(messages))
    ref = cli_generate(capsys, stories_path, tmp_path, ["--messages", str(f), "--max-new-tokens", "40"])["turns"][0]
    assert ref["stop_reason"] == "max_tokens" and len(ref["text"]) > 20

    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == ref["prompt_tokens"]
    assert r.usage.completion_tokens == len(ref["token_ids"]) == 40
    assert r.usage.total_tokens == ref["prompt_tokens"] + 40
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == ref["text"]
    assert sum(1 for d in deltas if d) > 10  # streamed token by token, not in one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == ref["prompt_tokens"]
    # the same messages again: the idle session of the first request gives the whole pages before the last
    # prompt token (not going on with all of that conversation, the request reuses whole pages only: #20 item 1)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (ref["prompt_tokens"] - 1) // PAGE * PAGE > 0


def test_completion_equals_generate_streamed_and_not(served, client, capsys, stories_path, tmp_path):
    prompt = "The little bird"
    ref = cli_generate(capsys, stories_path, tmp_path, ["--prompt", prompt, "--max-new-tokens", "24"])
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref["prompt_tokens"], len(ref["token_ids"]))

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref["text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequence_cuts_the_text(served, client, stories):
    messages = [{"role": "user", "content": "Sara saw a big dog."}]
    text, _, _ = reference(stories, messages, max_tokens=40)
    stop = text[8:11]  # three characters from inside the reply
    assert stop and stop in text
    cut = text[:text.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_second_turn_reuses_the_first_turns_cache(served, client, stories):
    server, _ = served
    conv = [{"role": "user", "content": "Tom had a red ball."}]
    r1 = client.chat.completions.create(model=MODEL, messages=conv, temperature=0, max_tokens=30)
    conv2 = conv + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "What did Tom do next?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=conv2, temperature=0, max_tokens=30)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - PAGE
    assert cached >= r1.usage.prompt_tokens  # in fact the whole first prompt and most of the reply
    rec1, rec2 = record(server, r1.id), record(server, r2.id)
    assert rec2.session_id == rec1.session_id  # the first conversation's session went on
    assert rec2.reused_tokens == cached
    assert rec2.recomputed_tokens == r2.usage.prompt_tokens - cached  # the engine prefilled only the rest
    text, ids, _ = reference(stories, conv2, max_tokens=30)  # and reuse changes nothing in the reply
    assert r2.choices[0].message.content == text and r2.usage.completion_tokens == len(ids)


def test_a_new_conversation_takes_a_closed_ones_system_prompt_pages(served, client, stories):
    """Prefix caching across sessions: the first conversation's session is closed (its pages stay cached);
    a new conversation with the same system prompt gets a new session that takes them by reference."""
    server, _ = served
    system = {"role": "system", "content": "You tell short stories about a little girl named Lily and her dog "
                                           "Max who loved to play in the park on sunny days."}
    conv1 = [system, {"role": "user", "content": "Lily found a ball."}]
    r1 = client.chat.completions.create(model=MODEL, messages=conv1, temperature=0, max_tokens=8)
    on_engine(server, lambda: server.scheduler.idle.close())  # no idle session to go on with
    conv2 = [system, {"role": "user", "content": "Max ran away."}]
    r2 = client.chat.completions.create(model=MODEL, messages=conv2, temperature=0, max_tokens=30)
    from engine.model.chat import render_chat
    from engine.core.sequence import common_prefix

    tok = stories.tokenizer
    full = common_prefix(render_chat(tok, conv1), render_chat(tok, conv2)) // PAGE * PAGE
    assert full >= 2 * PAGE
    cached = r2.usage.prompt_tokens_details.cached_tokens
    rec1, rec2 = record(server, r1.id), record(server, r2.id)
    assert rec2.session_id != rec1.session_id and cached == rec2.reused_tokens == full
    assert rec2.recomputed_tokens == r2.usage.prompt_tokens - full
    text, ids, _ = reference(stories, conv2, max_tokens=30)
    assert r2.choices[0].message.content == text and r2.usage.completion_tokens == len(ids)


def test_four_concurrent_clients_get_their_sequential_replies(served, client, stories):
    server, _ = served
    prompts = ["Lily went to the park.", "Ben found a shiny rock.", "The cat sat on the mat.", "Mia baked a cake."]
    refs = [reference(stories, [{"role": "user", "content": p}], max_tokens=48)[0] for p in prompts]
    assert len(set(refs)) == 4
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            msgs = [{"role": "user", "content": prompts[i]}]
            if i % 2:
                chunks = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=48,
                                                        stream=True)
                got[i] = "".join(c.choices[0].delta.content or "" for c in chunks)
            else:
                got[i] = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                                        max_tokens=48).choices[0].message.content
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    m = server.scheduler.metrics
    forwards0, tokens0 = m.batched_forwards, m.batched_tokens
    server.scheduler.pause()  # all four queue up, then run together, decoded in one forward per step
    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: server.scheduler.waiting == 4 or errors, "four queued requests")
    finally:
        server.scheduler.resume()
    for t in threads:
        t.join(DEADLINE_S)
    assert not errors, errors
    assert [got[i] for i in range(4)] == refs
    forwards, tokens = m.batched_forwards - forwards0, m.batched_tokens - tokens0
    assert forwards >= 40 and tokens >= 3 * forwards  # most steps decoded three or four replies together


def test_disconnect_mid_stream_frees_the_requests_pages(served):
    server, url = served
    slow = SlowForward(server.lm.model, 0.02)
    try:
        _disconnect_mid_stream(server, url)
    finally:
        slow.undo()


def _disconnect_mid_stream(server, url):
    sched = server.scheduler
    before = parse_metrics(httpx.get(url + "/metrics", headers=AUTH).text)
    idle_before = on_engine(server, lambda: [s.session_id for s in sched.idle])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Once upon a time"}], "temperature": 0,
            "max_tokens": 300, "stream": True}
    with httpx.Client(timeout=DEADLINE_S) as http:
        with http.stream("POST", url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                    break  # the first generated text
            sched.pause()  # hold the reply where it is, so it cannot finish before the disconnect is seen
            jobs = on_engine(server, lambda: list(sched._running))
            assert len(jobs) == 1
            job = jobs[0]
            sid = job.session.session_id
            assert on_engine(server, lambda: any(s == sid for a in server.lm.arenas for s in a.pool.session))
        # the response is closed here: the client went away mid-stream
        try:
            wait_for(lambda: job.cancelled, "the server to see the disconnect")
        finally:
            sched.resume()
    wait_for(lambda: job.finished, "the cancelled request to end")
    assert record(server, job.request_id).finish_reason == "cancelled"
    assert job.session.closed
    held = on_engine(server, lambda: [s for a in server.lm.arenas for s in a.pool.session if s == sid])
    assert held == []  # no page of that request's session is held
    assert on_engine(server, lambda: [s.session_id for s in sched.idle]) == idle_before
    after = parse_metrics(httpx.get(url + "/metrics", headers=AUTH).text)
    assert after["kvscope_kv_pages_used"] == before["kvscope_kv_pages_used"]  # the pool back to its idle state
    assert after["kvscope_requests_running"] == 0
    assert after['kvscope_requests_total{outcome="cancelled"}'] == before['kvscope_requests_total{outcome="cancelled"}'] + 1
    assert after["kvscope_generation_tokens_total"] < before["kvscope_generation_tokens_total"] + 300


def test_client_leaving_while_queued_cancels_its_request(served):
    """A plain (not streamed) request whose client closes the connection before it starts is dropped."""
    import socket
    from urllib.parse import urlsplit

    server, url = served
    sched = server.scheduler
    before = parse_metrics(httpx.get(url + "/metrics", headers=AUTH).text)
    body = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 5}).encode()
    u = urlsplit(url)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sched.pause()
    try:
        with socket.create_connection((u.hostname, u.port)) as sock:
            sock.sendall(head + body)
            wait_for(lambda: sched.waiting == 1, "the request to queue")
        wait_for(lambda: sched.waiting == 0, "the queued request to be dropped")
    finally:
        sched.resume()
    after = parse_metrics(httpx.get(url + "/metrics", headers=AUTH).text)
    assert after['kvscope_requests_total{outcome="cancelled"}'] == before['kvscope_requests_total{outcome="cancelled"}'] + 1
    assert after["kvscope_prompt_tokens_total"] == before["kvscope_prompt_tokens_total"]  # never started


def test_metrics_count_tokens_and_prefix_hits(served, client):
    server, url = served
    before = parse_metrics(httpx.get(url + "/metrics", headers=AUTH).text)
    conv = [{"role": "user", "content": "A frog jumped."}]
    r1 = client.chat.completions.create(model=MODEL, messages=conv, temperature=0, max_tokens=12)
    conv.append({"role": "assistant", "content": r1.choices[0].message.content})
    conv.append({"role": "user", "content": "Then what?"})
    r2 = client.chat.completions.create(model=MODEL, messages=conv, temperature=0, max_tokens=12)
    text = httpx.get(url + "/metrics", headers=AUTH).text
    assert "# TYPE kvscope_prefix_cache_hits_total counter" in text
    after = parse_metrics(text)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["kvscope_generation_tokens_total"] == r1.usage.completion_tokens + r2.usage.completion_tokens
    assert d["kvscope_prompt_tokens_total"] == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    assert d["kvscope_prefix_cache_queries_total"] == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    assert d["kvscope_prefix_cache_hits_total"] == r2.usage.prompt_tokens_details.cached_tokens > 0
    assert after["kvscope_requests_running"] == 0 and after["kvscope_requests_waiting"] == 0
    assert 0 < after["kvscope_sessions_idle"] <= 4
    assert after["kvscope_kv_pages_used"] > 0 and after["kvscope_kv_bytes_used"] > 0
    assert after["kvscope_generation_tokens_per_second"] >= 0
    assert {"kvscope_kv_evicted_tokens_total", "kvscope_session_evictions_total"} <= set(after)
    health = httpx.get(url + "/health", headers=AUTH).json()
    assert health["status"] == "ok" and health["model"] == MODEL


# -- bad requests ------------------------------------------------------------------------------------------
def _post(url, path, body, key=KEY, raw: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(url + path, content=raw if raw is not None else json.dumps(body).encode(), headers=headers,
                      timeout=DEADLINE_S)


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("path,body,raw,status,param,code", [
    (CHAT, None, b"{not json", 400, None, ...),
    (CHAT, None, b"[1, 2]", 400, None, ...),
    (CHAT, {"model": MODEL}, None, 400, "messages", "missing_required_parameter"),
    (CHAT, {"model": MODEL, "messages": []}, None, 400, "messages", ...),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "messages[0].role", ...),
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}, None, 400, "messages[0].tool_call_id",
     ...),
    (CHAT, {"model": MODEL, "messages": USER + [{"role": "assistant", "content": "x"}]}, None, 400,
     "messages[1].role", ...),
    (CHAT, {"model": "gpt-4o", "messages": USER}, None, 404, "model", "model_not_found"),
    (CHAT, {"messages": USER}, None, 400, "model", ...),
    (CHAT, {"model": MODEL, "messages": USER, "n": 2}, None, 400, "n", ...),
    (CHAT, {"model": MODEL, "messages": USER, "temperature": "hot"}, None, 400, "temperature", ...),
    (CHAT, {"model": MODEL, "messages": USER, "max_tokens": 0}, None, 400, "max_tokens", ...),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, None, 400, "prompt", ...),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, None, 400, "prompt", ...),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, None, 400, "prompt", ...),
])
def test_bad_requests_get_openai_errors(served, path, body, raw, status, param, code):
    server, url = served
    assert_openai_error(_post(url, path, body, raw=raw), status, param, code)


def test_more_bad_requests_and_the_server_goes_on(served, client):
    server, url = served
    ctx = server.lm.info.context_length
    r = _post(url, CHAT, {"model": MODEL, "messages": USER, "max_tokens": ctx})
    err = assert_openai_error(r, 400, "max_tokens", "context_length_exceeded")
    n = client.chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=1).usage.prompt_tokens
    assert f"{ctx} tokens" in err["message"] and f"{n + ctx} tokens ({n} in the messages, {ctx} in the completion)" \
        in err["message"]
    long = [{"role": "user", "content": "word " * (2 * ctx)}]
    assert_openai_error(_post(url, CHAT, {"model": MODEL, "messages": long}), 400, "messages", "context_length_exceeded")
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 1)}]}
    assert_openai_error(_post(url, CHAT, big), 413, None, "request_too_large")
    assert_openai_error(httpx.get(url + CHAT, headers={"Authorization": f"Bearer {KEY}"}), 405)
    assert_openai_error(httpx.get(url + "/v1/nothing"), 404)
    with pytest.raises(openai.BadRequestError) as e:  # what a client of the openai package sees
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.status_code == 400 and e.value.body["param"] == "messages[0].role"
    # a bug inside a step: 500 with one line, no traceback; the next request is served
    from engine.core.session import ChatSession

    with mock.patch.object(ChatSession, "prepare", side_effect=RuntimeError("boom")):
        assert "boom" not in assert_openai_error(_post(url, CHAT, {"model": MODEL, "messages": USER}), 500,
                                                  None, "internal_error")["message"]
    r = client.chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=4)
    assert r.usage.completion_tokens == 4
    assert server.scheduler.alive


def test_queue_limit_answers_429(served, client):
    server, url = served
    results: list = []

    def ask() -> None:
        try:
            results.append(client.completions.create(model=MODEL, prompt="One day", temperature=0, max_tokens=2))
        except BaseException as e:  # noqa: BLE001
            results.append(e)

    server.scheduler.pause()
    try:
        threads = [threading.Thread(target=ask) for _ in range(MAX_WAITING)]
        for t in threads:
            t.start()
        wait_for(lambda: server.scheduler.waiting == MAX_WAITING, "a full queue")
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="One day", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    finally:
        server.scheduler.resume()
    for t in threads:
        t.join(DEADLINE_S)
    assert len(results) == MAX_WAITING and all(isinstance(r, openai.types.Completion) for r in results), results


def test_full_cache_503_then_idle_sessions_make_room(stories):
    """A page cap of one page: a prompt that needs two gets 503; idle conversations give their page up."""
    server = KVServer(stories, CacheConfig(page_size=PAGE, max_pages=1), ServerOptions(), source="tiny")
    thread = ServerThread(server)
    url = thread.start()
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=DEADLINE_S)
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 40}], max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "kv_cache_full"
        assert "Traceback" not in str(e.value.body)
        first = c.completions.create(model="tiny", prompt="Hi", temperature=0, max_tokens=3)
        assert first.usage.completion_tokens == 3  # its session stays idle, holding the one page
        assert on_engine(server, lambda: len(server.scheduler.idle)) == 1
        second = c.completions.create(model="tiny", prompt="Sun", temperature=0, max_tokens=3)
        assert second.usage.completion_tokens == 3
        assert on_engine(server, lambda: len(server.scheduler.idle)) == 1
        assert server.metrics.session_evictions == 1
    finally:
        thread.stop()


# -- security ----------------------------------------------------------------------------------------------
def test_wrong_or_missing_key_gets_401(served):
    server, url = served
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=USER)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(url + "/v1/models"), 401, None, "invalid_api_key")
    ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in ok["data"]] == [MODEL]
    # no CORS unless asked for
    r = httpx.get(url + "/health", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_non_loopback_bind_without_key_is_refused(stories_path, capsys):
    from engine.tools.cli import main

    for host in ("0.0.0.0", "192.168.1.20"):  # a name is resolved: test_kv_events_security (no DNS here)
        assert main(["serve", "--model", str(stories_path), "--host", host]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--api-key" in err and host in err


def test_an_api_key_no_client_can_send_is_refused_at_start(stories_path, capsys):
    from engine.tools.cli import main

    for key in ("ключ-123", "two words", "tab\tkey"):
        assert main(["serve", "--model", str(stories_path), "--api-key", key]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--api-key" in err and "ASCII" in err


def test_a_seed_out_of_range_is_a_400_that_names_it(served):
    server, url = served
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "Once", "max_tokens": 2, "temperature": 1.0, "seed": 1 << 70})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]


def test_keep_alive_requests_are_not_held_back_by_nagle(served):
    """The listening socket says it is TCP, so asyncio sets TCP_NODELAY on every connection: a second request
    on a keep-alive connection is as quick as the first (with Nagle and delayed ACKs it took ~45 ms more)."""
    import socket

    from engine.server.service import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    sock.close()
    server, url = served
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as http:
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            assert http.get(url + "/v1/models").status_code == 200
            times.append(time.perf_counter() - t0)
    later = sorted(times[2:])[len(times[2:]) // 2]
    assert later < 0.03, f"median of keep-alive requests {later * 1000:.1f} ms (Nagle + delayed ACK is ~40 ms)"


def test_health_says_what_the_compiled_step_is_doing(served):
    server, url = served
    h = httpx.get(url + "/health", headers=AUTH).json()
    assert h["status"] == "ok" and h["compiled_step"]["state"] == server.lm.fast.state  # "off" in the tests
    assert h["compiled_step"]["reason"] == server.lm.fast.reason
    assert h["compiled_batch_step"] == {"state": server.lm.fast.batch.state, "reason": server.lm.fast.batch.reason}


def test_non_loopback_bind_refused_by_server_thread(stories):
    server = KVServer(stories, CacheConfig(), ServerOptions())
    with pytest.raises(ValueError, match="--api-key"):
        ServerThread(server, host="0.0.0.0")
    assert not server.scheduler.thread.is_alive()


def test_serve_command_prints_its_url_and_stops_on_ctrl_c(stories_path):
    """The real command: ``python -m engine serve --port 0`` prints where it listens once ready."""
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(stories_path), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.startswith("KV Scope serves stories260K at http://127.0.0.1:"), (line, p.stderr.read())
        base = line.split(" at ")[1].split()[0]
        assert base.endswith("/v1")
        models = httpx.get(base + "/models", timeout=DEADLINE_S).json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 512
        r = httpx.post(base + "/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                    "temperature": 0}, timeout=DEADLINE_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(DEADLINE_S)
        finally:
            p.kill() if p.poll() is None else None
    assert rc == 0, p.stderr.read()


def test_stop_with_a_stream_in_flight_ends_it_at_once(stories_path):
    """Stopping the server while a reply streams ends that request first (the client's stream finishes with the
    shutdown error), so the HTTP server does not wait for the reply: the app's Server ▸ Stop does not hang."""
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    thread = ServerThread(KVServer(lm, CacheConfig(page_size=PAGE)))
    url = thread.start()
    slow = SlowForward(lm.model, 0.05)  # 300 tokens: ~15 s if it ran to the end
    lines: list[str] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
                lines.extend(r.iter_lines())
        except httpx.HTTPError as e:  # the connection cut before the server said why
            lines.append(f"cut: {e}")

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        wait_for(lambda: sum(1 for ln in lines if ln.startswith("data: ")) >= 3 or
                 thread.server.scheduler.metrics.generation_tokens >= 3, "a stream under way")
        thread.stop()
        reader.join(DEADLINE_S)
    finally:
        slow.undo()
    assert not reader.is_alive()
    # the request was ended by the server (its stream says why), not cut by the HTTP server's shutdown timeout
    assert any("shutting down" in ln for ln in lines), lines[-3:]
    assert sum(1 for ln in lines if ln.startswith("data: {")) < 300


def test_web_pages_cannot_drive_a_keyless_server(stories):
    """The attack a page can make: a "simple" text/plain POST (no preflight) from another origin, and DNS rebinding
    (the page's own host name resolved to 127.0.0.1). Without a key: only loopback Host values, no Origin
    unless --cors names it, JSON only; no generation runs for a refused request."""
    server = KVServer(stories, CacheConfig(), ServerOptions(cors=("http://localhost:5173",)))
    thread = ServerThread(server)
    url = thread.start()
    body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 2})
    try:
        before = server.metrics.prompt_tokens
        csrf = httpx.post(url + "/v1/completions", content=body,
                          headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert csrf.status_code == 403 and csrf.json()["error"]["code"] == "origin_not_allowed"
        rebound = httpx.post(url + "/v1/completions", content=body,
                             headers={"Content-Type": "application/json", "Host": "evil.example:8000"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        plain = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
        assert server.metrics.prompt_tokens == before  # nothing was generated for any of them
        ok = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert ok.status_code == 200
        allowed = httpx.post(url + "/v1/completions", content=body,
                             headers={"Content-Type": "application/json", "Origin": "http://localhost:5173"})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://localhost:5173"
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
            assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200
    finally:
        thread.stop()


def test_cors_for_every_origin_needs_a_key(stories, stories_path, capsys):
    from engine.tools.cli import main

    with pytest.raises(ValueError, match="--api-key"):
        KVServer(stories, CacheConfig(), ServerOptions(cors=("*",)))
    KVServer(stories, CacheConfig(), ServerOptions(cors=("*",), api_key=KEY)).close()
    assert main(["serve", "--model", str(stories_path), "--cors", "*"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cors '*'" in err


def test_a_chat_template_that_refuses_is_a_400_with_its_message(stories):
    import copy
    import dataclasses

    tok = copy.deepcopy(stories.tokenizer)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    lm = dataclasses.replace(stories, tokenizer=tok, arenas=None, model_runner=None)
    thread = ServerThread(KVServer(lm, CacheConfig()))
    url = thread.start()
    try:
        r = httpx.post(url + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400
        assert "roles must alternate" in r.json()["error"]["message"]
    finally:
        thread.stop()


def test_shared_pages_count_once_in_the_kv_bytes_used(served, client):
    server, url = served
    system = "You are a storyteller who tells short tales about a girl named Lily and her dog. " * 3
    for q in ("Tell me one.", "Tell me another."):
        client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                       messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
    g = on_engine(server, server.scheduler.kv_gauges)
    arenas = list(server.lm.arenas)
    assert g["kv_bytes_used"] == sum(a.pool.num_used * a.page_bytes for a in arenas)
    assert g["kv_bytes_used"] <= g["kv_bytes_allocated"]
