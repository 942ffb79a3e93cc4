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


def test_close_mode_takes_the_longest_shared_prefix_of_the_tenant_and_closes_to_make_room(stories):
    """The server's mode: an idle conversation goes on where a prompt extends it, only for its own tenant; at
    most ``max_sessions`` idle ones are kept, and a request that needs pages closes them (each an eviction)."""
    from engine.core.session_pool import CLOSE

    evicted = []
    pool = SessionPool(stories, CacheConfig(mode="paged", page_size=8), 2, evict=CLOSE,
                       on_evict=lambda: evicted.append(1))
    msgs = [{"role": "user", "content": "Tell me about a cat."}]
    a, shared = pool.take([1, 2, 3], b"t1")
    assert shared == 0 and len(pool) == 0
    _, r = reply(a, msgs)
    pool.put(a)
    ids = list(a.seq) + [5, 6, 7]
    other, shared = pool.take(ids, b"t2")  # another tenant never finds it
    assert other is not a and shared == 0 and len(pool) == 1
    again, shared = pool.take(ids, b"t1")
    assert again is a and shared == a.index.intact and len(pool) == 0
    for s in (a, other):
        pool.put(s)
    pool.put(pool.new_session(b"t3"))  # a third idle one: the least recently used is closed
    assert len(pool) == 2 and a.closed and evicted == [1]
    assert pool.reclaim() and len(pool) == 0 and evicted == [1, 1, 1]
    assert not pool.reclaim()
