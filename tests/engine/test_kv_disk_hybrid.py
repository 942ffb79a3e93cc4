"""The KV disk tier on hybrid and sliding-window models: after a restart (here: the model's memory forgets every page
and state, ``drop_idle`` and the state shelf cleared) a prompt that shares a prefix takes the full-attention pages,
each sliding group's window pages and the recurrent states at a page boundary from disk — and the tokens are HF's
greedy tokens. A damaged state file is dropped with a note and its tokens computed again. Real files in
``tmp_path``; tiny seeded random models of real configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.config import CacheConfig, SamplingConfig
from engine.core.session import ChatSession
from engine.kv.tier import disk
from engine.snapshot import MissReason
from test_reuse_stateful import build
from test_layer_kinds import hf_greedy

P, N = 4, 6
PROMPT = list(range(5, 45))  # 40 tokens: 9 whole pages before the last token (36), longer than the windows (8)


@pytest.fixture(scope="module", params=["lfm2", "gemma3_text", "falcon_h1"])
def model(request):
    m, lm = build(request.param)
    return request.param, m, lm


def reply(lm, ids, n=N):
    s = ChatSession(lm, CacheConfig(mode="paged", page_size=P, checkpoints=0))
    stats, notes = s.start_ids(ids, SamplingConfig(max_new_tokens=n, ignore_eos=True)), []
    while not (r := s.step()).done:
        notes += r.warnings
    notes += r.warnings
    out, last = list(s.generated_ids), s.last_stats
    s.close()
    return stats, out, last, notes


def restart(lm) -> None:
    """What a new process would have in memory: no page, no state."""
    lm.kv_arenas.drop_idle()
    lm.kv_arenas.states.clear()


def test_restart_takes_pages_windows_and_states_from_disk(model, tmp_path):
    name, m, lm = model
    tier = disk.configure(lm, str(tmp_path))
    try:
        reply(lm, PROMPT)
        tier.flush()
        states = sorted(Path(tmp_path).glob("*/*.kvs"))
        assert (len(states) > 0) == (name != "gemma3_text")  # the states at the last whole page (36)
        restart(lm)
        branch = PROMPT + [60, 61, 62]
        stats, out, last, _ = reply(lm, branch)
        assert out == hf_greedy(m, branch, N)
        # the pages go on to 40 (the first reply's tokens named page 9 too); the states were kept at the first
        # prompt's last whole page before its last token (36) only
        stateful = name != "gemma3_text"
        assert stats.reused_tokens == (36 if stateful else 40)
        # read from disk: what the turn took of it (page 9's file was read too, and stays cached for later)
        assert stats.disk_restored_tokens == stats.shared_tokens == stats.reused_tokens
        assert tier.stats()["hit_tokens"] >= 40
        first = last.cache.misses[0]
        assert (first.start, first.reason) == ((36, MissReason.STATE) if stateful else (40, MissReason.NEW))
        assert tier.stats()["state_files_read"] == stateful
        restart(lm)
        off = disk.configure(lm, None)  # the same prompt without the tier: computed again, the same tokens
        assert off is None
        stats, again, _, _ = reply(lm, branch)
        assert stats.reused_tokens == 0 and again == out
    finally:
        disk.configure(lm, None)


@pytest.fixture(scope="module")
def lfm2():
    return build("lfm2")


@pytest.mark.parametrize("damage, why", [("flip", "checksum mismatch"), ("truncate", "truncated or extended"),
                                         ("garbage", "not a state file"), ("fifo", "a pipe (FIFO)")])
def test_a_damaged_state_file_is_dropped_and_recomputed(lfm2, tmp_path, damage, why):
    m, lm = lfm2
    restart(lm)
    tier = disk.configure(lm, str(tmp_path))
    try:
        reply(lm, PROMPT)
        tier.flush()
        (state,) = Path(tmp_path).glob("*/*.kvs")
        raw = bytearray(state.read_bytes())
        if damage == "flip":
            raw[-5] ^= 1  # one bit of the last state's payload
        state.write_bytes({"flip": bytes(raw), "truncate": bytes(raw[:-64]), "garbage": bytes(len(raw))}.get(damage, b""))
        if damage == "fifo":
            state.unlink()
            os.mkfifo(state)  # opened without blocking, never read
        restart(lm)
        stats, out, last, notes = reply(lm, PROMPT)
        assert out == hf_greedy(m, PROMPT, N) and stats.reused_tokens == 0
        assert any(f"dropped a state file ({why}" in n for n in notes), notes
        assert last.cache.misses[0].reason is MissReason.STATE
        tier.flush()  # the recomputed states are written again, whole: the next restart goes on from them
        restart(lm)
        assert reply(lm, PROMPT)[0].reused_tokens == 36
    finally:
        disk.configure(lm, None)
