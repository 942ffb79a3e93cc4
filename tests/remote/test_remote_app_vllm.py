"""The real window attached to the real vLLM (the same session servers as test_remote_engines.py; this module
runs before it, whose last test stops them): File ▸ Connect, a reply streamed from vLLM, the page map showing
exactly this chat's full blocks from vLLM's own KV events, the status bar and legend in the server's words, a
regenerate served from vLLM's prefix cache, and the chat saved in the history marked with vLLM's address.
Screenshots at 1280×720 go to $KVSCOPE_SHOTS (default /tmp) as remote_vllm_*.png."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest

import vllm_env as env
from remote_fixtures import remote_model, vllm_server  # noqa: F401 - fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))  # the window's test helpers
from app_helpers import close_window, open_window  # noqa: E402
from test_remote_app import active_cells, connect, send  # noqa: E402

from engine.config import SamplingConfig  # noqa: E402

pytestmark = [pytest.mark.remote, pytest.mark.slow]
SHOTS = Path(os.environ.get("KVSCOPE_SHOTS", "/tmp"))
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog. "
          "One day she saw a big red ball under a tree and ran to get it.")


def test_the_window_draws_vllms_cache_for_its_chat(qtbot, tmp_path, stories_path, vllm_server):  # noqa: F811
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
