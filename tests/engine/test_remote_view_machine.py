"""The remote view as a state machine: every event a server can send (blocks stored, extending a chain or
starting one, stored again under a hash already held, removed, removed unknown, all cleared), gaps with and
without replay, and snapshots for a chat, in any order. After each step the view agrees with a plain model of
the server's cache (a multiset of hashes) and its slots are consistent."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.remote.view import SLOT_CHAT, SLOT_EVICTED, SLOT_FREE, SLOT_OTHER, RemoteView
from engine.remote.wire import Batch, Cleared, Removed, Stored, decode_batch, encode_batch

B = 4


class ViewMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.view = RemoteView(B, 16)
        self.held: dict[int, int] = {}  # hash -> blocks holding it (the server's truth)
        self.chains: list[list[tuple[int, tuple[int, ...]]]] = []  # chains stored: (hash, tokens) per block
        self.next_hash = 1

    def _send(self, *events) -> None:
        self.view.apply(decode_batch(encode_batch(Batch(1.0, list(events)))))  # through the wire format

    @rule(n=st.integers(1, 3), tok=st.integers(0, 5), extend=st.booleans())
    def store(self, n, tok, extend):
        chain = list(self.chains[-1]) if extend and self.chains else []
        parent = chain[-1][0] if chain else None
        hashes, tokens = [], []
        for i in range(n):
            h = self.next_hash
            t = (h, tok, i, h)  # a hash names its parent and tokens: equal tokens under one parent, one hash
            self.next_hash += 1
            hashes.append(h)
            tokens += t
            chain.append((h, t))
            self.held[h] = self.held.get(h, 0) + 1
        self._send(Stored(tuple(hashes), parent, tuple(tokens), B))
        self.chains.append(chain)

    def _held_chains(self) -> list:
        return [c for c in self.chains if c and c[-1][0] in self.held]

    @precondition(lambda self: self._held_chains())
    @rule(data=st.data())
    def store_again(self, data):
        """vLLM recomputed a block it had cached: the same hash, one more block."""
        chain = data.draw(st.sampled_from(self._held_chains()))
        h, t = chain[-1]
        parent = chain[-2][0] if len(chain) > 1 else None
        self.held[h] += 1
        self._send(Stored((h,), parent, t, B))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def remove(self, data):
        h = data.draw(st.sampled_from(sorted(self.held)))
        self.held[h] -= 1
        if not self.held[h]:
            del self.held[h]
        self._send(Removed((h,)))

    @rule()
    def remove_unknown(self):
        self._send(Removed((10 ** 9,)))  # stored before the view joined: nothing to draw

    @rule()
    def clear(self):
        self.held.clear()
        self._send(Cleared())

    @rule(replayed=st.booleans())
    def gap(self, replayed):
        self.view.gap(0, 3, replayed)
        if not replayed:  # the view starts over: it knows nothing the server held
            self.held.clear()

    @invariant()
    def agrees_with_the_server(self):
        pool = self.view.pool(0)
        assert sorted(pool.names()) == sorted(h for h, n in self.held.items() for _ in range(n))
        snap = pool.snapshot()
        assert snap.cached_blocks == sum(self.held.values())
        assert snap.slots.count(SLOT_OTHER) == snap.cached_blocks and SLOT_CHAT not in snap.slots
        assert all(s in (SLOT_FREE, SLOT_OTHER, SLOT_EVICTED) for s in snap.slots)

    @invariant()
    def a_chat_finds_its_held_prefix(self):
        pool = self.view.pool(0)
        for chain in self.chains[-3:]:
            ids = [t for _, hs in chain for t in hs]
            want = 0
            for h, _ in chain:  # blocks from the first, while the server holds them
                if h not in self.held:
                    break
                want += 1
            snap = pool.snapshot(ids)
            assert snap.chat_blocks == want and snap.slots.count(SLOT_CHAT) == want


ViewMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestViewMachine = ViewMachine.TestCase
