"""SessionPool: one session per chat, idle chats swapped to host memory and back with identical output."""

from __future__ import annotations

from engine.config import CacheConfig, SamplingConfig
from engine.core.session_pool import SessionPool

SAMPLING = SamplingConfig(max_new_tokens=20)


def reply(session, msgs):
    st = session.start(msgs, SAMPLING)
    while not (r := session.step()).done:
        pass
    return st, r


def test_switching_chats_swaps_idle_ones_and_reuses_each_cache(stories):
    pool = SessionPool(stories, CacheConfig(mode="paged", page_size=8))
    a_msgs = [{"role": "user", "content": "Tell me about a cat."}]
    b_msgs = [{"role": "user", "content": "Tell me about a dog."}]
    a, _ = pool.activate("a")
    _, ra = reply(a, a_msgs)
    arena = a.store.arena  # shared with other sessions of this model (other tests hold pages too)
    a_pages = len(a.store.table.pages)
    used = arena.pool.num_used
    b, notes = pool.activate("b")
    assert a.offloaded and any("swapped to host memory" in n for n in notes)
    assert a_pages > 0 and arena.pool.num_used == used - a_pages  # a's pages went back to the pool
    assert len(a.store.table.pages) == 0
    reply(b, b_msgs)
    a2, notes = pool.activate("a")
    assert a2 is a and b.offloaded
    a_msgs2 = a_msgs + [{"role": "assistant", "content": ra.text}, {"role": "user", "content": "More."}]
    st, r = reply(a, a_msgs2)
    assert st.reused_tokens > 0 and not a.offloaded and len(a.store.table.pages) >= a_pages
    # the same conversation in a fresh session that never swapped gives the same tokens
    from engine.core.session import ChatSession

    fresh = ChatSession(stories, CacheConfig(mode="paged", page_size=8))
    reply(fresh, a_msgs)
    _, r2 = reply(fresh, a_msgs2)
    assert r.text == r2.text
    pool.drop("b")
    assert "b" not in pool and len(pool) == 1
    pool.close()


def test_new_settings_reach_each_chat_when_it_becomes_active(stories):
    pool = SessionPool(stories, CacheConfig(mode="paged", page_size=8), max_sessions=2)
    a, _ = pool.activate("a")
    reply(a, [{"role": "user", "content": "Hi"}])
    pool.activate("b")
    pool.apply(CacheConfig(mode="contiguous"))
    a, notes = pool.activate("a")
    assert a.cache_config.mode == "contiguous"
    _, notes = pool.activate("c")
    assert any("cache dropped" in n for n in notes) and "b" not in pool
