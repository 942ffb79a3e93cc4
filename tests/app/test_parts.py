"""The window's parts on their own: panel frames, status words, stop marks, exports, the warmed comparison."""

from __future__ import annotations

import numpy as np
from app_helpers import make_snapshot
from PySide6.QtGui import QGuiApplication

from engine.config import CacheConfig


class FakePanel:
    """Records what it drew; always on screen."""

    def __init__(self, name: str) -> None:
        self.name, self.drawn, self.paused, self.captioned = name, [], False, []

    def objectName(self) -> str:  # noqa: N802 - Qt name
        return self.name

    def isVisible(self) -> bool:  # noqa: N802 - Qt name
        return True

    def show_snapshot(self, snap) -> None:
        self.drawn.append(snap)

    def show_caption(self, snap) -> None:
        self.captioned.append(snap)

    def repaint(self) -> None:
        pass

    def clear(self) -> None:
        self.drawn.append(None)

    def set_paused(self, paused: bool) -> None:
        self.paused = paused


def test_every_panel_draws_the_same_snapshot_before_the_next(monkeypatch):
    from app.panels import scheduler as panel_scheduler

    monkeypatch.setattr(panel_scheduler, "on_screen", lambda p: True)
    monkeypatch.setattr(panel_scheduler, "PANEL_INTERVAL_S", 0.0)
    monkeypatch.setattr(panel_scheduler, "PANEL_BUDGET", 1e9)
    panels = [FakePanel(n) for n in "abcd"]
    frames: list = []
    captions_when_taken: list = []  # each panel's caption as the status bar is told of a frame
    s = panel_scheduler.PanelScheduler(panels, lambda f: (frames.append(f), captions_when_taken.append(
        [p.captioned[-1] if p.captioned else None for p in panels])))
    snaps = [make_snapshot(step=i, kv_bytes=1000 + i) for i in range(10)]
    for i, snap in enumerate(snaps):  # a new snapshot on every tick, faster than the panels draw
        s.offer(snap)
        s.tick()
    # each frame was drawn by every panel before the next frame began: the panels agree
    for p in panels:
        assert p.drawn == frames[: len(p.drawn)]
    assert frames == [snaps[0], snaps[4], snaps[8]] and all(len(p.drawn) >= 2 for p in panels)
    # and every caption said the frame the status bar said, from the moment it was taken
    assert captions_when_taken == [[f] * len(panels) for f in frames]
    s.set_enabled(False)
    assert all(p.paused for p in panels)
    s.offer(snaps[9])
    s.tick()
    assert frames[-1] is snaps[9] and all(snaps[9] not in p.drawn for p in panels)  # paused: status only
    assert all(snaps[9] not in p.captioned for p in panels)  # paused: the captions stay with their charts


def test_memory_chart_draws_idle_time_flat(qtbot):
    from app.panels import MemoryPanel

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.show_snapshot(make_snapshot(kv_bytes=1 << 20), now=100.0)
    panel.show_snapshot(make_snapshot(kv_bytes=2 << 20), now=100.5)
    panel.show_snapshot(make_snapshot(kv_bytes=3 << 20), now=130.0)  # after 29.5 s idle
    s = panel.series()
    np.testing.assert_allclose(s["t"], [0, 0.5, 29.999, 30], atol=1e-6)
    np.testing.assert_array_equal(s["kv_mib"], [1, 2, 2, 3])  # held flat, then the step
    assert panel.plot.legend is None  # the legend is a row under the chart, never over the data
    assert "weights" in panel.legend.text() and "KV cache" in panel.legend.text()


