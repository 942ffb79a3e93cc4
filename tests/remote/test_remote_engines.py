"""KV Scope attached to a real vLLM, and to a real ``engine serve`` speaking the same protocol: the same checks on
both (the view's chat blocks are the full blocks of prompt + reply; a repeated prompt hits the prefix cache and
the view finds the same blocks; events published before the view joined are replayed or said to be missed; a
killed server is a clean error) — and the real window attached to the real vLLM (its chat's blocks drawn from
vLLM's events, status bar, a prefix-cache hit, the chat saved with vLLM's address; screenshots to $KVSCOPE_SHOTS).
The kill test runs last: it stops the session's servers."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vllm_env as env
from remote_fixtures import kvscope_server, remote_model, served, vllm_server  # noqa: F401 - fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))  # the window's test helpers
from app_helpers import close_window, open_window  # noqa: E402
from test_remote_app import active_cells, connect, send  # noqa: E402

from engine.config import SamplingConfig  # noqa: E402
from engine.remote.attach import RemoteEngine
from engine.remote.client import RemoteError
from engine.remote.view import SLOT_CHAT, view_note
from engine.remote.why import Before, common_prefix
from engine.snapshot import MissReason

pytestmark = [pytest.mark.remote, pytest.mark.slow]
B = env.BLOCK


def early_start() -> None:
    """Called by tests/conftest.py once these tests are collected: vLLM's venv made in the background (~5 minutes of
    pip on CI's 2 cores, beside the tests before these instead of in line with them)."""
    if os.environ.get("KVSCOPE_SKIP_REMOTE") != "1":
        env.begin_venv(lambda _m: None)


STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
         "dog. One day she saw a big red ball under a tree and ran to get it.")


def test_chat_blocks_are_the_full_blocks_of_prompt_and_reply(served):
    eng = RemoteEngine(served.url)
    try:
        assert eng.subscribers and eng.view.block_size == B
        reply = eng.chat([{"role": "user", "content": "AAA. " + STORY}], max_tokens=48)
        assert reply.error is None and reply.prompt_ids and len(reply.token_ids) == 48
        ids = reply.prompt_ids + reply.token_ids
        time.sleep(0.5)  # the step's last batch
        snap = eng.view.snapshots(ids)[0]
        assert snap.chat_blocks == (len(ids) - 1) // B >= 2  # the last token is sampled, never cached
        assert snap.slots.count(SLOT_CHAT) == snap.chat_blocks
        assert reply.ttft_s > 0 and reply.decode_tokens_per_s > 0
    finally:
        eng.close()


def test_a_repeated_prompt_hits_and_the_view_finds_the_same_blocks(served):
    eng = RemoteEngine(served.url)
    try:
        msgs = [{"role": "user", "content": "BBB. " + STORY}]
        first = eng.chat(msgs, max_tokens=40)
        eng.refresh()
        hits_before = eng.metrics.prefix_hits
        second = eng.chat(msgs, max_tokens=40)
        assert second.token_ids == first.token_ids  # greedy on the same weights
        assert second.cached_tokens >= (len(first.prompt_ids) - 1) // B * B > 0
        time.sleep(0.5)
        eng.refresh()
        assert eng.metrics.prefix_hits - hits_before >= second.cached_tokens
        ids = second.prompt_ids + second.token_ids
        assert eng.view.chat_blocks(ids) == (len(ids) - 1) // B
        assert 0 <= eng.metrics.kv_usage <= 1 and eng.metrics.num_blocks > 0
    finally:
        eng.close()


def test_events_before_the_view_joined_are_said_to_be_missed(served):
    early = RemoteEngine(served.url)
    early.chat([{"role": "user", "content": "CCC. " + STORY}], max_tokens=40)
    early.close()
    late = RemoteEngine(served.url)
    try:
        reply = late.chat([{"role": "user", "content": "The cat slept on the warm mat all afternoon long. " * 3}],
                          max_tokens=40)
        assert late.wait_events(5.0)
        time.sleep(0.5)
        snaps = late.view.snapshots(reply.prompt_ids + reply.token_ids)
        note = view_note(snaps)
        assert snaps[0].gaps > 0 and "missed" in note  # vLLM keeps no replay buffer here: started over
        assert snaps[0].chat_blocks == (len(reply.prompt_ids) + len(reply.token_ids) - 1) // B
    finally:
        late.close()


