"""Settings ▸ KV disk cache on the real window (#23): a chat written by one window is restored from disk by a new
window on the same data folder (its reply's footer and notes say so, the page map frames the restored pages, the
status bar shows the tier's size), Clear empties it after a confirmation, the setting persists, and a folder that
cannot be written is a notice, never a crash. Real stories260K, real files; no mocks."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from app_helpers import close_window, open_window, wait_reply
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from app.link.disk_tier import DiskConfig, disk_from_settings
from app.panels.page_map import RESTORED_COLOUR, _rgb

SHOTS = Path(os.environ.get("KVSCOPE_SHOTS") or Path(tempfile.gettempdir()) / "kvscope-shots")
# ~90 tokens: several full pages of 16 in the prompt, written to disk while the first window reads it
LONG = ("Once upon a time there was a little girl named Lily who loved to play in the park with her big red ball. "
        "One day she saw a dog and a cat and a bird sitting under a tree, and she asked them to play with her.")


def page_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kvp"))


def has_colour(image: np.ndarray, hex_colour: str) -> bool:
    rgb = _rgb(hex_colour).astype(np.uint8)
    return bool(np.any(np.all(image[..., :3] == rgb, axis=-1)))


def answer_boxes(button: QMessageBox.StandardButton) -> tuple[QTimer, list[str]]:
    """Click ``button`` of each modal message box that opens (the real one Clear opens) while the returned timer
    runs (the box's own event loop runs it); the list collects the boxes' texts."""
    seen: list[str] = []

    def click() -> None:
        box = QApplication.activeModalWidget()
        if isinstance(box, QMessageBox):
            seen.append(box.text())
            box.button(button).click()

    poll = QTimer()
    poll.setInterval(20)
    poll.timeout.connect(click)
    poll.start()
    return poll, seen


def test_a_reopened_chat_is_restored_from_disk_and_clear_empties_it(qtbot, data_dir, stories_path):
    kv = data_dir / "kv"
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        assert w.disk.cfg == DiskConfig() and w.disk.folder == str(kv.resolve())  # on by default, in data_dir/kv
        w.send(LONG)
        wait_reply(qtbot, w)
        chat = w.chat_id
        assert "restored" not in w.chat.bubbles[-1].cache_label.text()
    finally:
        close_window(w)  # the worker's stop writes what was queued
    assert len(page_files(kv)) >= 5  # the prompt's full pages at least

    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        qtbot.waitUntil(lambda: w.disk.nbytes > 0)  # the new window's tier found the files
        assert w.status.disk.isVisible() and w.status.disk.text().startswith("KV on disk ")
        assert w.status.disk.text() != "KV on disk 0 B"
        w.open_chat(chat)
        qtbot.waitUntil(lambda: w.chat_id == chat and not w.generation_id)
        w.conversation.regenerate()
        gen, reason = wait_reply(qtbot, w)
        assert reason != "error"
        stats = w.last_stats
        assert stats["disk_restored_tokens"] >= 5 * 16
        reply = w.chat.bubbles[-1]
        # said in the (green) cache line, weighed against this chat's own prefill — not as an (amber) note
        first = stats["versions"][0]["stats"]  # the reply regenerated (its prefill read the prompt); a guess from the
        # model's size said 0.2 ms for what took this chat ~33 ms
        again = stats["disk_restored_tokens"] / first["prefill_tokens_per_s"] * 1000.0
        assert stats["disk_again_ms"] == pytest.approx(again) and stats["disk_rate"] == "chat"
        assert (f"{stats['disk_restored_tokens']:,} restored from disk in {stats['disk_ms']:,.0f} ms (computing them "
                f"again: ~{again:,.0f} ms, at this chat's prefill rate)") in reply.cache_label.text()
        assert "from disk" not in reply.notes_label.text() and "from disk" not in " ".join(stats.get("notes", ()))
        # the page map: the restored pages framed, counted under the legend, named when hovered
        qtbot.waitUntil(lambda: w.page_map.snapshot is not None and w.page_map.snapshot.generation_id == gen
                        and len(w.page_map.snapshot.restored_pages) > 0)
        snap = w.page_map.snapshot
        assert has_colour(w.page_map.image.image, RESTORED_COLOUR)
        assert f"{len(snap.restored_pages)} pages restored from disk" in w.page_map.readout
        assert w.page_map.describe_page(snap.restored_pages[0]).endswith("restored from disk")
        SHOTS.mkdir(parents=True, exist_ok=True)
        w.resize(1280, 720)
        qtbot.waitUntil(lambda: w.width() == 1280)
        w.grab().save(str(SHOTS / "kv_disk_restored.png"))
        w.docks["page_map"].raise_()  # tabbed with the occupancy panel at this size
        qtbot.waitUntil(lambda: w.page_map.isVisible())
        w.page_map.grab().save(str(SHOTS / "kv_disk_page_map.png"))

        # Settings ▸ KV disk cache ▸ Clear…: a confirmation, then no files and a readout of 0
        w.menu_actions["kv_disk"].trigger()
        dialog = w.settings_dialog.disk
        assert w.settings_dialog.tabs.currentWidget() is dialog
        assert dialog.enabled.isChecked() and dialog.size.text() != "0 B"
        poll, seen = answer_boxes(QMessageBox.StandardButton.Yes)
        try:
            with qtbot.waitSignal(w.disk.changed, timeout=30_000):
                dialog.clear_button.click()
        finally:
            poll.stop()
        assert seen and "Delete the" in seen[0]
        assert page_files(kv) == [] and w.disk.nbytes == 0
        assert w.status.disk.text() == "KV on disk 0 B" and dialog.size.text() == "0 B"
    finally:
        close_window(w)


def test_the_setting_persists_and_a_folder_that_cannot_be_written_is_a_notice(qtbot, data_dir, stories_path,
                                                                             tmp_path):
    blocked = tmp_path / "a file"  # a folder under a file cannot be made (also for root, unlike a read-only one)
    blocked.write_text("not a folder")
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.menu_actions["kv_disk"].trigger()
        dialog = w.settings_dialog.disk
        dialog.budget.setValue(0.5)
        dialog.folder.setText(str(blocked / "kv"))
        with qtbot.waitSignal(w.error_shown, timeout=30_000) as shown:
            w.settings_dialog.accept()
        assert "cannot write" in shown.args[0] and str(blocked) in shown.args[0]
        assert w.chat.notice.isVisible()
        cfg, folder = disk_from_settings(w.settings)
        assert cfg == DiskConfig(True, str(blocked / "kv"), 0.5) and folder == str(blocked / "kv")
        w.send("Once upon a time")  # the chat works without the tier
        assert wait_reply(qtbot, w)[1] != "error"
        # off: the status bar's field goes
        w.menu_actions["kv_disk"].trigger()
        dialog = w.settings_dialog.disk
        dialog.enabled.setChecked(False)
        with qtbot.waitSignal(w.disk.changed, timeout=30_000):
            w.settings_dialog.accept()
        assert not w.status.disk.isVisible() and w.disk.state.tier is None
    finally:
        close_window(w)
