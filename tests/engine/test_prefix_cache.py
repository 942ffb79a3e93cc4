"""Automatic prefix caching across sessions: the hash chain, the pool's cached LRU (exact ids), sessions that
share a system prompt's pages by reference count, eviction under pressure, and settings that never share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine import snapshot as snap
from engine.config import CacheConfig, SamplingConfig
from engine.kv.paged.block_table import BlockTable
from engine.kv.paged.pool import PAGE_CACHED, PAGE_FREE, PagePool
from engine.kv.paged.prefix import ROOT, extend_chain, page_hash
from engine.core.session import ChatSession

from tests.engine.test_exact import hf_greedy

P = 16
N_NEW = 40


# -- the hash chain ------------------------------------------------------------------------------------
def test_chain_names_pages_by_every_token_before_them():
    ids = list(range(40))
    chain = extend_chain([], ids, 8, 99)
    assert len(chain) == 5  # full pages only
    assert chain[0] == page_hash(ROOT, ids[:8]) and chain[1] == page_hash(chain[0], ids[8:16])
    other = extend_chain([], [99] + ids[1:], 8, 5)
    assert all(a != b for a, b in zip(chain, other))  # a different first token renames every page after it
    assert extend_chain(chain[:2], ids, 8, 5) == chain  # extending a prefix of the chain gives the same names
    assert extend_chain([], ids, 16, 5) != chain[:2]  # another page size: other names


# -- the pool: exact ids -------------------------------------------------------------------------------
def test_pool_keeps_unheld_hashed_pages_cached_and_evicts_lru_after_free_pages():
    pool = PagePool(6, page_size=4)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    for p, h in zip(a, (b"a", b"b", b"c")):
        pool.fill[p] = 4
        assert pool.register(p, h)
    assert not pool.register(0, b"x") and not pool.register(1, b"a")  # one name per page, one page per name
    for p in reversed(a):  # tail first, as a table frees: the tail is the least recently used
        pool.decref(p)
    assert pool.num_free == 6 and pool.num_cached == 3 and pool.num_used == 0
    assert pool.cached_pages() == [2, 1, 0]
    assert pool.page_states()[:4].tolist() == [PAGE_CACHED, PAGE_CACHED, PAGE_CACHED, PAGE_FREE]
    pool.check()
    # a prompt takes page 0 back (by its name): it leaves the LRU, held with ref 1
    assert pool.lookup(b"a") == 0
    pool.take(0, owner=5, session=9)
    assert pool.ref[0] == 1 and pool.cached_pages() == [2, 1] and pool.session[0] == 9
    pool.take(0)
    assert pool.ref[0] == 2  # a held page is shared
    # allocation: the truly free pages first (lowest ids), then cached pages least recently used first
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.allocate(1) == [2] and pool.lookup(b"c") is None and pool.cache_evictions == 1
    assert pool.lookup(b"b") == 1  # still cached
    assert pool.allocate(1) == [1] and pool.lookup(b"b") is None
    with pytest.raises(Exception, match="KV cache full"):
        pool.allocate(1)  # page 0 is held (ref 2): never evicted
    assert pool.lookup(b"a") == 0
    pool.check()


def test_unhash_frees_a_cached_page_and_shrink_drops_cached_pages():
    pool = PagePool(4, page_size=2)
    pages = pool.allocate(4)
    for p in pages:
        pool.fill[p] = 2
        pool.register(p, bytes([p]))
    for p in pages:
        pool.decref(p)
    pool.unhash(1)
    assert pool.lookup(bytes([1])) is None and pool.cached_pages() == [0, 2, 3]
    assert pool.allocate(1) == [1]  # the unhashed page is truly free: taken before any cached page
    pool.decref(1)
    pool.shrink_to(2)  # pages 2 and 3 were cached: gone with their names
    assert pool.num_pages == 2 and pool.lookup(bytes([2])) is None and pool.lookup(bytes([0])) == 0
    pool.check()


def test_table_cut_back_into_a_cached_page_writes_a_copy_or_drops_the_name():
    pool = PagePool(8, page_size=4)
    t = BlockTable(pool)
    t.append(8)
    pool.register(t.pages[0], b"p0")
    pool.register(t.pages[1], b"p1")
    other = BlockTable(pool)
    other.adopt([t.pages[0], t.pages[1]])  # 8 tokens by reference
    assert other.pages == [0, 1] and pool.ref[1] == 2 and other.num_tokens == 8
    other.truncate(6)  # page 1 is shared: still named, copied before the write
    assert pool.lookup(b"p1") == 1
    copies = other.append(1)
    assert copies == [(1, 2)] and other.pages == [0, 2] and pool.lookup(b"p1") == 1
    t.truncate(6)  # held alone now, and partial: no longer that page
    assert pool.lookup(b"p1") is None and pool.fill[1] == 2
    pool.check()


# -- sessions on stories260K ---------------------------------------------------------------------------
SYSTEM = ("You tell short stories about a little girl named Lily who loved to play outside in the sun with "
          "her dog Max and her friend Tim. ") * 3


def fresh(lm):
    """The model with page arenas of its own (no pages cached by other tests)."""
    return dataclasses.replace(lm, arenas=None)


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def reply(s: ChatSession, msgs, n=N_NEW):
    st = s.start(msgs, SamplingConfig(max_new_tokens=n, ignore_eos=True))
    while not (r := s.step()).done:
        pass
    return st, r


def shared_prefix_pages(lm, a: str, b: str, page: int) -> int:
    from engine.model.chat import render_chat
    from engine.core.sequence import common_prefix

    ia, ib = render_chat(lm.tokenizer, chat(a)), render_chat(lm.tokenizer, chat(b))
    return common_prefix(ia, ib) // page


@pytest.mark.parametrize("page", [16, 5])
def test_second_session_shares_the_system_prompt_pages_and_stays_exact(stories, page):
    lm = fresh(stories)
    cfg = CacheConfig(page_size=page)
    qa, qb = "One day she saw a big red ball.", "Tim had a dog."
    full = shared_prefix_pages(lm, qa, qb, page)
    assert full >= 5
    a = ChatSession(lm, cfg)
    st_a, _ = reply(a, chat(qa))
    assert st_a.reused_tokens == 0
    b = ChatSession(lm, cfg)
    st_b, rb = reply(b, chat(qb))
    assert st_b.reused_tokens == st_b.shared_tokens == full * page
    assert st_b.recomputed_tokens == st_b.prompt_tokens - full * page
    assert rb.stats.reused_tokens == full * page
    pool = a.store.arena.pool
    shared = b.store.table.pages[:full]
    assert shared == a.store.table.pages[:full]
    assert [pool.ref[p] for p in shared] == [2] * full  # both sessions hold them
    sn = b.snapshot()
    assert (sn.page_refcount[shared] == 2).all() and (sn.page_state[shared] == snap.PAGE_SHARED).all()
    assert (np.delete(sn.page_refcount, shared)[:len(b.store.table.pages)] <= 1).all()
    pool.check()
    # the same greedy tokens as HF and as a session that shares nothing
    from engine.model.chat import render_chat

    ids_b = render_chat(lm.tokenizer, chat(qb))
    assert b.generated_ids == hf_greedy(lm, ids_b, N_NEW)
    alone = ChatSession(fresh(stories), cfg)
    st_alone, _ = reply(alone, chat(qb))
    assert st_alone.reused_tokens == 0 and alone.generated_ids == b.generated_ids
    # closing the first keeps the pages: still held by b (ref 1), and cached once b closes too
    a.close()
    assert [pool.ref[p] for p in shared] == [1] * full
    b.close()
    assert pool.num_used == 0 and set(shared) <= set(pool.cached_pages())
    c = ChatSession(lm, cfg)
    st_c, _ = reply(c, chat("The sun was hot."))
    full_c = shared_prefix_pages(lm, qa, "The sun was hot.", page)
    assert st_c.shared_tokens == full_c * page and c.store.table.pages[:full_c] == shared[:full_c]
    sn = c.snapshot()
    assert (sn.page_state[[p for p in pool.cached_pages()]] == snap.PAGE_CACHED).all()
    assert sn.pages_used == len(c.store.table.pages)
    c.close()
    alone.close()
    pool.check()


def test_a_later_turn_of_the_same_session_takes_cached_pages_of_another(stories):
    """A session that already has a conversation goes on past its own kept prefix with cached pages."""
    lm = fresh(stories)
    cfg = CacheConfig(page_size=8)
    a = ChatSession(lm, cfg)
    reply(a, chat("One day she saw a big red ball."), n=4)
    b = ChatSession(lm, cfg)
    reply(b, [{"role": "user", "content": "Hi."}], n=4)
    st, _ = reply(b, chat("Tim had a dog."), n=4)  # diverges from b's cache at once: a's pages go on from 0
    assert st.shared_tokens >= 8 * 5 and st.reused_tokens == st.shared_tokens
    a.close()
    b.close()
    a.store.arena.pool.check()


def test_pool_under_pressure_evicts_cached_pages_lru_first_and_never_held_ones(stories):
    lm = fresh(stories)
    cfg = CacheConfig(page_size=16, max_pages=24)
    a = ChatSession(lm, cfg)
    reply(a, chat("One day she saw a big red ball."), n=8)
    pool = a.store.arena.pool
    a_pages = list(a.store.table.pages)
    a.close()
    lru = pool.cached_pages()
    full = (len(a.seq) - 1) // 16  # full pages (the last token was not fed)
    assert lru == a_pages[:full][::-1]  # full pages only, the tail evicted first
    held = ChatSession(lm, cfg)
    reply(held, [{"role": "user", "content": "Max ran fast in the park."}], n=8)
    h_pages = list(held.store.table.pages)
    # taken from the truly free pages (a's partial last page among them): none of a's cached pages was evicted
    assert not set(h_pages) & set(lru) and pool.cached_pages() == lru
    free_now = pool.num_free - pool.num_cached
    big = ChatSession(lm, cfg)
    words = "the little dog ran to the big park and saw a red ball in the sun " * 12
    st, _ = reply(big, [{"role": "user", "content": words}], n=8)
    need = len(big.store.table.pages)
    evicted = need - free_now
    assert evicted > 0 and pool.cached_pages() == lru[evicted:]  # least recently used first
    assert not set(big.store.table.pages) & set(h_pages)  # a held page is never evicted
    assert all(pool.ref[p] == 1 for p in h_pages)
    assert held.generated_ids == hf_greedy(lm, held.seq[:len(held.seq) - 8], 8)
    for s in (held, big):
        s.close()
    pool.check()


@pytest.mark.parametrize("other", [CacheConfig(page_size=8), CacheConfig(page_size=16, k_dtype="int8",
                                                                        v_dtype="int8"),
                                   CacheConfig(page_size=16, policy="h2o", policy_params={"budget": 400,
                                                                                           "recent": 8}),
                                   CacheConfig(page_size=16, prefix_reuse=False),
                                   CacheConfig(mode="contiguous")],
                         ids=["page8", "int8", "h2o", "no-reuse", "contiguous"])
def test_other_settings_never_share(stories, other):
    lm = fresh(stories)
    a = ChatSession(lm, CacheConfig(page_size=16))
    reply(a, chat("One day she saw a big red ball."), n=4)
    b = ChatSession(lm, other)
    st, _ = reply(b, chat("Tim had a dog."), n=4)
    assert st.reused_tokens == 0 and st.shared_tokens == 0
    if getattr(b.store, "arena", None) is a.store.arena:  # same pool (h2o, no reuse): nothing held twice
        assert all(a.store.arena.pool.ref[p] == 1 for p in b.store.table.pages)
    # nothing b computed is offered to a 16-token auto session afterwards, unless b is one (reuse off for itself)
    c = ChatSession(lm, CacheConfig(page_size=16))
    st_c, _ = reply(c, chat("Tim had a dog."), n=4)
    from engine.model.chat import render_chat

    if other == CacheConfig(page_size=16, prefix_reuse=False):
        expect = (len(render_chat(lm.tokenizer, chat("Tim had a dog."))) - 1) // 16
    else:
        expect = shared_prefix_pages(lm, "One day she saw a big red ball.", "Tim had a dog.", 16)
    assert st_c.shared_tokens == expect * 16
    for s in (a, b, c):
        s.close()


def test_int8_sessions_do_not_register_pages(stories):
    lm = fresh(stories)
    cfg = CacheConfig(page_size=16, k_dtype="int8", v_dtype="int8")
    a = ChatSession(lm, cfg)
    reply(a, chat("One day she saw a big red ball."), n=4)
    pool = a.store.arena.pool
    assert all(h is None for h in pool.hash)
    b = ChatSession(lm, cfg)
    st, _ = reply(b, chat("One day she saw a big red ball."), n=4)
    assert st.shared_tokens == 0
    a.close()
    b.close()
    assert pool.num_cached == 0


def test_eviction_policy_switched_on_drops_names_of_rewritten_pages(stories):
    """A session switches to StreamingLLM and compacts its pages in place: their names must go first."""
    lm = fresh(stories)
    a = ChatSession(lm, CacheConfig(page_size=8))
    reply(a, chat("One day she saw a big red ball."), n=4)
    pool = a.store.arena.pool
    named = sum(1 for h in pool.hash if h is not None)
    assert named >= 5
    a.apply(CacheConfig(page_size=8, policy="streaming", policy_params={"sinks": 4, "window": 20}))
    pool.check()
    intact = a.index.intact // 8
    rewritten = a.store.table.pages[intact:]
    assert intact == 0 and len(rewritten) == 3  # sinks + window packed to the front of pages 0..2
    assert all(pool.hash[p] is None for p in rewritten)
    b = ChatSession(lm, CacheConfig(page_size=8))
    st, _ = reply(b, chat("Tim had a dog."), n=N_NEW)
    assert not set(rewritten) & set(b.store.table.pages)
    assert st.shared_tokens == 0  # page 0 (the chain's first) was rewritten: no chain to follow
    from engine.model.chat import render_chat

    assert b.generated_ids == hf_greedy(lm, render_chat(lm.tokenizer, chat("Tim had a dog.")), N_NEW)
    a.close()
    b.close()
    pool.check()


def test_a_page_size_switch_before_the_prefill_names_pages_for_the_new_size(stories):
    """The prompt's page names were computed for pages of 16 when the reply started; switched to pages of 1
    before its first step, every page the prefill registers is named by its own tokens (hypothesis found pages
    named with the 16-token chain)."""
    from test_session_machine import check_pages

    lm = fresh(stories)
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=16))
    s.start(chat("Once upon a time there was a little girl named Lily who loved to play outside"),
            SamplingConfig(max_new_tokens=4, ignore_eos=True))
    s.apply(CacheConfig(mode="paged", page_size=1, prefix_reuse=False))
    while not s.step().done:
        pass
    check_pages(lm, [s])  # every cached / held page's name equals the chain of the tokens it holds
    pool = s.store.arena.pool
    assert sum(1 for h in pool.hash if h is not None) >= len(s.seq) - 2


def test_swap_in_takes_back_the_pages_still_cached_and_copies_the_rest(stories):
    """A chat swapped out leaves its full pages in the prefix cache; swapping it back in takes those pages
    back as they are (same page ids, no copy) and copies only the partial last page. When another chat has
    taken the pages meanwhile, everything comes back from host memory. Either way the next turn is exact."""
    from engine.model.chat import render_chat

    lm = fresh(stories)
    cfg = CacheConfig(mode="paged", page_size=16, max_pages=24)
    msgs = chat("Once upon a time there was a little girl")
    s = ChatSession(lm, cfg)
    _, r = reply(s, msgs, n=40)
    follow = msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "What happened next?"}]
    expected_ids = render_chat(lm.tokenizer, follow)
    ref = ChatSession(lm, CacheConfig(mode="paged", page_size=16, prefix_reuse=False))
    ref.start_ids(expected_ids, SamplingConfig(max_new_tokens=N_NEW, ignore_eos=True))
    while not ref.step().done:
        pass
    expected = ref.generated_ids
    ref.close()

    pages, n = list(s.store.table.pages), s.cached_tokens
    full = n // 16
    s.swap_out()
    s.cache.swap_in(s.seq)
    assert s.store.table.pages[:full] == pages[:full]
    _, r2 = reply(s, follow)
    assert s.cache.reused.swapped_in_pages == full  # the turn's record says so
    assert s.generated_ids == expected

    s.swap_out()  # now another chat takes every page the pool has, cached ones included
    other = ChatSession(lm, cfg)
    other.start_ids(list(range(5, 5 + 24 * 16 - 1)), SamplingConfig(max_new_tokens=1, ignore_eos=True))
    while not other.step().done:
        pass
    other.close()
    s.cache.swap_in(s.seq)
    _, r3 = reply(s, follow)
    assert s.cache.reused.swapped_in_pages == 0
    assert s.generated_ids == expected


def test_pages_cached_after_the_arena_shrinks_keep_their_k_v(stories):
    """A chat closes and the arena shrinks (``PageArena.trim``) while pages of the prefix cache stay named below
    its new size: their K/V go with them, so the next chat's reuse gives HF's greedy tokens (the copy once kept
    only the pages in use, leaving cached pages named over memory nobody wrote)."""
    lm = fresh(stories)
    cfg = CacheConfig(page_size=4)
    ids = [5 + (i * 37) % 400 for i in range(200)]
    a = ChatSession(lm, cfg)
    a.start_ids(ids, SamplingConfig(max_new_tokens=1, ignore_eos=True))
    while not a.step().done:
        pass
    arena = a.store.arena
    arena.initial_pages = 8  # a small first size: closing the chat shrinks the arena to 8 pages, 0..7 kept cached
    a.close()
    assert arena.pool.num_pages == 8 and arena.pool.num_cached == 8
    b = ChatSession(lm, cfg)
    prompt = ids[:40] + [9, 9]
    st = b.start_ids(prompt, SamplingConfig(max_new_tokens=8, ignore_eos=True))
    while not b.step().done:
        pass
    assert st.reused_tokens == 32  # the 8 pages still cached
    assert list(b.generated_ids) == hf_greedy(lm, prompt, 8)
    b.close()