def test_attach_cli_against_the_server(served):
    out = subprocess.run([sys.executable, "-m", "engine", "attach", served.url, "--prompt", "DDD. " + STORY,
                          "--max-new-tokens", "40", "--json"], capture_output=True, text=True, timeout=120,
                         cwd=env.ROOT)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["block_size"] == B and d["usage"]["completion_tokens"] == 40 and d["num_blocks"] > 0
    assert d["chat_blocks"] == (d["chat_tokens"] - 1) // B and d["events"]["stored"] >= d["chat_blocks"]
    assert d["ttft_ms"] > 0 and d["prefix_cache"]["queries"] > 0
    assert d["model"] == d["models"][0]
    wrong = subprocess.run([sys.executable, "-m", "engine", "attach", served.url, "--model", "no-such-model",
                            "--prompt", "hi"], capture_output=True, text=True, timeout=120, cwd=env.ROOT)
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
    assert f"does not serve 'no-such-model'; it serves: {d['models'][0]}" in wrong.stderr


def test_the_account_names_the_first_block_not_reused_and_why(served):
    """#35: an edit of the chat's message diverges where the prompt parts (said as text where the server decodes:
    vLLM's /detokenize; else as the message that changed), ``reused`` is the server's ``cached_tokens``."""
    eng = RemoteEngine(served.url)
    try:
        msgs = [{"role": "user", "content": "EEE. " + STORY}]
        first = eng.chat(msgs, max_tokens=40)
        assert first.error is None and eng.account(first, None, msgs).reused == first.cached_tokens
        before = Before(tuple(first.prompt_ids + first.token_ids),
                        tuple(msgs + [{"role": "assistant", "content": first.text}]), first.finished_at)
        edited = [{"role": "user", "content": "EEE. " + STORY.replace("big red ball", "small blue kite")}]
        second = eng.chat(edited, max_tokens=8)
        acc = eng.account(second, before, edited)
        at = common_prefix(second.prompt_ids, before.ids)
        assert acc.reused == second.cached_tokens and 0 < at // B * B <= acc.reused <= at  # vLLM: whole blocks
        assert acc.reused + acc.recomputed == acc.prompt
        m = acc.misses[0]
        assert m.reason is MissReason.DIVERGED and m.start == acc.reused and f"at token {at}" in m.detail
        if served.name == "vllm":  # the tokens, as vLLM decodes them
            assert "big" in m.detail.split(" → ")[0] and "small" in m.detail.split(" → ")[1], m.detail
        else:
            assert "(your message 1 changed): '" in m.detail and "big red" in m.detail, m.detail
        follow = list(before.messages) + [{"role": "user", "content": "And then?"}]
        third = eng.chat(follow, max_tokens=8)  # the first chat again, one message more
        acc = eng.account(third, before, follow)
        assert acc.reused == third.cached_tokens > 0 and acc.misses[0].start == acc.reused
        assert acc.misses[0].reason in (MissReason.NEW, MissReason.DIVERGED, MissReason.PARTIAL_PAGE), acc
    finally:
        eng.close()


# -- the window against the real vLLM (here, not in a module of its own: each module that imports the session
# fixtures gets its own instances, and a second vLLM would run beside the first until the session ends) ----------
SHOTS = Path(os.environ.get("KVSCOPE_SHOTS", "/tmp"))
PROMPT = STORY


