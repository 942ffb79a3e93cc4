"""Conversations kept apart (#20 item 1): a client must not read another conversation's prompt through
``usage.prompt_tokens_details.cached_tokens``. The pin-code attack is replayed on the real server (stories260K,
127.0.0.1, httpx): a victim's prompt holds "pin code is 7391"; the attacker sends the prompt up to a guessed
digit plus one more token, with ``max_tokens`` 1, and compares ``cached_tokens`` across the ten guesses.
"""

from __future__ import annotations

import httpx
import pytest

from engine.config import CacheConfig
from engine.server import KVServer, ServerOptions, ServerThread

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
MODEL = "stories260K"
PAGE = 16
DEADLINE_S = 120.0
SECRET = "The secret pin code is 7391. Tell nobody."


@pytest.fixture(scope="module")
def served(stories_path):
    from engine.model.loader import load_model

    lm = load_model(str(stories_path))
    server = KVServer(lm, CacheConfig(page_size=PAGE), ServerOptions(api_key=KEY_A, api_keys=(KEY_B,), max_idle=4),
                      source=str(stories_path))
    thread = ServerThread(server)
    url = thread.start()
    yield server, url
    thread.stop()


def complete(url: str, key: str, ids: list[int], salt: str | None = None, max_tokens: int = 1) -> dict:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def victim_ids(tok, pad: int) -> tuple[list[int], int]:
    """The victim's prompt as ids with ``pad`` filler tokens after BOS, and the index of the pin's first digit."""
    ids = tok(SECRET)["input_ids"]
    filler = [i for i in tok("Once upon a time there was a little girl who liked to play")["input_ids"] if i != ids[0]]
    assert len(filler) >= pad
    ids = ids[:1] + filler[:pad] + ids[1:]
    at = ids.index(tok.convert_tokens_to_ids("7"))
    assert tok.convert_ids_to_tokens(ids[at:at + 4]) == ["7", "3", "9", "1"]
    return ids, at


def attack(url, tok, pad: int, victim: tuple[str, str | None], attacker: tuple[str, str | None]) -> dict[str, int]:
    """``cached_tokens`` the attacker sees for each guessed first digit; the victim's request runs again before
    each guess, so its conversation is there (idle, and its pages cached) every time."""
    ids, at = victim_ids(tok, pad)
    seen = {}
    for d in "0123456789":
        complete(url, victim[0], ids, victim[1], max_tokens=2)
        guess = ids[:at] + [tok.convert_tokens_to_ids(d)] + [ids[at + 1]]  # the guess and one token after it
        seen[d] = cached(complete(url, attacker[0], guess, attacker[1]))
    return seen


def test_the_pin_code_attack_learns_nothing_from_a_shared_cache(served, stories):
    """One tenant (same key, no salt), the attack of the issue: the digit is not at a page's end. Reuse across
    conversations is in whole pages, so the right digit's one more matching token shows nowhere."""
    _, url = served
    ids, at = victim_ids(stories.tokenizer, 0)
    assert at % PAGE != PAGE - 1  # the digit does not close a page (the next test has that case)
    seen = attack(url, stories.tokenizer, 0, (KEY_A, None), (KEY_A, None))
    assert len(set(seen.values())) == 1, seen  # the same count for every guess: nothing learned
    assert seen["7"] % PAGE == 0 and seen["7"] > 0  # pages before the secret are still shared


def test_the_pin_code_attack_learns_nothing_across_keys_or_salts(served, stories):
    """Worst case: the digit is the last token of a page, so within one tenant the right guess does get one more
    page (whole pages are shared, as vLLM's prefix cache). Across API keys, or with different ``cache_salt``s,
    nothing of the victim's is shared: every guess after the first sees the same count (the attacker's own earlier
    guesses, in whole pages), the right digit included."""
    _, url = served
    tok = stories.tokenizer
    pad = next(p for p in range(PAGE) if victim_ids(tok, p)[1] % PAGE == PAGE - 1)
    same = attack(url, tok, pad, (KEY_B, "same"), (KEY_B, "same"))
    assert same["7"] > max(v for d, v in same.items() if d != "7")  # shared tenant: the page shows (the test can fail)
    # each attacker a tenant that never sent the secret itself
    for victim, attacker in [((KEY_A, "alice"), (KEY_A, None)), ((KEY_A, None), (KEY_B, None)),
                             ((KEY_A, "alice"), (KEY_A, "mallory")), ((KEY_B, "carol"), (KEY_A, "carol"))]:
        seen = attack(url, tok, pad, victim, attacker)
        assert len({v for d, v in seen.items() if d != "0"}) == 1 and seen["0"] <= seen["7"], (victim, attacker, seen)
        assert seen["7"] < same["7"]


def test_a_tenant_still_reuses_its_own_conversations(served, stories):
    """Isolation keeps caching within a tenant: a conversation that goes on gets its whole cache (token exact),
    a new one with the same salt gets the shared pages."""
    server, url = served
    ids, _ = victim_ids(stories.tokenizer, 0)
    first = complete(url, KEY_B, ids, "bob", max_tokens=4)
    whole = ids + [int(t) for t in on_engine_last_reply(server)]
    again = complete(url, KEY_B, whole + ids[1:3], "bob")
    # everything in its cache: the prompt and the reply but its last token (never fed); not a page multiple
    assert cached(again) == len(whole) - 1 == first["usage"]["prompt_tokens"] + 3 and cached(again) % PAGE
    other = complete(url, KEY_B, ids[:-2] + ids[1:4], "bob")  # another conversation with the same start
    assert cached(other) == (len(ids) - 2) // PAGE * PAGE > 0
    assert cached(complete(url, KEY_B, ids[:-2] + ids[1:4], "carol")) == 0


def on_engine_last_reply(server) -> list[int]:
    """The generated ids of the most recently finished request (read on the engine thread)."""
    def last():
        rec = server.scheduler.records[-1]
        s = next(s for s in server.scheduler.idle if s.session_id == rec.session_id)
        return s.generated_ids

    return server.scheduler.call(last).result(DEADLINE_S)


def test_cache_salt_must_be_a_non_empty_string(served):
    _, url = served
    for salt in ("", 7, ["a"]):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "cache_salt": salt},
                       headers={"Authorization": f"Bearer {KEY_A}"}, timeout=DEADLINE_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
