"""Why each prompt token was recomputed (#35 item 3): every reason of ``MissReason`` produced by a real scenario —
stories260K and tiny random models of real configs, real pages, a real disk folder — and asserted on its range,
with the account's sums: ``reused + recomputed + dropped == prompt`` and the misses cover the recomputed tokens."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.account import LAST_TOKEN
from engine.core.scheduler import drive
from engine.core.session import ChatSession
from engine.snapshot import CacheAccount, MissReason
from test_layer_kinds import tiny

SYSTEM = {"role": "system", "content": "You are a kind storyteller."}
USER = {"role": "user", "content": "Tell me about a cat."}


def check(a: CacheAccount) -> CacheAccount:
    assert a.reused + a.recomputed + a.dropped == a.prompt
    at = a.reused + a.dropped
    for m in a.misses:  # in order, back to back, to the prompt's end
        assert m.start == at and m.end > m.start and m.detail
        at = m.end
    assert at == a.prompt or not a.misses and a.recomputed == 0
    return a


def turn(s: ChatSession, messages=None, ids=None, n=8) -> tuple[CacheAccount, str]:
    sampling = SamplingConfig(max_new_tokens=n, ignore_eos=True)
    s.start(messages, sampling) if messages is not None else s.start_ids(ids, sampling)
    for _ in drive(s):
        pass
    text = s.tokenizer.decode(list(s.generated_ids), skip_special_tokens=True) if s.tokenizer else ""
    return check(s.last_stats.cache), text


def reasons(a: CacheAccount) -> list[tuple[int, int, str]]:
    return [(m.start, m.end, m.reason.value) for m in a.misses]


@pytest.fixture
def own(stories):
    """stories260K with page arenas of its own: these chats' pages never reach another test's prefix cache."""
    import dataclasses

    return dataclasses.replace(stories, arenas=None)


@pytest.fixture
def chat(own):
    s = ChatSession(own, CacheConfig(mode="paged", page_size=16))
    yield s
    s.close()


def test_new_then_follow_up_then_regenerate(chat):
    a, reply = turn(chat, [SYSTEM, USER])
    assert reasons(a) == [(0, a.prompt, "new")] and a.reused == 0
    follow = [SYSTEM, USER, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    b, _ = turn(chat, follow)
    fed = a.prompt + 8 - 1  # the reply's ids are in the follow-up's prompt: all of it reused
    assert b.reused == fed and reasons(b) == [(fed, b.prompt, "new")]
    c, _ = turn(chat, follow)  # regenerate
    assert reasons(c) == [(c.prompt - 1, c.prompt, "new")] and c.misses[0].detail == LAST_TOKEN


def test_a_changed_system_prompt_diverges_where_its_text_does(chat):
    a, _ = turn(chat, [SYSTEM, USER])
    b, _ = turn(chat, [{"role": "system", "content": "You're a kind storyteller."}, USER])
    (m,) = b.misses
    assert m.reason is MissReason.DIVERGED and m.start == b.reused > 0 and m.end == b.prompt
    assert "'are" in m.detail and "'re" in m.detail and f"token {m.start}" in m.detail


def test_an_edit_of_the_last_message_diverges_inside_it(chat):
    a, _ = turn(chat, [SYSTEM, USER])
    b, _ = turn(chat, [SYSTEM, {"role": "user", "content": "Tell me about a dog."}])
    assert [m.reason for m in b.misses] == [MissReason.DIVERGED]
    assert a.prompt - 14 < b.misses[0].start < a.prompt - 8  # at 'cat' → 'dog', not before


def test_an_eviction_policy(own):
    s = ChatSession(own, CacheConfig(mode="paged", page_size=4, policy="streaming",
                                         policy_params={"sinks": 4, "window": 32}))
    a, _ = turn(s, ids=list(range(5, 45)), n=30)
    b, _ = turn(s, ids=list(range(5, 45)) + [9, 9, 9])  # not a continuation of everything fed: from the text
    assert reasons(b)[0] == (4, 40, "policy") and "streaming" in b.misses[0].detail
    s.close()


def test_a_full_context_evicts(own):
    ctx = own.info.context_length
    s = ChatSession(own, CacheConfig(mode="paged", page_size=16, overflow="rolling"))
    ids = [5 + i % 300 for i in range(ctx - 40)]
    turn(s, ids=ids, n=80)  # past the context: the rolling overflow drops the oldest
    b, _ = turn(s, ids=ids[:100] + [7])
    assert b.misses[0].reason is MissReason.EVICTED and b.misses[0].start == b.reused < 100
    s.close()


def test_settings_prefix_reuse_off_and_a_switch_that_moves_the_cache(chat):
    turn(chat, [SYSTEM, USER])
    chat.apply(CacheConfig(mode="paged", page_size=4, k_dtype="int8", v_dtype="int8"))  # moved, not lost
    a, _ = turn(chat, [SYSTEM, USER])
    assert reasons(a) == [(a.prompt - 1, a.prompt, "new")]
    chat.apply(CacheConfig(mode="paged", page_size=4, prefix_reuse=False))
    b, _ = turn(chat, [SYSTEM, USER])
    assert reasons(b) == [(0, b.prompt, "settings")]


def test_cache_off_and_back_on(chat):
    turn(chat, [SYSTEM, USER])
    chat.apply(CacheConfig(mode="off"))
    a, _ = turn(chat, [SYSTEM, USER])
    assert reasons(a) == [(0, a.prompt, "off")]
    chat.apply(CacheConfig(mode="paged"))
    b, _ = turn(chat, [SYSTEM, USER])
    # the prefix cache kept the first turn's full pages (other chats could take them); the rest was this chat's
    assert b.reused == 48 and reasons(b) == [(48, b.prompt - 1, "off"), (b.prompt - 1, b.prompt, "new")]
    assert b.misses[0].detail == "the cache was off"


@pytest.mark.parametrize("model_type, reason", [("gemma3_text", "window"), ("lfm2", "state")])
def test_sliding_windows_and_states_without_a_checkpoint(model_type, reason):
    _, lm = tiny(model_type)
    ids = list(range(5, 45))
    for checkpoints in (0, 8):
        s = ChatSession(lm, CacheConfig(mode="paged", page_size=4, checkpoints=checkpoints))
        turn(s, ids=ids, n=20)
        a, _ = turn(s, ids=ids)  # regenerate
        if checkpoints:  # the checkpoint before the prompt's last token
            assert reasons(a) == [(39, 40, "new")]
        else:
            # the prefix cache's whole pages (36) come back; the 3 tokens after them wait for a checkpoint
            assert a.reused == 36 and reasons(a)[0] == (36, 39, reason), reasons(a)
            assert ("checkpoint" if reason == "state" else "sliding-window") in a.misses[0].detail
        s.close()


def test_a_damaged_disk_page(stories_path, tmp_path):
    from engine.kv.tier import disk
    from engine.model.loader import load_model

    ids = [5 + (i * 37) % 400 for i in range(200)]
    lm = load_model(str(stories_path))
    disk.configure(lm, str(tmp_path))
    s = ChatSession(lm, CacheConfig(page_size=16))
    turn(s, ids=ids)
    s.close()
    lm.kv_arenas.disk.flush()
    arena = lm.kv_arenas.get(16, None, "auto", "auto")
    shelf = lm.kv_arenas.disk.shelf(arena)
    from engine.kv.paged.prefix import ROOT, extend_chain

    chain: list[bytes] = []
    extend_chain(chain, ids, 16, 12, ROOT)
    bad = lm.kv_arenas.disk._path(shelf, chain[5])
    raw = open(bad, "rb").read()
    open(bad, "wb").write(raw[:len(raw) // 2])
    disk.configure(lm, None)
    again = load_model(str(stories_path))  # a restart: nothing in memory
    disk.configure(again, str(tmp_path))
    s = ChatSession(again, CacheConfig(page_size=16))
    a, _ = turn(s, ids=ids)
    assert a.reused == 5 * 16 and reasons(a)[0] == (80, 96, "disk")
    s.close()
    disk.configure(again, None)


def test_whole_pages_across_conversations(own):
    from engine.core.session_pool import CLOSE, SessionPool

    pool = SessionPool(own, CacheConfig(page_size=16), evict=CLOSE)
    s, _ = pool.take(list(range(5, 90)))
    turn(s, ids=list(range(5, 90)))
    pool.put(s)
    other = list(range(5, 75)) + [400, 401, 402]  # shares 70 tokens of 85: whole pages only (64)
    s2, shared = pool.take(other)
    assert shared == 64
    a, _ = turn(s2, ids=other)
    assert reasons(a)[0] == (64, 70, "partial_page") and "whole pages of 16" in a.misses[0].detail
    s2.close()


def test_a_divergence_that_prints_the_same_names_the_tokens(stories):
    """Two token sequences with the same text ("▁t" against "▁" "t"): the detail says which tokens differ, not
    "'t' → 't'" (two identical strings, #49 item 5)."""
    from engine.core.account import token_change

    tok = stories.tokenizer
    one, space, t = tok.convert_tokens_to_ids(["▁t", "▁", "t"])
    said = token_change(tok, [1, one], [1, space, t], 1)
    assert said == f"[▁t #{one}] → [▁ #{space}, t #{t}] (the same text, other tokens)", said
    a = tok.convert_tokens_to_ids("a")
    assert token_change(tok, [1, one], [1, a], 1) == "'t' → 'a'"  # different texts: quoted as before