def test_the_window_draws_vllms_cache_for_its_chat(qtbot, tmp_path, stories_path, vllm_server):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=40))
    try:
        rc = connect(qtbot, w, vllm_server.url)
        port = vllm_server.url.rsplit(":", 1)[1]
        assert rc.model == "tiny" and rc.label == f"⇄ tiny @ 127.0.0.1:{port}"
        assert f"fixed by the server: block size {env.BLOCK}" in w.remote.lock.label.text()
        assert send(qtbot, w, PROMPT) == "max_tokens"
        reply = rc.reply
        assert reply.error is None and len(reply.token_ids) == 40 and w.chat.bubbles[-1].text == reply.text
        ids = reply.prompt_ids + reply.token_ids
        full = (len(ids) - 1) // env.BLOCK  # the last token is sampled, never cached
        view = rc.link.engine.view
        qtbot.waitUntil(lambda: view.chat_blocks(ids) == full, timeout=10_000)
        w.remote.draw(force=True)
        assert full >= 2 and active_cells(w.page_map) == (full, full)
        assert f"this chat <b>{full}</b>" in w.page_map.caption.text()
        assert w.status.model.text() == f"⇄ tiny @ 127.0.0.1:{port}"
        assert f"block size {env.BLOCK}" in w.status.cache.text()
        assert w.status.context.text().startswith(f"Context: {len(ids)} tokens")
        metrics = rc.link.engine.metrics
        assert metrics.num_blocks > 0 and 0 <= metrics.kv_usage <= 1  # (0 between requests: cached ≠ in use)
        assert (f"Server KV cache in use: <b>{metrics.kv_usage:.1%}</b> of {metrics.num_blocks:,} blocks"
                in w.occupancy.caption.text())
        w.resize(1280, 720)
        w.grab().save(str(SHOTS / "remote_vllm_chat.png"))

        with qtbot.waitSignal(w.remote.reply_finished, timeout=60_000):  # the same prompt again: vLLM's cache
            w.menu_actions["regenerate"].trigger()
        assert rc.reply.cached_tokens >= env.BLOCK and rc.reply.cached_tokens % env.BLOCK == 0
        assert "reused" in w.chat.bubbles[-1].cache_label.text()
        acc = rc.reply.cache  # why the rest was computed: the same prompt, so only its tail (#35)
        assert acc.reused == rc.reply.cached_tokens and acc.misses[0].start == acc.reused
        assert acc.misses[0].reason in (MissReason.PARTIAL_PAGE, MissReason.NEW), acc
        bubble = w.chat.bubbles[-1]
        if acc.misses[0].reason is MissReason.PARTIAL_PAGE:  # the footer's words (app.ground.reuse_words)
            assert "sat in a partly filled one" in bubble.why_label.text()
        else:  # new tokens the footer does not mention: the remote note names the block
            assert f"from token {acc.reused} — new: " in bubble.notes_label.text()
        assert view.chat_blocks(rc.reply.prompt_ids + rc.reply.token_ids) >= full
        chat_id = rc.id
    finally:
        close_window(w)
        w.close()
    db = sqlite3.connect(str(data_dir / "history.sqlite3"))
    try:
        (server,) = db.execute("SELECT server FROM chats WHERE id = ?", (chat_id,)).fetchone()
        roles = [r for (r,) in db.execute("SELECT role FROM messages WHERE chat_id = ? ORDER BY position",
                                          (chat_id,))]
    finally:
        db.close()
    assert json.loads(server) == {"url": vllm_server.url, "model": "tiny", "events": ""}
    assert roles == ["user", "assistant"]


@pytest.mark.parametrize("kind", ["vllm", "kvscope"])
def test_zz_a_killed_server_is_a_clean_error(kind, request):
    served = request.getfixturevalue(f"{kind}_server")
    eng = RemoteEngine(served.url)
    try:
        env.stop(served.proc)
        with pytest.raises(RemoteError, match="refused the connection|closed the connection"):
            eng.chat([{"role": "user", "content": "Hello"}], max_tokens=8)
    finally:
        eng.close()
    out = subprocess.run([sys.executable, "-m", "engine", "attach", served.url, "--prompt", "hi"],
                         capture_output=True, text=True, timeout=60, cwd=env.ROOT)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "refused the connection" in out.stderr
