"""The message area's notices as a user sees them in the real window: the text takes the area's whole width and
wraps into a few lines, × sits in the top-right corner, action buttons go under the text. (They used to wrap one
word per line in a column about 150 px wide with × in the middle of the box.) Screenshots: ``$KVSCOPE_SHOTS``
(a folder), else the test's temporary folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from app_helpers import close_window, open_window
from PySide6.QtWidgets import QApplication

from engine.config import ModelSpec

SIZES = [(1280, 720), (1920, 1080)]
BAD = {  # how each notice is caused: the real load, the real export
    "missing": lambda w, tmp: w.load_model(ModelSpec(source=str(tmp / "no-such-model"))),
    "no-config": lambda w, tmp: w.load_model(ModelSpec(source=str(_no_config(tmp)))),
    "offline": lambda w, tmp: w.load_model(ModelSpec(source="someone/not-downloaded-model")),
    "no-trace": lambda w, tmp: w.exporter.export_trace("json"),
}


def _no_config(tmp: Path) -> Path:
    folder = tmp / "weights-only"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def _settled(qtbot, w, size) -> None:
    """Resize and wait until the notice's geometry is the same three checks in a row (a condition, no clock)."""
    w.resize(*size)
    seen: list = []

    def stable() -> bool:
        n = w.chat.notice
        seen.append((w.centralWidget().size().toTuple(), n.geometry().getRect(), n.label.geometry().getRect()))
        return len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]
    qtbot.waitUntil(stable, timeout=5000)


def _check_notice(w) -> None:
    n, area = w.chat.notice, w.chat.scroll
    assert n.isVisibleTo(w) and n.text
    # the whole width of the message area (the transcript under it), not a narrow column
    assert n.width() == area.width() and n.x() == area.x()
    inner = n.contentsRect().marginsRemoved(n.layout().contentsMargins())  # inside the border and margins
    close = n.close_button.geometry()
    # × in the top-right corner: flush with the right margin, on the first line
    assert (close.right(), close.top()) == (inner.right(), inner.top())
    assert n.width() - close.right() <= 10 and close.top() <= 10
    # the text fills the rest of the row
    assert n.label.x() == inner.left()
    assert n.label.width() == close.left() - n.layout().horizontalSpacing() - inner.left()
    # wrapped at this width: the height its lines need, every line shown
    need = n.label.heightForWidth(n.label.width())
    assert need <= n.label.height() <= need + n.label.fontMetrics().lineSpacing()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("KVSCOPE_SHOTS") or tmp_path_factory.mktemp("shots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_notices_take_the_full_width_and_wrap(qtbot, data_dir, tmp_path, shots, size):
    w = open_window(qtbot, data_dir, "stories260K")
    try:
        for case, cause in BAD.items():
            with qtbot.waitSignal(w.error_shown, timeout=60_000):
                cause(w, tmp_path)
            _settled(qtbot, w, size)
            path = shots / f"notice-{case}-{size[0]}x{size[1]}.png"
            assert w.grab().save(str(path)) and path.stat().st_size > 10_000
            _check_notice(w)
            w.chat.notice.close_button.click()
            assert not w.chat.notice.isVisibleTo(w)
            assert "stories260K, the built-in model" in w.chat.empty_hint.text()  # the model loaded before goes on
    finally:
        close_window(w)


def test_a_notice_with_actions_keeps_them_under_the_text(qtbot, data_dir, shots):
    w = open_window(qtbot, data_dir, "stories260K")
    try:
        clicked = []
        w.chat.notice.show_message("This message would leave less than 10% of the context for the reply.\n"
                                   "Send it anyway, or start a new chat?",
                                   [("Send anyway", lambda: clicked.append("send")), ("New chat", lambda: None)])
        _settled(qtbot, w, SIZES[0])
        _check_notice(w)
        n = w.chat.notice
        first, second = n.action_buttons
        assert first.mapTo(n, first.rect().topLeft()).y() >= n.label.geometry().bottom()
        assert first.mapTo(n, first.rect().topLeft()).x() == n.label.x()  # left-aligned under the text
        assert second.mapTo(n, second.rect().topLeft()).x() > first.mapTo(n, first.rect().topRight()).x()
        w.grab().save(str(shots / "notice-actions-1280x720.png"))
        first.click()
        QApplication.processEvents()
        assert clicked == ["send"] and not n.isVisibleTo(w) and not n.actions.isVisibleTo(w)
    finally:
        close_window(w)
