"""The cache index (``engine.kv.paged.positions.CacheIndex``) as a state machine: every change a cache makes to it
(tokens fed or passed over, evictions per layer or per head, re-rotation, moved keys, truncation, restart), and
after each the positions it says are held — read from its intact prefix where it can, not the whole log — equal
those a full read of its log gives, and its own invariants hold."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.paged.positions import CacheIndex

LAYERS, HEADS = 3, 2


def _held_by_reading_the_log(index: CacheIndex, upto: int) -> np.ndarray:
    out = np.zeros(upto, dtype=bool)
    log = index.log  # [L, H, n]
    out[log[log < upto]] = True
    return out


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = CacheIndex(LAYERS, capacity=4, heads=HEADS)

    @rule(q=st.integers(1, 9))
    def feed(self, q: int) -> None:
        self.index.append(q)

    @rule(m=st.integers(1, 5))
    def pass_over(self, m: int) -> None:
        self.index.skip(m)

    @precondition(lambda self: self.index.n > 1)
    @rule(data=st.data(), per_head=st.booleans())
    def evict(self, data, per_head: bool) -> None:
        n = self.index.n
        m = data.draw(st.integers(1, n - 1))
        rows = HEADS if per_head else 1
        keep = []
        for _ in range(LAYERS):
            picks = [sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=m, max_size=m))) for _ in range(rows)]
            keep.append(np.array(picks if per_head else picks[0], dtype=np.int64))
        self.index.keep(keep)

    @rule()
    def rerotate(self) -> None:
        self.index.rerotate()

    @rule()
    def keys_moved(self) -> None:
        self.index.positions_moved()

    @rule(data=st.data())
    def truncate(self, data) -> None:
        self.index.truncate(data.draw(st.integers(0, self.index.intact)))

    @rule()
    def restart(self) -> None:
        self.index.reset()

    @invariant()
    def held_is_what_the_log_says(self) -> None:
        self.index.check()
        nxt = self.index.next_pos
        for upto in {0, max(0, nxt - 3), nxt, nxt + 4}:
            assert self.index.held(upto).tolist() == _held_by_reading_the_log(self.index, upto).tolist(), upto
        assert self.index.evicted_count() == nxt - int(_held_by_reading_the_log(self.index, nxt).sum())


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_cache_index_machine = IndexMachine.TestCase
