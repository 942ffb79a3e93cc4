"""A remote chat says why its prompt was recomputed (#35): the real window attached to a real ``engine serve``
(in-process, stories260K, a pool of 24 pages of 16 and one idle conversation kept, KV events on). Another client's
prompts make the server remove the chat's blocks: the follow-up's footer says they were evicted, naming the first
block; an edit of the first message: the footer says where the prompt diverged, in this chat's own words."""

from __future__ import annotations

import pytest
from app_helpers import close_window, open_window
from test_remote_app import connect, send, shot

from app.ground.docks import on_screen
from engine.config import CacheConfig, SamplingConfig
from engine.remote.client import RemoteClient
from engine.remote.why import common_prefix
from engine.server import KVServer, ServerOptions, ServerThread
from engine.server.kv_events import KVEventsConfig
from engine.snapshot import MissReason

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog."


@pytest.fixture(scope="module")
def small_server(stories_path):
    from engine.model.loader import load_model

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
    server = KVServer(load_model(str(stories_path)), CacheConfig(page_size=16, max_pages=24),
                      ServerOptions(kv_events=cfg, max_idle=1))
    thread = ServerThread(server)
    url = thread.start()
    yield url
    thread.stop()


def footer(w) -> str:
    """The last reply's footer line on recomputed tokens (``app.ground.reuse_words.footer_line``)."""
    return w.chat.bubbles[-1].why_label.text()


def notes(w) -> str:
    return w.chat.bubbles[-1].notes_label.text()


def test_the_remote_chat_says_which_block_was_evicted_and_where_an_edit_diverged(qtbot, data_dir, stories_path,
                                                                                 small_server):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=30))
    try:
        rc = connect(qtbot, w, small_server)
        assert send(qtbot, w, STORY * 2) == "max_tokens"
        first = rc.reply.cache
        assert first is not None and first.reused == rc.reply.cached_tokens == 0
        assert first.misses[0].reason is MissReason.NEW and "block 0 (tokens 0–15) was never stored" in \
            first.misses[0].detail
        assert not notes(w) and not footer(w)  # a first prompt's new tokens are no news (as in a local chat)

        other = RemoteClient(small_server)  # another client's prompts fill the pool: the chat's blocks go
        for i, animal in enumerate(["cat", "dog", "bird", "fish"]):
            assert other.chat(rc.model, [{"role": "user", "content": f"{i}. The {animal} " + STORY * 2}],
                              max_tokens=30).error is None

        assert send(qtbot, w, "And then?") == "max_tokens"
        acc = rc.reply.cache
        assert acc.reused == rc.reply.cached_tokens and acc.reused + acc.recomputed == len(rc.reply.prompt_ids)
        evicted = acc.misses[0]
        assert evicted.reason is MissReason.EVICTED and evicted.start == acc.reused
        again = sum(m.tokens for m in acc.misses if m.reason is not MissReason.NEW)  # read again, not new
        assert f"recomputed {again} tokens: tokens {acc.reused}–" in footer(w)  # the local footer's words
        assert "had been evicted to make room" in footer(w) and "Why?" in footer(w) and not notes(w)
        w.chat.bubbles[-1].why_label.linkActivated.emit("why")  # the footer's Why?: the readout comes to the front
        assert on_screen(w.why)
        why = w.why.text()  # it says what the remote view knows: which block, and how it can tell
        assert f"the server removed block {acc.reused // 16} (tokens {acc.reused}–" in why and "BlockRemoved" in why
        shot(w, "why_evicted")  # $KVSCOPE_SHOTS/remote_why_evicted.png
        saved = rc.messages[-1].stats
        assert saved["cache"]["misses"][0]["reason"] == "evicted" and saved["reused_tokens"] == acc.reused

        prev = list(rc.ids)
        with qtbot.waitSignal(w.remote.reply_finished, timeout=60_000):  # edit the first message, as Save does
            w.chat.edit_requested.emit(0, STORY.replace("Lily", "Anna") + STORY)
        acc = rc.reply.cache
        diverged = acc.misses[0]
        assert diverged.reason is MissReason.DIVERGED and acc.reused == rc.reply.cached_tokens
        at = common_prefix(rc.reply.prompt_ids, prev)
        assert diverged.start <= at < diverged.start + 16  # in the first block not reused
        assert f"the prompt differs from this chat's last prompt and reply at token {at} (your message 1 changed)" \
            in diverged.detail
        assert "the prompt changed at token" in footer(w) and "“… girl named Lily. She lo” → “… girl named Anna. " \
            "She lo”" in footer(w)

        assert send(qtbot, w, "More, please.") == "max_tokens"  # a follow-up: the reply's last block was never full
        acc = rc.reply.cache
        assert acc.misses[0].reason in (MissReason.NEW, MissReason.DIVERGED) and acc.reused == rc.reply.cached_tokens
        if acc.misses[0].reason is MissReason.NEW:  # the local footer says nothing of new tokens: a note does
            assert f"prompt tokens from token {acc.reused} — new: block {acc.reused // 16}" in notes(w)
    finally:
        close_window(w)
        w.close()
