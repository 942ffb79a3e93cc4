"""The remote seams of issue #30 (item 7) on the real window against a real ``python -m engine serve`` (the fixture
of test_remote_app): Regenerate in a remote chat acts on the remote chat (the centre pane stays on it, no local
bubble stuck at "…", Stop off, the status bar the server's), and a remote chat's captions are remote (no local
"Compiled decode step", no "KV on disk") — given back exactly when the local chat returns."""

from __future__ import annotations

from app_helpers import close_window, open_window, wait_reply
from test_remote_app import connect, send, server  # noqa: F401 - the fixture

from app.remote.panels import OTHER_PANELS
from app.ground.screen import OnScreen
from engine.config import SamplingConfig

LOCAL_ONLY = ("Compiled decode step", "KV on disk", "Model: stories260K", "of 512")


def shown_words(w) -> str:
    """Every caption, caption tooltip and shown status field, as one text."""
    parts = [p.caption.text() + "\n" + p.caption.toolTip() for p in (w.occupancy, w.page_map, w.timing, w.memory)]
    fields = [w.status.model, w.status.device, w.status.cache, w.status.context, w.status.speed, w.status.disk]
    return "\n".join(parts + [f.text() for f in fields if not f.isHidden()])


def check_remote_words(w, when: str) -> None:
    words = shown_words(w)
    for local in LOCAL_ONLY:
        assert local not in words, (when, local, words)
    assert w.memory.caption.text() == OTHER_PANELS, when
    assert w.occupancy.caption.text().startswith("Server KV cache in use"), when


def test_remote_regenerate_acts_on_the_remote_chat_and_its_captions_are_remote(qtbot, data_dir, stories_path,
                                                                                 server):  # noqa: F811
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12))
    try:
        w.set_fast_step(True)
        qtbot.waitUntil(lambda: "Compiled decode step" in w.timing.caption.toolTip(), timeout=10_000)
        w.send("Once upon a time")  # a local reply: local words on every readout
        assert wait_reply(qtbot, w)[1]
        local_chat = w.chat_id
        local_messages = [(m.role, m.content) for m in w.history.messages(local_chat)]
        qtbot.waitUntil(lambda: w.status.disk.text().startswith("KV on disk"), timeout=10_000)
        # the reply's last snapshot drawn (the window does it on the next turn of its event loop): its compiled
        # step's trial may have ended within the reply, and the words read here are the ones that come back
        w.scheduler.refresh_all()
        local_tip = w.timing.caption.toolTip()

        rc = connect(qtbot, w, server.url)
        check_remote_words(w, "connected")
        assert "this client" in w.timing.caption.text()  # the remote timing's own words before a reply
        assert send(qtbot, w, "Once upon a time") == "max_tokens"
        w.remote.draw(force=True)
        check_remote_words(w, "after a reply")
        assert w.timing.caption.text().startswith("<b>remote reply</b>")

        with qtbot.waitSignal(w.remote.reply_finished, timeout=60_000):
            w.menu_actions["regenerate"].trigger()  # Tools ▸ Regenerate (Ctrl+R)
        assert w.on_screen.kind is OnScreen.REMOTE and w.remote.current is rc and w.chat_id is None
        assert w.chat.title.text() == rc.label and len(rc.messages[-1].stats["versions"]) == 2
        assert w.chat.bubbles[-1].text == rc.messages[-1].content and w.chat.bubbles[-1].text not in ("", "…")
        assert w.chat.bubbles[-1].version_label.text() == "2 / 2"
        assert not w.chat.stop_button.isEnabled() and w.conversation.running is None
        assert w.status.model.text().startswith("⇄ stories260K @")
        assert [(m.role, m.content) for m in w.history.messages(local_chat)] == local_messages
        w.remote.draw(force=True)
        check_remote_words(w, "after regenerate")

        w.chat_list.setCurrentRow(w.chat_list.chat_ids().index(local_chat))  # the local words come back
        assert w.status.disk.text().startswith("KV on disk") and not w.status.disk.isHidden()
        assert w.timing.caption.toolTip() == local_tip and w.status.model.text() == "Model: stories260K"
    finally:
        close_window(w)
        w.close()
