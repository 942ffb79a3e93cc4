"""Why prompt tokens were recomputed, as a user sees it (#35 items 1 and 3): the reply footer's line, the page
map's token strip in the reasons' colours, the "Why recomputed?" readout; and checkpoints on a hybrid and a
sliding-window model (#35 item 1): ticks on the strip, their pages on the map, their bytes in the memory readout,
what reuse costs on the model card. Real window, real models: stories260K, and tiny random lfm2 / gemma3 folders
(``arch_zoo.save_folder``: stories260K's tokenizer) opened as any model folder is."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from app_helpers import close_window, open_window, wait_reply
from PySide6.QtCore import QPointF
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QMenu
from test_hover_axes import _hover
from test_layout import _settle

from app.panels.strip import CHECKPOINT_PAGE_COLOUR, REASON_COLOURS
from app.ground.docks import on_screen
from app.ground.format import human_bytes
from app.ground.reuse_words import ALL_REUSED, NO_TURN
from engine.config import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # arch_zoo and its configs

SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def _rgb(colour: str) -> list[int]:
    c = QColor(colour)
    return [c.red(), c.green(), c.blue()]


def _system_prompt(w, text: str) -> None:
    """Type the system prompt as a user does (the field sends it 400 ms after the last key: sent at once here)."""
    w.chat.system_prompt.setText(text)
    w.chat.system_prompt_changed.emit(text)


def _front(qtbot, w, name: str) -> None:
    """Bring a dock forward (its tab) and wait until its panel drew the latest snapshot."""
    w.docks[name].raise_()
    qtbot.waitUntil(lambda: on_screen(w.docks[name].widget()))
    w.scheduler.refresh_all()
    qtbot.wait(50)


def _say(qtbot, w, text: str):
    w.send(text)
    wait_reply(qtbot, w)
    return w.chat.bubbles[-1]


def _first(stats: dict, reason: str) -> dict:
    return next(m for m in stats["cache"]["misses"] if str(m["reason"]) == reason)


def test_a_changed_system_prompt_is_named_in_the_footer_the_strip_and_the_readout(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SAMPLING)
    try:
        view = next(m for m in w.menuBar().findChildren(QMenu) if m.title() == "&View")
        names = [a.text() for a in view.actions() if a.text()]
        assert len(names) == len(set(names)) and names.count("Why recomputed?") == 1, names  # one entry a panel
        w.menu_actions["why"].trigger()  # View ▸ Why recomputed?
        qtbot.waitUntil(lambda: on_screen(w.why))
        assert w.why.text() == NO_TURN
        _system_prompt(w, "You are a kind storyteller.")
        first = _say(qtbot, w, "Tell me about a cat.")
        assert not first.why_label.isVisible()  # all new: the cache line says so, nothing to explain
        follow = _say(qtbot, w, "And a dog?")
        assert not follow.why_label.isVisible(), follow.why_label.text()  # a follow-up reuses the chat
        _system_prompt(w, "You're a kind storyteller.")
        changed = _say(qtbot, w, "And a bird?")
        stats = w.last_stats
        at = _first(stats, "diverged")["start"]
        n = sum(m["end"] - m["start"] for m in stats["cache"]["misses"] if m["reason"] != "new")  # read again
        footer = changed.why_label.text()
        assert changed.why_label.isVisible()
        said = f"recomputed {n:,} tokens: the system prompt changed at token {at} (“are a” → “'re a”)"
        assert footer.startswith(said)
        assert "Why?" in footer

        w.docks["timing"].raise_()  # the readout behind the timing panel again: the footer's link brings it forward
        qtbot.waitUntil(lambda: not on_screen(w.why))
        changed.why_label.linkActivated.emit("why")
        qtbot.waitUntil(lambda: on_screen(w.why))
        qtbot.waitUntil(lambda: "prompt changed" in w.why.text())
        readout = w.why.text()
        assert f"prompt changed · tokens {at}–" in readout and "· the system prompt to reply 2" in readout
        assert f"the prompt differs from this chat's cache at token {at}: “are a” → “'re a”" in readout
        computed = stats["cache"]["recomputed"]  # the footer's numbers, in the readout's caption
        assert f"<b>{computed:,}</b> computed ({n:,} recomputed, {computed - n:,} new)" in w.why.caption.text()
        assert f"computed {computed:,} ({n:,} recomputed, {computed - n:,} new)" in changed.cache_label.text()

        _front(qtbot, w, "page_map")
        pm = w.page_map
        qtbot.waitUntil(lambda: pm.strip.image is not None and pm.strip.image.shape[0] == 2)
        lower, upper = pm.strip.image[0], pm.strip.image[1]
        assert list(lower[at, :3]) == _rgb(REASON_COLOURS["diverged"])
        assert list(lower[at - 1, :3]) == list(upper[at - 1, :3])  # a reused token: its state's colour, as before
        assert pm.reuse_legend.isVisible() and "prompt changed" in pm.reuse_legend.text()
        _hover(pm.view, pm.strip.mapToScene(QPointF(at + 0.5, 0.5)))
        qtbot.waitUntil(lambda: pm.hover.text().startswith(f"token {at} of "))
        assert "recomputed: prompt changed — the prompt differs from this chat's cache" in pm.hover.text()

        w.on_screen.regenerate()  # the same prompt again: everything but its last token is reused
        wait_reply(qtbot, w)
        again = w.chat.bubbles[-1]
        assert not again.why_label.isVisible()
        w.show_why()
        qtbot.waitUntil(lambda: w.why.text() == ALL_REUSED)
        again.version_prev.click()  # the version before, as it was: its footer says why it was recomputed
        qtbot.waitUntil(lambda: w.chat.bubbles[-1].why_label.isVisible())
        assert w.chat.bubbles[-1].why_label.text() == footer
    finally:
        close_window(w)


@pytest.fixture(scope="module")
def hybrid_folders(tmp_path_factory, stories_path):
    from arch_zoo import save_folder

    root = tmp_path_factory.mktemp("hybrid")
    for model_type in ("lfm2", "gemma3_text"):
        save_folder(model_type, root / model_type, stories_path)
    return root


def test_checkpoints_of_a_recurrent_model_on_the_strip_the_memory_readout_and_the_model_card(
        qtbot, tmp_path, hybrid_folders):
    w = open_window(qtbot, tmp_path, str(hybrid_folders / "lfm2"), sampling=SAMPLING)
    try:
        card = w.model_card.table.text()
        assert "1 state (recurrent/conv)" in card
        assert "to checkpoints: 8 kept, ≤ " in card
        _system_prompt(w, "You are a kind storyteller.")
        _say(qtbot, w, "Tell me about a cat.")
        _say(qtbot, w, "And a dog?")
        _front(qtbot, w, "page_map")
        pm = w.page_map
        qtbot.waitUntil(lambda: pm.snapshot is not None and len(pm.snapshot.checkpoints) >= 2)
        snap = pm.snapshot
        xs, _ys = pm.ticks.item.getData()
        assert list(xs) == list(snap.checkpoints)  # one tick per checkpoint, at its token
        cp, size = snap.checkpoints[-1], snap.checkpoint_sizes[-1]
        _hover(pm.view, pm.strip.mapToScene(QPointF(cp, 0.5)))
        qtbot.waitUntil(lambda: pm.hover.text().startswith("checkpoint:"))
        assert pm.hover.text() == f"checkpoint: state snapshot at token {cp:,} · {human_bytes(size)}"
        assert f"{len(snap.checkpoints)} checkpoints ({human_bytes(snap.checkpoint_bytes)})" in pm.caption.text()
        _front(qtbot, w, "memory")
        qtbot.waitUntil(lambda: "checkpoints" in w.memory.caption.text())
        assert (f"+ {len(snap.checkpoints)} checkpoints <b>{human_bytes(snap.checkpoint_bytes)}</b>"
                in w.memory.caption.text())

        _system_prompt(w, "You're a kind storyteller.")  # the state goes back only to a checkpoint: the start
        changed = _say(qtbot, w, "And a bird?")
        at = _first(w.last_stats, "diverged")["start"]
        again = sum(m["end"] - m["start"] for m in w.last_stats["cache"]["misses"] if m["reason"] != "new")
        assert changed.why_label.text().startswith(f"recomputed {again:,} tokens: the system prompt changed at token {at}")
        assert "and 1 more reason" in changed.why_label.text()
        changed.why_label.linkActivated.emit("why")
        qtbot.waitUntil(lambda: "no state checkpoint" in w.why.text())
        assert f"no state checkpoint · tokens 0–{at - 1} ({at}) · the system prompt" in w.why.text()
    finally:
        close_window(w)


def test_pages_only_checkpoints_hold_on_a_sliding_window_model(qtbot, tmp_path, hybrid_folders):
    w = open_window(qtbot, tmp_path, str(hybrid_folders / "gemma3_text"), sampling=SAMPLING)
    try:
        card = w.model_card.table.text()
        assert "1 sliding (window 8)" in card and "to checkpoints: 8 kept" in card
        _settle(qtbot, w, (1280, 720))
        _system_prompt(w, "You are a kind storyteller.")
        _say(qtbot, w, "Tell me about a cat, a dog and a bird, please.")
        _say(qtbot, w, "And a fish?")
        _system_prompt(w, "You're a kind storyteller.")
        _say(qtbot, w, "And a bird?")  # the longest legends: two reasons, a checkpoint, its pages
        qtbot.wait(300)
        # the panels behind tabs (their legends many lines tall at a hidden tab's width) did not grow the window
        assert (w.width(), w.height()) == (1280, 720) and on_screen(w.statusBar())
        _front(qtbot, w, "page_map")
        pm = w.page_map
        qtbot.waitUntil(lambda: pm.snapshot is not None and bool(pm.snapshot.checkpoint_pages))
        page = pm.snapshot.checkpoint_pages[0]
        row, col = divmod(page, pm.cols)
        assert list(pm.colours[row, col, :3]) == list(np.round(
            np.array(_rgb(CHECKPOINT_PAGE_COLOUR)) * _fill_scale(pm.snapshot, page)).astype(np.uint8))
        assert "held only by checkpoints" in pm.describe_page(page)
        assert "pages only checkpoints hold" in pm.reuse_legend.text()
        cp = pm.snapshot.checkpoints[-1]
        assert pm.describe_checkpoint(cp).startswith(f"checkpoint: sliding windows kept at token {cp:,} · ")
    finally:
        close_window(w)


def _fill_scale(snap, page: int) -> float:
    """The page map's brightness of a page that holds tokens: fuller is brighter."""
    return 0.45 + 0.55 * min(1.0, snap.page_fill[page] / max(snap.page_size, 1))


def test_the_readout_of_a_chat_without_an_account_and_of_a_prompt_computed_new(qtbot):
    """A remote chat's snapshots carry no account; a reopened chat's first prompt computes every token new."""
    from app_helpers import make_snapshot

    from app.panels.why import WhyPanel
    from app.ground.reuse_words import NO_ACCOUNT
    from engine.snapshot import CacheAccount, Miss, MissReason

    panel = WhyPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(make_snapshot(account=None))
    assert panel.text() == NO_ACCOUNT
    panel.show_snapshot(make_snapshot(account=CacheAccount(11, 0, 11, 0, (Miss(0, 11, MissReason.NEW, "not in the "
                                                                                                      "cache before"),))))
    assert panel.text().startswith("Nothing was recomputed: the tokens computed were new")
    assert "new · tokens 0–10 (11)" in panel.text()
    panel.clear()
    assert panel.text() == NO_TURN
