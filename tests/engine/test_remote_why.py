"""Why a remote prompt was recomputed (``engine.remote.why``): the view fed vLLM-shaped event batches through the
wire format (blocks stored at a prefill, the reply's blocks as they fill, blocks removed for room, the cache
cleared; a keyed KV Scope server's hash-only blocks), then the account of the next prompt: every reason on its
range, ``reused`` the server's ``cached_tokens``, the misses covering the rest in order."""

from __future__ import annotations

import time

from engine.kv.paged.tenants import block_hashes
from engine.remote.view import GONE_MAX, RemotePool, RemoteView
from engine.remote.why import (HELD, REMOVED, STORED, UNSEEN, Before, account_dict, account_line, fates,
                               message_change, remote_account)
from engine.remote.wire import Batch, Cleared, Removed, Stored, decode_batch, encode_batch
from engine.snapshot import MissReason as R

B = 32  # vLLM's CPU backend blocks (tests/remote)


class Server:
    """What vLLM publishes for a chat: each full block of prompt + reply once, hashed down the chain."""

    def __init__(self, view: RemoteView, keyed: str | None = None) -> None:
        self.view, self.keyed = view, keyed
        self.names: dict[tuple, int] = {}  # (parent, tokens) -> hash, like vLLM's chained hash

    def hashes(self, ids: list[int]) -> list:
        if self.keyed is not None:
            return block_hashes(ids, B, key=self.keyed)
        out, parent = [], None
        for j in range(len(ids) // B):
            parent = self.names.setdefault((parent, tuple(ids[j * B:(j + 1) * B])), len(self.names) + 1)
            out.append(parent)
        return out

    def send(self, *events) -> None:
        self.view.apply(decode_batch(encode_batch(Batch(time.time(), list(events)))))  # as the wire carries it

    def store(self, ids: list[int], first: int = 0) -> list:
        """The full blocks of ``ids`` from block ``first`` on are stored (a prefill, or a reply's blocks as they
        fill); a keyed server sends no token ids."""
        hs = self.hashes(ids)
        parent = hs[first - 1] if first else None
        tokens = () if self.keyed is not None else tuple(ids[first * B:len(hs) * B])
        self.send(Stored(tuple(hs[first:]), parent, tokens, B))
        return hs

    def remove(self, hashes) -> None:
        self.send(Removed(tuple(hashes)))


def chat_of(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def account_of(view: RemoteView, prompt, before: Before | None, sent: float, cached, **kw):
    hist, cleared_at, resynced_at = view.history(prompt)
    b = before or Before()
    return remote_account(prompt, list(b.ids), B, fates(hist, sent), cached,
                          cleared=bool(b.ids) and cleared_at >= b.ended, missed=bool(b.ids) and resynced_at >= b.ended,
                          **kw)


def check(acc, cached: int | None = None) -> None:
    """The account's own rules: reused + recomputed == prompt, and the misses cover [reused, prompt) in order."""
    assert acc.reused + acc.recomputed + acc.dropped == acc.prompt
    if cached is not None:
        assert acc.reused == cached
    at = acc.reused
    for m in acc.misses:
        assert m.start == at < m.end and m.detail
        at = m.end
    assert at == acc.prompt


def first_turn(view: RemoteView, server: Server, prompt_len: int = 150, reply_len: int = 40):
    """A prompt never sent before, then its reply: vLLM stores the prompt's full blocks at prefill, the reply's as
    they fill (the last, partial, never)."""
    prompt = chat_of(prompt_len)
    sent = time.monotonic()
    acc = account_of(view, prompt, None, sent, 0)
    server.store(prompt)
    ids = prompt + chat_of(reply_len, 1)
    server.store(ids, len(prompt) // B)
    return acc, Before(tuple(ids), (), time.monotonic())


def test_a_first_prompt_is_new_and_a_follow_up_misses_where_the_reply_ended():
    view = RemoteView(B, 64)
    server = Server(view)
    acc, before = first_turn(view, server)
    check(acc, 0)
    assert [(m.start, m.end, m.reason) for m in acc.misses] == [(0, 150, R.NEW)]
    assert "block 0 (tokens 0–31) was never stored" in acc.misses[0].detail
    follow = list(before.ids) + chat_of(30, 2)  # the reply's 190 tokens, then the next message
    sent = time.monotonic()
    server.store(follow, 5)  # the request computed the rest: its blocks come before the reply ends
    acc = account_of(view, follow, before, sent, 160)  # vLLM: 5 blocks of 32 hit
    check(acc, 160)
    (m,) = acc.misses
    assert (m.start, m.end, m.reason) == (160, 220, R.NEW)
    assert "block 5 (tokens 160–191) was never stored on the server: this chat's last reply ended inside it, at " \
           "token 190" in m.detail
    assert account_line(acc).startswith("recomputed 60 of 220 prompt tokens from token 160 — new: block 5")
    assert account_dict(acc)["misses"][0] == {"start": 160, "end": 220, "reason": "new", "detail": m.detail}


def test_blocks_the_server_removed_are_evicted_and_so_is_a_cleared_cache():
    view = RemoteView(B, 64)
    server = Server(view)
    _, before = first_turn(view, server)
    hs = server.hashes(list(before.ids))
    server.remove(hs[4:])  # vLLM's LRU frees a chain's tail first
    server.remove(hs[2:4])
    follow = list(before.ids) + chat_of(30, 2)
    sent = time.monotonic()
    server.store(follow, 2)  # recomputed and stored again: still evicted (it was removed since the last reply)
    acc = account_of(view, follow, before, sent, 64)
    check(acc, 64)
    assert [(m.start, m.end, m.reason) for m in acc.misses] == [(64, 160, R.EVICTED), (160, 220, R.NEW)]
    assert "the server removed block 2 (tokens 64–95) and the 2 blocks after it (BlockRemoved" in acc.misses[0].detail
    assert account_line(acc).endswith("(then: new)")
    # the whole cache cleared (vLLM's reset_prefix_cache): the chat's blocks are evicted, not "never stored"
    before = Before(tuple(follow), (), time.monotonic())
    server.send(Cleared())
    again = follow + chat_of(10, 3)
    acc = account_of(view, again, before, time.monotonic(), 0)
    check(acc, 0)
    assert acc.misses[0].reason is R.EVICTED and acc.misses[0].end == len(follow) // B * B
    assert "cleared its whole prefix cache (AllBlocksCleared)" in acc.misses[0].detail


def test_an_edit_diverges_at_its_token_said_as_text_or_as_the_message_that_changed():
    view = RemoteView(B, 64)
    server = Server(view)
    _, before = first_turn(view, server)
    edited = list(before.ids[:150])
    edited[70] = 499  # the user's message changed at token 70 (in block 2)
    texts = {499: "Anna", before.ids[70]: "Lily"}
    decode = lambda ids: "".join(texts.get(i, "·") for i in ids)  # noqa: E731 - the server's /detokenize
    acc = account_of(view, edited, before, time.monotonic(), 64, decode=decode)
    check(acc, 64)
    (m,) = acc.misses
    assert (m.start, m.end, m.reason) == (64, 150, R.DIVERGED)
    assert m.detail == ("the prompt differs from this chat's last prompt and reply at token 70: 'Lily··' → "
                        "'Anna··'")
    old = ({"role": "user", "content": "Once upon a time, a girl named Lily played."},
           {"role": "assistant", "content": "She ran."})
    new = [{"role": "user", "content": "Once upon a time, a girl named Anna played."}]
    change = message_change(old, new)
    assert change == "your message 1 changed: '… girl named Lily played.' → '… girl named Anna played.'"
    acc = account_of(view, edited, before, time.monotonic(), 64, change=change)  # a server that cannot decode
    assert acc.misses[0].detail.endswith("at token 70 (your message 1 changed): '… girl named Lily played.' → "
                                         "'… girl named Anna played.'")
    assert "token ids" in account_of(view, edited, before, time.monotonic(), 64).misses[0].detail
    same = account_of(view, edited, before, time.monotonic(), 64, change="").misses[0].detail
    assert "same text: the server tokenized them otherwise" in same
    assert message_change(old, [{"role": "system", "content": "Be brief."}]).startswith("message 1 is a system")
    assert message_change(old, list(old) + [{"role": "user", "content": "More"}]) == ""


def test_a_server_that_reuses_by_token_diverges_exactly_where_the_chat_parts():
    """KV Scope's server reuses a conversation's own cache token by token, not in whole blocks."""
    prev = chat_of(120)
    prompt = prev[:75] + chat_of(20, 5)
    acc = remote_account(prompt, prev, 16, [HELD] * 4 + [STORED] * 1, cached=75)
    check(acc, 75)
    assert [(m.start, m.end, m.reason) for m in acc.misses] == [(75, 95, R.DIVERGED)]
    regen = remote_account(prev[:96], prev, 16, [HELD] * 6, cached=95)  # all of it but the last token
    assert [(m.start, m.reason) for m in regen.misses] == [(95, R.NEW)]
    assert "last token is always computed" in regen.misses[0].detail


def test_partial_tail_and_last_block_and_no_cached_tokens_reported():
    view = RemoteView(B, 64)
    server = Server(view)
    _, before = first_turn(view, server, 128, 40)  # 168 ids: 5 full blocks stored
    tail = list(before.ids[:165])
    acc = account_of(view, tail, before, time.monotonic(), 160)
    assert [(m.start, m.end, m.reason) for m in acc.misses] == [(160, 165, R.PARTIAL_PAGE)]
    assert "last 5 tokens fill no whole block of 32" in acc.misses[0].detail
    exact = list(before.ids[:160])  # a whole number of blocks: vLLM computes the last one again
    acc = account_of(view, exact, before, time.monotonic(), 128)
    assert [(m.start, m.end, m.reason) for m in acc.misses] == [(128, 160, R.NEW)]
    assert "last token is always computed" in acc.misses[0].detail and "block 4 (tokens 128–159) too" in \
        acc.misses[0].detail
    # no usage.prompt_tokens_details (vLLM without --enable-prompt-tokens-details): the events say what was held
    acc = account_of(view, tail, before, time.monotonic(), None)
    check(acc, 160)
    later = account_of(view, tail, before, 0.0, None)  # sent before anything was stored: nothing was held
    assert later.reused == 0 and later.misses[0].reason is R.NEW


def test_a_keyed_kv_scope_server_names_blocks_by_hash_only():
    """A keyed server publishes no token ids: the view finds the chat's blocks by the salted hashes its key gives
    (``RemoteEngine`` sets ``view.names``), removed ones too."""
    view = RemoteView(B, 64)
    view.names = lambda ids, size: block_hashes(ids, size, key="sekret")
    server = Server(view, keyed="sekret")
    _, before = first_turn(view, server)
    hs = server.hashes(list(before.ids))
    assert len(view.history(list(before.ids))[0]) == len(hs) == 5
    server.remove(hs[1:])
    follow = list(before.ids) + chat_of(30, 2)
    acc = account_of(view, follow, before, time.monotonic(), 32)
    check(acc, 32)
    assert [(m.start, m.end, m.reason) for m in acc.misses] == [(32, 160, R.EVICTED), (160, 220, R.NEW)]
    other = RemoteView(B, 64)  # another tenant's key names other blocks: nothing of this chat is found
    other.names = lambda ids, size: block_hashes(ids, size, key="other")
    Server(other, keyed="sekret").store(list(before.ids))
    assert other.history(list(before.ids))[0] == []


def test_fates_and_the_bound_on_what_the_pool_remembers():
    assert fates([(1.0, -1.0), (5.0, 2.0), (-1.0, 3.0), (6.0, -1.0)], sent=4.0) == [HELD, REMOVED, REMOVED, STORED]
    assert fates([], 1.0) == [] and UNSEEN == "unseen"
    pool = RemotePool(0, 1, 0)
    n = GONE_MAX + 10
    pool.apply(Batch(1.0, [Stored(tuple(range(1, n + 1)), None, tuple(range(n)), 1)]), now=1.0)
    pool.apply(Batch(2.0, [Removed(tuple(range(1, n + 1)))]), now=2.0)
    assert len(pool._gone) == len(pool._gone_named) == GONE_MAX and pool.held == 0
    assert pool.history(list(range(n))) == []  # the oldest removals are forgotten: the chain is lost at its first
    assert pool.history(list(range(n - 5, n))) == []  # (a chain is found from its first block only)
