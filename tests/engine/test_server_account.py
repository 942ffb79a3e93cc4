"""The server's cache account (#35 items 2, 3): every response says why each prompt token was reused or computed
(``"kvscope": {"cache": ...}``), ``/metrics`` counts the computed ones by reason, and a follow-up that sends the
reply back unchanged reuses the reply too (the ids fed through it, spliced into the rendered prompt). Real server
(stories260K, two API keys), real HTTP (httpx)."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.metrics import parse
from engine.snapshot import MissReason

KEY_A, KEY_B = "account-a-key", "account-b-key"
PAGE = 16
DEADLINE_S = 120.0
STORY = "Once upon a time there was a little girl named Lily. She loved to play outside in the park."
SECRET = "The secret pin code is 7391. Tell nobody about the red box."
REASONS = {r.value for r in MissReason}


@pytest.fixture(scope="module")
def served(stories_path):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(page_size=PAGE), ServerOptions(api_key=KEY_A, api_keys=(KEY_B,), max_idle=8),
                      source=str(stories_path))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def post(url: str, path: str, body: dict, key: str = KEY_A) -> dict:
    r = httpx.post(url + path, json={"model": "stories260K", "temperature": 0, **body},
                   headers={"Authorization": f"Bearer {key}"}, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, messages: list[dict], key: str = KEY_A, max_tokens: int = 48, **kw) -> dict:
    return post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, **kw}, key)


def reply_of(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"]


def check(account: dict, usage: dict) -> None:
    """The account adds up to the usage, and its misses cover the computed tokens in order with known reasons."""
    n = usage["prompt_tokens"]
    assert account["reused"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert account["reused"] + account["recomputed"] + account["dropped"] == n
    at = account["reused"] + account["dropped"]
    for m in account["misses"]:
        assert m["start"] == at < m["end"] and m["reason"] in REASONS and isinstance(m["detail"], str)
        at = m["end"]
    assert at == n


def test_every_response_carries_the_account(served):
    """Chat and completions, whole and streamed: the account on the body, on the usage chunk, or on the last chunk
    when the stream has no usage chunk; nowhere else."""
    _, url = served
    first = chat(url, [{"role": "user", "content": "A cat sat on a mat."}])
    check(first["kvscope"]["cache"], first["usage"])
    assert first["kvscope"]["cache"]["misses"][0]["reason"] == "new"
    text = post(url, "/v1/completions", {"prompt": "The dog ran to the", "max_tokens": 8})
    check(text["kvscope"]["cache"], text["usage"])
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "A bird sang."}]}),
                       ("/v1/completions", {"prompt": "The sun was hot and"})]:
        for usage in (True, False):
            chunks = stream(url, path, {**body, "max_tokens": 8, "stream_options": {"include_usage": usage}})
            carrying = [i for i, c in enumerate(chunks) if "kvscope" in c]
            assert carrying == [len(chunks) - 1], (path, usage)  # the last chunk only: the usage one, or the finish
            last = chunks[-1]
            assert ("usage" in last) == usage and (last["choices"] == []) == usage
            if usage:
                check(last["kvscope"]["cache"], last["usage"])
            else:
                assert last["choices"][0]["finish_reason"] is not None
                assert sum(last["kvscope"]["cache"][k] for k in ("reused", "recomputed", "dropped")) > 0


def stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + path, json={"model": "stories260K", "temperature": 0, "stream": True, **body},
                      headers={"Authorization": f"Bearer {KEY_A}"}, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_follow_up_reuses_the_prompt_and_the_reply(served):
    """The client sends the reply back as it got it: the follow-up finds the prompt and the reply in the cache
    (all but the reply's last token, never fed), not only the prompt before it (64 of 137 before, #35)."""
    _, url = served
    convo = [{"role": "user", "content": STORY}]
    for turn in range(3):
        resp = chat(url, convo, max_tokens=60)
        convo += [{"role": "assistant", "content": reply_of(resp)}, {"role": "user", "content": f"And then {turn}?"}]
        nxt = chat(url, convo, max_tokens=1)
        was = resp["usage"]["prompt_tokens"] + resp["usage"]["completion_tokens"]
        cached = nxt["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.95 * was, (turn, cached, was)
        check(nxt["kvscope"]["cache"], nxt["usage"])
        assert [m["reason"] for m in nxt["kvscope"]["cache"]["misses"]] == ["new"]  # only the new message


def test_an_edited_reply_is_rendered_as_sent(served):
    """A reply the client changed is not found (its text is the key): the prompt is the client's text, and the
    account says where it left the cache."""
    _, url = served
    convo = [{"role": "user", "content": "Tom had a big red ball."}]
    resp = chat(url, convo)
    edited = reply_of(resp) + " The end."
    nxt = chat(url, convo + [{"role": "assistant", "content": edited}, {"role": "user", "content": "Why?"}],
               max_tokens=1, return_token_ids=True)
    from engine.model.chat import render_chat

    ids = render_chat(served[0].lm.tokenizer, convo + [{"role": "assistant", "content": edited},
                                                       {"role": "user", "content": "Why?"}])
    assert nxt["prompt_token_ids"] == ids
    check(nxt["kvscope"]["cache"], nxt["usage"])


def test_accounts_never_tell_another_tenant_or_conversation(served):
    """Tenant B sends tenant A's whole conversation, reply included: nothing of A's is reused or named. Within A,
    a branch of another conversation is told in whole pages: no token-exact divergence, no text of the
    conversation it left."""
    _, url = served
    convo = [{"role": "user", "content": SECRET}]
    resp = chat(url, convo)
    follow = convo + [{"role": "assistant", "content": reply_of(resp)}, {"role": "user", "content": "What is it?"}]
    other = chat(url, follow, key=KEY_B, max_tokens=1)
    acc = other["kvscope"]["cache"]
    assert acc["reused"] == 0 and [m["reason"] for m in acc["misses"]] == ["new"]
    check(acc, other["usage"])
    chat(url, follow, max_tokens=4)  # A goes on: A's conversation is now the prompt, the reply, the question
    branch = chat(url, convo + [{"role": "assistant", "content": reply_of(resp)},
                                {"role": "user", "content": "Where is the box?"}], max_tokens=1)
    acc = branch["kvscope"]["cache"]
    check(acc, branch["usage"])
    assert acc["reused"] % PAGE == 0 and acc["reused"] > 0
    assert [m["reason"] for m in acc["misses"]] == ["partial_page"]
    for m in acc["misses"] + other["kvscope"]["cache"]["misses"]:
        assert "'" not in m["detail"] and "→" not in m["detail"]  # no token text quoted
        assert not any(w in m["detail"] for w in ("secret", "7391", "nobody", "box")), m["detail"]


def test_metrics_count_recomputed_tokens_by_reason(served):
    """``kvscope_prompt_tokens_recomputed_total{reason}``: every reason listed, the new request's computed
    tokens added to its reasons; a keyed server asks for the key."""
    _, url = served

    def sample() -> dict[str, float]:
        r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=DEADLINE_S)
        assert r.status_code == 200
        return parse(r.text)

    assert httpx.get(url + "/metrics", timeout=DEADLINE_S).status_code == 401
    before = sample()
    assert {f'kvscope_prompt_tokens_recomputed_total{{reason="{r}"}}' for r in REASONS} <= set(before)
    resp = chat(url, [{"role": "user", "content": "The little fish swam in the blue sea."}], max_tokens=2)
    after = sample()
    grew = {r: after[f'kvscope_prompt_tokens_recomputed_total{{reason="{r}"}}']
            - before[f'kvscope_prompt_tokens_recomputed_total{{reason="{r}"}}'] for r in REASONS}
    want: dict[str, int] = {}
    for m in resp["kvscope"]["cache"]["misses"]:
        want[m["reason"]] = want.get(m["reason"], 0) + m["end"] - m["start"]
    assert {r: n for r, n in grew.items() if n} == want


def test_the_pin_code_attack_learns_nothing_from_the_account(served, stories):
    """Within one tenant, the pin-code attack (tests/engine/test_server_tenants.py) read through the account: the
    guessed digit is the first token of a page, where the engine's own account differs between a right guess
    (a partial_page range, then diverged) and a wrong one (diverged at once, quoting the victim's cached token).
    The API tells every guess the same: one partial_page range from the last whole page (nothing quoted)."""
    _, url = served
    tok = stories.tokenizer
    base = tok(SECRET)["input_ids"]
    filler = [i for i in tok("Once upon a time there was a little girl who liked to play")["input_ids"]
              if i != base[0]]
    seven = tok.convert_tokens_to_ids("7")
    pad = next(p for p in range(PAGE) if (base.index(seven) + p) % PAGE == 0)
    ids = base[:1] + filler[:pad] + base[1:]
    at = ids.index(seven)
    seen = {}
    for d in "0123456789":
        post(url, "/v1/completions", {"prompt": ids, "max_tokens": 2}, KEY_B)  # the victim, idle again each time
        guess = ids[:at] + [tok.convert_tokens_to_ids(d)] + [ids[at + 1]]
        resp = post(url, "/v1/completions", {"prompt": guess, "max_tokens": 1}, KEY_B)
        check(resp["kvscope"]["cache"], resp["usage"])
        seen[d] = json.dumps(resp["kvscope"]["cache"], sort_keys=True)
    # whether the pool took the victim's conversation or made a new session depends on the digit (the right one
    # shares a token more, so the pool picks the victim's and finds it too little to take over): told alike
    assert len(set(seen.values())) == 1, " ".join(d + json.loads(v)["misses"][0]["reason"][0] for d, v in seen.items())
    assert [m["reason"] for m in json.loads(seen["7"])["misses"]] == ["partial_page"]
    assert all("'" not in m["detail"] for v in seen.values() for m in json.loads(v)["misses"])


def test_detokenize_answers_as_vllm_does(served, stories_path):
    """``POST /detokenize`` (vLLM's): a remote chat's account quotes where a prompt diverged in the server's own
    words. The key is checked; ids outside the vocabulary, too many or not ints are a 400 in one line."""
    from engine.remote.client import RemoteClient

    server, url = served
    ids = server.lm.tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    assert post(url, "/detokenize", {"tokens": ids})["prompt"] == "Once upon a time"
    assert RemoteClient(url, KEY_A).detokenize("stories260K", ids) == "Once upon a time"
    for bad, says in [({"tokens": [512]}, "0..511"), ({"tokens": "12"}, "list"), ({"tokens": [True]}, "list"),
                      ({"tokens": [1] * 5000}, "at most 4096")]:
        r = httpx.post(url + "/detokenize", json=bad, headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 400 and says in r.json()["error"]["message"]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).status_code == 401
    r = httpx.post(url + "/detokenize", json={"model": "other", "tokens": ids},
                   headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 404