def test_status_bar_speaks_in_words_and_never_cuts_a_word(qtbot):
    from PySide6.QtWidgets import QStatusBar

    from app.ground.status_bar import StatusBar

    bar = QStatusBar()
    qtbot.addWidget(bar)
    status = StatusBar(bar)
    status.show_cache(CacheConfig(page_size=16, k_dtype="int8", policy="h2o", policy_params={"budget": 256}))
    text = status.cache.text()
    assert text == "paged cache, 16-token pages · keys 8-bit · heavy hitters, 256 per layer"
    for jargon in ("K:", "V:", "auto", "h2o", "paged/"):
        assert jargon not in text
    status.show_cache(CacheConfig(mode="contiguous", k_dtype="int4", v_dtype="int4", policy="streaming"))
    assert status.cache.text() == "contiguous cache · keys and values 4-bit · sinks + recent window"
    label, text = status.cache, status.cache.text()
    label.resize(label.fontMetrics().horizontalAdvance(text) // 2, 20)
    shown = label.shown_text()
    assert shown.endswith("…") and shown != text
    assert all(word in text.split(" ") for word in shown.rstrip("…").split(" "))  # whole words only


def test_stop_marks_say_why_and_what_to_do():
    from app.chat.message_view import pin_line, stats_line

    line = stats_line({"stop_reason": "context_full", "generated_tokens": 200})
    assert line.endswith("stopped: context full — start a new chat, shorten it, or choose an overflow policy")
    assert stats_line({"stop_reason": "cancelled", "stop_detail": "a message was sent in another chat"}).endswith(
        "stopped: a message was sent in another chat")
    assert stats_line({"stop_reason": "eos", "generated_tokens": 3}).endswith(
        "3 tokens · ended: the model finished its reply (end of text)")  # a natural end says so too
    assert stats_line({"stop_reason": "eos", "generated_tokens": 1}).startswith("1 token ·")
    assert stats_line({"pinned": True}) == "" and pin_line({"pinned": True, "tokens": 7}).startswith("pinned · 7")


def test_copy_says_copied(qtbot):
    from app.chat.message_view import MessageView

    view = MessageView("assistant", "some text")
    qtbot.addWidget(view)
    view.copy_button.click()
    assert QGuiApplication.clipboard().text() == "some text" and view.copy_button.text().startswith("Copied")
    qtbot.waitUntil(lambda: view.copy_button.text() == "Copy", timeout=3000)


def test_exports_never_overwrite_and_start_in_documents(qtbot, tmp_path, monkeypatch):
    from app.chat import exports
    from app.panels import OccupancyPanel
    from app.settings.store import Settings

    panel = OccupancyPanel()
    qtbot.addWidget(panel)
    panel.resize(300, 200)
    ex = exports.Exporter(None, Settings.from_file(tmp_path / "s.ini"), None, None, [panel], None,
                          chat=lambda: (None, ""), flush=lambda: None, show_error=print)
    first = ex.export_panels(tmp_path / "png")
    second = ex.export_panels(tmp_path / "png")
    assert len({*first, *second}) == 2 and all(p.exists() for p in first + second)
    assert exports.documents_dir().is_dir() and ex.start_dir() == exports.documents_dir()
    ex._remember(tmp_path / "png" / "x.json")
    assert ex.start_dir() == tmp_path / "png"


def test_the_trace_covers_every_reply_of_the_chat():
    from app.panels.trace import CacheTrace

    trace = CacheTrace()
    trace.begin(1)
    trace.add(make_snapshot(generation_id=1, step=1))
    trace.begin(2)
    trace.add(make_snapshot(generation_id=2, step=1))
    trace.add(make_snapshot(generation_id=3, step=1))  # not this chat's
    assert [s.generation_id for s in trace.snapshots] == [1, 2] and trace.generation_ids == [1, 2]
    trace.reset()
    assert len(trace) == 0


class _Session:
    def __init__(self, log, cfg):
        self.log, self.cfg = log, cfg

    def start(self, messages, sampling):
        self.log.append(("warm", self.cfg, sampling.max_new_tokens))

    def step(self):
        return type("R", (), {"done": True})()

    def close(self):
        pass


class _Inner:
    """A comparison of two settings, two steps each."""

    def __init__(self, log):
        from engine.config import SamplingConfig

        self.log, self.settings, self.greedy = log, (("a", "A"), ("b", "B")), SamplingConfig(max_new_tokens=2)
        self.messages, self.rows, self.cancelled, self.n = [{"role": "user", "content": "x"}], [], False, 0

    @property
    def done(self):
        return len(self.rows) == 2

    def step(self):
        self.n += 1
        self.log.append(("timed", self.n))
        if self.n % 2 == 0:
            self.rows.append({"label": "ab"[len(self.rows)]})
            return self.rows[-1]
        return None


def test_every_setting_is_warmed_before_any_row_is_timed():
    from app.link.comparison import WarmedComparison

    log: list = []
    c = WarmedComparison(_Inner(log), lambda cfg: _Session(log, cfg))
    rows, progress = [], []
    while not c.done:
        row = c.step()
        progress.append(c.progress()[0])
        if row is not None:
            rows.append(row)
    assert log[:2] == [("warm", "A", 1), ("warm", "B", 1)] and all(e[0] == "timed" for e in log[2:])
    assert [r["label"] for r in rows] == ["a", "b"] and progress == sorted(progress) and progress[-1] == 1.0


def test_the_cache_line_says_where_reused_tokens_came_from():
    from app.chat.message_view import cache_line

    assert cache_line({"reused_tokens": 0, "recomputed_tokens": 7, "first_divergence": -1}) == \
        "reused 0 tokens, computed 7 (new)"
    assert cache_line({"reused_tokens": 16, "recomputed_tokens": 7, "first_divergence": -1, "shared_tokens": 16}) == \
        "reused 16 tokens, computed 7 (new); 16 from another chat's cache"
    # the account's numbers when the reply has one: tokens read again apart from new ones, as the Why readout says
    account = {"prompt": 43, "reused": 40, "recomputed": 3, "dropped": 0,
               "misses": [{"start": 40, "end": 42, "reason": "diverged", "detail": "at token 40"},
                          {"start": 42, "end": 43, "reason": "new", "detail": "not in the cache before"}]}
    assert cache_line({"reused_tokens": 40, "recomputed_tokens": 3, "first_divergence": 40, "shared_tokens": 16,
                       "cache": account}) == "reused 40 tokens, computed 3 (2 recomputed, 1 new); 16 from another chat's cache"
    assert cache_line({"reused_tokens": 1, "recomputed_tokens": 4033, "first_divergence": 1}) == \
        "reused 1 token, computed 4,033 (new)"  # not "reused 1 tokens"


def test_compare_says_how_a_reply_starts_as_the_reference_and_its_close_button_is_readable(qtbot):
    """#31: '63/263' under 'same tokens as reference' read as 63 of 263 matching anywhere; Close had a dark icon on the
    dark theme (every dialog button now shows its words only)."""
    from PySide6.QtWidgets import QDialogButtonBox, QStyle

    from app.compare.dialog import COLUMNS, same_words

    assert COLUMNS[4] == "tokens as in the reference"
    assert same_words(63, 263, 263) == "the first 63 of 263, then it differs"
    assert same_words(120, 120, 120) == "all 120 (identical)"
    assert same_words(50, 50, 120) == "all 50, then it stopped (the reference wrote 120)"
    assert same_words(120, 130, 120) == "all the reference's 120, then 10 more"
    box = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
    qtbot.addWidget(box)
    assert box.style().styleHint(QStyle.StyleHint.SH_DialogButtonBox_ButtonsHaveIcons) == 0
    assert box.button(QDialogButtonBox.StandardButton.Close).icon().isNull()


def test_a_narrow_status_bar_keeps_the_model_and_device_whole_when_the_context_says_what_was_dropped(qtbot):
    """At 1024 px, 'Context: 261 of 512 tokens · chat 435 (174 dropped)' squeezed the model's name to 'Model…' and
    its device to 'on…'; the cache settings, the longest field, give way instead."""
    from PySide6.QtWidgets import QStatusBar

    from app.ground.status_bar import StatusBar

    bar = QStatusBar()  # in the theme (conftest): its fields' 8 px padding counted
    qtbot.addWidget(bar)
    status = StatusBar(bar)
    status.show_model("stories260K", device="cpu")
    status.show_cache(CacheConfig(page_size=16, k_dtype="int4", policy="streaming"))
    status.show_context(261, 512, "turns", chat=435)
    status.show_speed(117.0)
    status.show_disk(561_540)
    bar.resize(1024, 24)
    bar.show()
    qtbot.waitExposed(bar)
    qtbot.wait(50)
    assert status.model.shown_text() == "Model: stories260K" and status.device.shown_text() == "on CPU"
    # the tier does not grow under int4 keys and StreamingLLM: the tooltip says which chats it keeps
    assert "no eviction" in status.disk.toolTip() and "quantized keys" in status.disk.toolTip()
    assert status.context.shown_text() == "Context: 261 of 512 tokens · chat 435 (174 dropped)"
    assert status.cache.shown_text().endswith("…")  # the one that gives way
