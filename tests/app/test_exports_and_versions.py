"""Issue #19 item 13 on the real window (stories260K): Panels as PNG asks for a folder in so many words, says where it
saved (#31) and leaves the ⟲ / ? buttons out, panels behind a tab at their size in front; the cache trace of a chat survives a switch to another chat; Edit & resend keeps the old reply as
a version; precision and policy switches made mid-reply are named in the reply's footer."""

from __future__ import annotations

import json

from app_helpers import GREEDY, close_window, open_window, use_lossy, wait_reply
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog

from app.ground.docks import on_screen

from engine.config import SamplingConfig


def test_panels_as_png_say_where_and_leave_the_buttons_out(qtbot, data_dir, stories_path, tmp_path, monkeypatch):
    w = open_window(qtbot, data_dir, str(stories_path))
    folder = tmp_path / "png"
    folder.mkdir()
    asked = []
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda _parent, title, *a, **k: asked.append(title)
                        or str(folder))
    try:
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        qtbot.wait(100)
        panel = w.occupancy
        shown = panel.grab().toImage()
        in_front = {k for k, d in w.docks.items() if on_screen(d.widget())}
        w.exporter.export_pngs()  # File ▸ Export ▸ Panels as PNG…
        assert asked == ["Choose a folder for the panel pictures (one PNG file per panel)"]  # it says it wants a folder
        message = w.statusBar().currentMessage()
        files = sorted(folder.glob("kvscope-*.png"))
        assert len(files) == 6  # the five panels and the "Why recomputed?" readout
        assert str(folder) in message and all(f.name in message for f in files)
        # and it stays said above the chat, with the folder a click away
        assert w.chat.notice.text.startswith(f"Saved 6 panel pictures (PNG) in {folder}: kvscope-")
        assert [b.text() for b in w.chat.notice.action_buttons] == ["Open folder"]
        from PySide6.QtGui import QImage

        # panels behind a tab are pictured as they look in front (Memory came out 119×264, its labels over its bar)
        sizes = {f.name.split("-")[1]: QImage(str(f)).size() for f in files}
        for behind, front in (("memory", w.timing), ("why", w.timing), ("pagemap", w.occupancy),
                              ("modelcard", w.controls)):
            assert sizes[behind].width() >= front.width() - 30 and sizes[behind].height() >= 200, (behind, sizes)
        assert in_front == {k for k, d in w.docks.items() if on_screen(d.widget())}  # the same tabs in front after
        assert panel.fit_button.isVisible() and panel.help_button.isVisible()  # back on screen
        saved = QImage(str(next(f for f in files if "occupancy" in f.name)))
        assert saved.size() == shown.size()
        for button in (panel.fit_button, panel.help_button):
            c = button.geometry().center()
            assert saved.pixel(c) != shown.pixel(c)  # the button is not in the picture
        c = panel.caption.geometry().topLeft()
        assert saved.pixel(c) == shown.pixel(c)  # and nothing moved
    finally:
        close_window(w)


def test_the_cache_trace_survives_a_chat_switch(qtbot, data_dir, stories_path, tmp_path, monkeypatch):
    w = open_window(qtbot, data_dir, str(stories_path))
    out = tmp_path / "trace.json"
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: (str(out), ""))
    try:
        first = w.chat_id
        gens = []
        for text in ("Once upon a time", "The dog ran"):
            w.send(text)
            gens.append(wait_reply(qtbot, w)[0])
        steps = len(w.trace)
        w.new_chat()
        assert len(w.trace) == 0  # the new chat has none
        w.open_chat(first)
        assert len(w.trace) == steps and w.trace.generation_ids == gens
        w.exporter.export_trace("json")
        assert w.chat.notice.text.startswith("Saved ") and str(out) in w.chat.notice.text  # where it went, said
        data = json.loads(out.read_text())
        assert data["generation_ids"] == gens and len(data["snapshots"]) == steps
    finally:
        close_window(w)


def test_edit_and_resend_keeps_the_old_reply_as_a_version(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=GREEDY)
    try:
        w.send("A cat sat")
        wait_reply(qtbot, w)
        old = w.history.messages(w.chat_id)[1].content
        user = w.chat.bubbles[0]
        user.begin_edit()
        user.editor.setPlainText("The bird flew")
        qtbot.mouseClick(user.save_button, Qt.MouseButton.LeftButton)
        wait_reply(qtbot, w)
        reply = w.history.messages(w.chat_id)[1]
        assert [v["content"] for v in reply.stats["versions"]] == [old, reply.content] and reply.stats["version"] == 1
        bubble = w.chat.bubbles[-1]
        assert bubble.version_label.text() == "2 / 2" and bubble.version_prev.isVisible()
        qtbot.mouseClick(bubble.version_prev, Qt.MouseButton.LeftButton)  # the old reply, saying what it answered
        assert w.chat.bubbles[-1].text == old
        assert "a reply to the message before it was edited: “A cat sat”" in w.chat.bubbles[-1].notes_label.text()
    finally:
        close_window(w)


def test_precision_and_policy_switches_mid_reply_are_in_the_footer(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=440, ignore_eos=True))
    try:
        w.send("The little dog")
        qtbot.waitUntil(lambda: w.conversation.tokens_in_reply >= 3, timeout=30_000)
        c = w.controls
        c.k_dtype.setCurrentIndex(c.k_dtype.findData("int8"))  # as the user does
        qtbot.waitUntil(lambda: w.cache.applied.k_dtype == "int8", timeout=10_000)
        c.policy.setCurrentIndex(c.policy.findData("h2o"))
        assert "Heavy hitters (H2O) loses information" in use_lossy(qtbot, w)  # an eviction policy asks first
        qtbot.waitUntil(lambda: w.cache.applied.policy == "h2o", timeout=10_000)
        assert w.generation_id  # both landed mid-reply
        wait_reply(qtbot, w)
        line = w.chat.bubbles[-1].stats_label.text()
        assert "switched mid-reply: keys full precision → 8-bit; policy keeps every token → heavy hitters" in line
        assert "K:" not in line and "int8" not in line  # the controls' words, not the engine's
    finally:
        close_window(w)
