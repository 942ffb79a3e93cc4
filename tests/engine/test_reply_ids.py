"""The server's map of replies to the ids fed through them (``engine.server.reply_ids``) and the account the API
shows (``engine.server.account``): bounds, tenants apart, one writer and readers at once, the whole-page rule."""

from __future__ import annotations

import json
import threading

from engine.server.account import cut_detail, public, recomputed_by_reason
from engine.server.reply_ids import ReplyIds
from engine.snapshot import CacheAccount, Miss, MissReason


def test_a_tenant_finds_only_its_own_replies():
    m = ReplyIds()
    m.put(b"a", "The cat sat.", [1, 2, 3])
    assert m.find(b"a", "The cat sat.") == [1, 2, 3]
    assert m.find(b"b", "The cat sat.") is None  # same text, another tenant
    assert m.find(b"a", "The cat sat. ") is None  # the text is the key, to the character
    m.put(b"a", "", [4])
    m.put(b"a", "x", [])
    assert len(m) == 1  # nothing kept for an empty reply or no ids


def test_bounds_drop_the_least_recently_used():
    m = ReplyIds(entries=3, tokens=10, tenants=2, total=16)
    for i in range(3):
        m.put(b"a", f"r{i}", [i] * 3)
    assert m.find(b"a", "r0") == [0] * 3  # r0 used again: r1 is now the oldest
    m.put(b"a", "r3", [3] * 3)  # a fourth entry: r1 goes
    assert m.find(b"a", "r1") is None and m.find(b"a", "r0") is not None
    m.put(b"a", "big", [9] * 8)  # past 10 ids: the oldest go until it fits
    assert m.find(b"a", "big") == [9] * 8 and m.held <= 10
    m.put(b"a", "huge", [1] * 11)  # longer than a tenant may keep: not kept
    assert m.find(b"a", "huge") is None
    m.put(b"b", "b0", [5] * 8)
    assert m.held == 16  # at the total
    m.put(b"b", "b1", [5])  # past the total: the least recently used tenant's oldest goes
    assert m.find(b"a", "big") is None and m.held == 9
    m.put(b"c", "c0", [6])
    m.put(b"d", "d0", [7])  # a third tenant: past ``tenants``, the least recently used one (b) goes
    assert m.find(b"b", "b1") is None and m.find(b"c", "c0") == [6] and m.find(b"d", "d0") == [7] and m.held == 2


def test_one_writer_and_readers_at_once():
    m = ReplyIds(entries=64, tokens=1 << 12)
    errors: list[BaseException] = []

    def write():
        for i in range(2000):
            m.put(b"t", f"r{i % 100}", list(range(i % 50 + 1)))

    def read():
        try:
            for i in range(2000):
                got = m.find(b"t", f"r{i % 100}")
                assert got is None or got == list(range(len(got)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(m) <= 64 and m.held <= 1 << 12


def test_a_prompt_not_its_own_conversation_is_told_in_whole_pages():
    """A prompt that does not go on with a whole conversation: its new / diverged / partial_page tail is one range,
    partial_page when whole pages were reused, new when none were; a right guess (partial_page, then diverged), a
    wrong one (diverged, the cached text quoted) and a new session (new) all read the same."""
    right = CacheAccount(34, 32, 2, 0, (Miss(32, 33, MissReason.PARTIAL_PAGE, "reused in whole pages"),
                                        Miss(33, 34, MissReason.DIVERGED, "at token 33: 'a' → 'b'")))
    wrong = CacheAccount(34, 32, 2, 0, (Miss(32, 34, MissReason.DIVERGED, "at token 32: '7' → '8'"),))
    fresh = CacheAccount(34, 32, 2, 0, (Miss(32, 34, MissReason.NEW, "not in the cache before"),))
    told = [public(a, 34, 32, own=False, grain=16) for a in (right, wrong, fresh)]
    assert told[0] == told[1] == told[2] and "'" not in json.dumps(told)
    assert told[0]["misses"] == [{"start": 32, "end": 34, "reason": "partial_page", "detail": cut_detail(16)}]
    assert recomputed_by_reason(told[1]) == {"partial_page": 2}
    none = CacheAccount(5, 0, 5, 0, (Miss(0, 5, MissReason.DIVERGED, "'x' → 'y'"),))
    assert [m["reason"] for m in public(none, 5, 0, own=False)["misses"]] == ["new"]
    disk = CacheAccount(50, 16, 34, 0, (Miss(16, 32, MissReason.DISK, "damaged"), Miss(32, 50, MissReason.NEW, "")))
    assert [m["reason"] for m in public(disk, 50, 16, own=False)["misses"]] == ["disk", "partial_page"]
    own = CacheAccount(10, 4, 6, 0, (Miss(4, 9, MissReason.DIVERGED, "x"), Miss(9, 10, MissReason.NEW, "y")))
    assert public(own, 10, 4) == own.to_dict()  # its own conversation's divergence is told as it is
    assert public(None, 5, 2)["misses"] == [{"start": 2, "end": 5, "reason": "new",
                                             "detail": "not in the cache before"}]
