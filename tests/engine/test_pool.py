"""Page pool and block tables: exact ids, free order, and invariants under random operation sequences."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.errors import CacheCapacityError
from engine.kv.paged.block_table import BlockTable
from engine.kv.paged.pool import (FLAG_OFFLOADED, FLAG_PINNED, FLAG_QUANTIZED, PAGE_ACTIVE, PAGE_CACHED, PAGE_FREE,
                                  PAGE_OFFLOADED, PAGE_PINNED, PAGE_QUANTIZED, PAGE_SHARED, PagePool)


def page_state(pool: PagePool, p: int) -> int:
    """One page's code by the rules, page by page (``page_states`` computes them over whole arrays)."""
    ref, flags = pool.ref[p], pool.flags[p]
    if ref == 0:
        return PAGE_FREE if pool.hash[p] is None else PAGE_CACHED
    for flag, code in ((FLAG_OFFLOADED, PAGE_OFFLOADED), (FLAG_PINNED, PAGE_PINNED), (FLAG_QUANTIZED, PAGE_QUANTIZED)):
        if flags & flag:
            return code
    return PAGE_SHARED if ref > 1 else PAGE_ACTIVE


def test_allocate_lowest_ids_first_and_reuse_freed_in_order():
    pool = PagePool(8, page_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.decref(1)
    pool.decref(3)
    assert pool.num_free == 5
    assert pool.allocate(3) == [1, 3, 5]
    pool.check()


def test_pool_never_grows_by_itself_and_shrinks_its_free_tail():
    pool = PagePool(2, page_size=4)
    assert pool.allocate(2) == [0, 1]
    assert not pool.can_allocate(1)
    with pytest.raises(CacheCapacityError, match="KV cache full"):
        pool.allocate(1)
    assert pool.num_pages == 2  # nothing taken, nothing grown: growing is the arena's call
    pool.grow_to(5)
    assert pool.allocate(2) == [2, 3] and pool.num_free == 1
    pool.decref(3)
    pool.decref(2)
    assert pool.highest_used() == 1
    pool.shrink_to(2)
    assert pool.num_pages == 2 and pool.num_free == 0
    with pytest.raises(ValueError):
        pool.shrink_to(1)  # page 1 is in use
    pool.check()


def test_block_table_slots_fill_and_truncate():
    pool = PagePool(4, page_size=3)
    t = BlockTable(pool)
    assert t.append(5) == []
    assert t.pages == [0, 1]
    assert [pool.fill[p] for p in t.pages] == [3, 2]
    assert t.slots(0, 5) == [0, 1, 2, 3, 4]
    t.append(2)
    assert t.pages == [0, 1, 2] and pool.fill[2] == 1
    assert t.contiguous_start() == 0
    released = t.truncate(4)
    assert released == [2] and t.pages == [0, 1] and pool.fill[1] == 1
    assert pool.num_free == pool.num_pages - 2


def test_fork_shares_pages_and_copy_on_write_of_partial_page():
    pool = PagePool(8, page_size=4)
    a = BlockTable(pool, session_id=1)
    a.append(6)  # pages 0 (full), 1 (2 of 4)
    b = a.fork(session_id=2)
    assert b.pages == [0, 1] and pool.ref[0] == 2 and pool.ref[1] == 2
    copies = b.append(1)  # writes into the shared partial page 1 → copy to a private page
    assert copies == [(1, 2)]
    assert b.pages == [0, 2] and a.pages == [0, 1]
    assert pool.ref[1] == 1 and pool.ref[2] == 1 and pool.ref[0] == 2
    assert pool.fill[2] == 3
    assert a.append(2) == []  # a's page 1 is private again: no copy
    b.free()
    assert pool.ref[0] == 1 and pool.ref[2] == 0
    pool.check()


def test_fragmented_table_is_not_contiguous():
    pool = PagePool(8, page_size=2)
    held = pool.allocate(3)
    pool.decref(held[1])
    t = BlockTable(pool)
    t.append(4)
    assert t.pages == [1, 3] and t.contiguous_start() is None
    assert t.slots(0, 4) == [2, 3, 6, 7]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / free / fork / truncate / copy-on-write sequences keep every invariant."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(40, page_size=3)
        self.tables: list[BlockTable] = []

    @rule(n=st.integers(0, 10))
    def new_sequence(self, n):
        t = BlockTable(self.pool, session_id=len(self.tables))
        if t.can_append(n):
            t.append(n)
        self.tables.append(t)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000), n=st.integers(1, 7))
    def append(self, i, n):
        t = self.tables[i % len(self.tables)]
        if t.can_append(n):
            before = t.num_tokens
            copies = t.append(n)
            assert t.num_tokens == before + n
            for src, dst in copies:
                assert self.pool.ref[dst] == 1
        else:
            with pytest.raises(CacheCapacityError):
                t.append(n)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000))
    def fork(self, i):
        self.tables.append(self.tables[i % len(self.tables)].fork(session_id=len(self.tables)))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000), frac=st.floats(0, 1))
    def truncate(self, i, frac):
        t = self.tables[i % len(self.tables)]
        t.truncate(int(t.num_tokens * frac))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000))
    def free(self, i):
        t = self.tables.pop(i % len(self.tables))
        t.free()

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000), flag=st.sampled_from([FLAG_PINNED, FLAG_QUANTIZED, FLAG_OFFLOADED]), on=st.booleans())
    def flag(self, i, flag, on):
        t = self.tables[i % len(self.tables)]
        if t.pages:
            self.pool.set_flag(t.pages[i % len(t.pages)], flag, on)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 1000))
    def name(self, i):  # a full page named for the prefix cache: kept (cached) once its tables let it go
        t = self.tables[i % len(self.tables)]
        full = t.num_tokens // self.pool.page_size
        if full:
            self.pool.register(t.pages[i % full], f"page-{i}".encode())

    @invariant()
    def invariants(self):
        pool = self.pool
        pool.check()
        states = pool.page_states()
        assert states.dtype.name == "int8" and states.tolist() == [page_state(pool, p) for p in range(pool.num_pages)]
        # ref counts equal the number of block-table entries that point at each page
        counts = [0] * pool.num_pages
        for t in self.tables:
            assert len(t.pages) == -(-t.num_tokens // pool.page_size)
            assert len(set(t.pages)) == len(t.pages), "a table holds a page twice"
            for p in t.pages:
                counts[p] += 1
        assert counts == pool.ref
        assert pool.num_free + sum(1 for c in counts if c) == pool.num_pages


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
