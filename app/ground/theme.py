"""The app's look: a dark Fusion palette that matches the plots, plus a small style sheet."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette, QPen
from PySide6.QtWidgets import QApplication, QProxyStyle, QStyle, QStyleFactory

BG = "#1b1e24"
BASE = "#16191f"
PANEL = "#22262e"
TEXT = "#d8dce3"
MUTED = "#8a919c"
ACCENT = "#4c9be8"

STYLE = f"""
QMainWindow::separator {{ background: {BG}; width: 4px; height: 4px; }}
QDockWidget {{ color: {TEXT}; font-weight: 600; }}
QDockWidget::title {{ background: {PANEL}; padding: 4px 8px; }}
QLabel#panelCaption, QLabel#hoverLine, QLabel#hint {{ color: {MUTED}; }}
QLabel#legendChip {{ color: {MUTED}; }}
QLabel#pausedLabel {{ color: #ffb347; font-weight: 600; padding: 0 4px; }}
QToolButton#panelTool {{ color: {MUTED}; font-weight: 600; }}
QLabel#versionLabel {{ color: {MUTED}; }}
QLabel#chatTitle {{ font-size: 15px; font-weight: 600; }}
QLabel#emptyHint {{ color: {MUTED}; font-size: 14px; padding: 40px; }}
QLabel#roleLabel {{ color: {MUTED}; font-weight: 600; }}
QLabel#statsLine {{ color: {MUTED}; font-size: 11px; }}
QLabel#cacheLine {{ color: #43c59e; font-size: 11px; }}
QLabel#whyLine {{ color: #f0a35e; font-size: 11px; }}
QLabel#errorLine {{ color: #ff8080; }}
QLabel#noteLine {{ color: #ffb347; font-size: 11px; }}
QLabel#lossyChip {{ color: #1b1e24; background: #ffb347; border-radius: 8px; padding: 1px 8px; font-size: 11px; }}
QLabel#saveLine {{ color: #ffb347; font-size: 11px; }}
QLabel#progressLine {{ color: {ACCENT}; font-size: 11px; }}
QFrame#notice {{ background: #3a1f24; border: 1px solid #6b2b33; border-radius: 6px; }}
QLabel#noticeText {{ color: #ffb0b0; }}
QFrame#notice[tone="info"] {{ background: #1f2a3a; border: 1px solid #2f4a6b; }}
QFrame#notice[tone="info"] QLabel#noticeText {{ color: {TEXT}; }}
QWidget#transcript {{ background: {BASE}; }}
QFrame#bubble_user {{ background: #25324a; border-radius: 10px; }}
QFrame#bubble_assistant, QFrame#bubble_api {{ background: {PANEL}; border-radius: 10px; }}
QFrame#bubble_tool {{ background: #2a2436; border-radius: 10px; }}
QPushButton#flatButton {{ background: transparent; border: 1px solid transparent; border-radius: 3px; color: {MUTED};
    padding: 0 3px; }}
QPushButton#flatButton:hover {{ color: {TEXT}; }}
QPushButton#flatButton:focus, QLabel#messageBody:focus {{ border: 1px solid {ACCENT}; border-radius: 3px; }}
QScrollArea#transcriptScroll {{ border: 1px solid transparent; }}
QScrollArea#transcriptScroll:focus {{ border: 1px solid {ACCENT}; }}
QPushButton#primaryButton {{ background: {ACCENT}; color: white; border-radius: 4px; padding: 5px 14px; }}
QPushButton#primaryButton:disabled {{ background: #33465e; color: #9aa3ad; }}
QPushButton#primaryButton:focus {{ border: 2px solid #ffffff; padding: 3px 12px; }}
QPushButton#suggestion:focus {{ border: 2px solid {ACCENT}; }}
QListWidget:focus, QPlainTextEdit:focus, QLineEdit:focus {{ border: 1px solid {ACCENT}; }}
QPushButton#suggestion {{ background: {PANEL}; border: 1px solid #2d323b; border-radius: 14px; padding: 6px 14px;
    color: {TEXT}; }}
QPushButton#suggestion:hover {{ border-color: {ACCENT}; }}
QLabel#statusField {{ color: {MUTED}; padding: 0 8px; }}
QLabel#modelCard {{ color: {TEXT}; }}
QGroupBox {{ font-weight: 600; border: 1px solid #2d323b; border-radius: 6px; margin-top: 8px; padding-top: 6px; }}
QGroupBox::title {{ subcontrol-origin: margin; left: 8px; padding: 0 4px; color: {MUTED}; }}
"""


class _Style(QProxyStyle):
    """Fusion without icons on dialog buttons: its Close / Cancel / OK icons are drawn dark, unreadable on this
    dark palette (the Compare dialog's Close showed a dark glyph on a dark button); the words say it all."""

    def styleHint(self, hint, option=None, widget=None, data=None):  # noqa: N802 - Qt name
        if hint == QStyle.StyleHint.SH_DialogButtonBox_ButtonsHaveIcons:
            return 0
        return super().styleHint(hint, option, widget, data)

    def drawPrimitive(self, element, option, painter, widget=None) -> None:  # noqa: N802 - Qt name
        """The keyboard focus as a 2-pixel accent frame: Fusion's dotted one was all but invisible on this palette
        (after Tab nothing on screen said where the focus was)."""
        if element == QStyle.PrimitiveElement.PE_FrameFocusRect:
            painter.save()
            painter.setPen(QPen(QColor(ACCENT), 2))
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawRoundedRect(option.rect.adjusted(1, 1, -1, -1), 3, 3)
            painter.restore()
            return
        super().drawPrimitive(element, option, painter, widget)


def apply_theme(app: QApplication) -> None:
    app.setStyle(_Style(QStyleFactory.create("Fusion")))
    p = QPalette()
    for role, colour in (
        (QPalette.ColorRole.Window, BG), (QPalette.ColorRole.WindowText, TEXT), (QPalette.ColorRole.Base, BASE),
        (QPalette.ColorRole.AlternateBase, PANEL), (QPalette.ColorRole.ToolTipBase, PANEL),
        (QPalette.ColorRole.ToolTipText, TEXT), (QPalette.ColorRole.Text, TEXT), (QPalette.ColorRole.Button, PANEL),
        (QPalette.ColorRole.ButtonText, TEXT), (QPalette.ColorRole.Highlight, ACCENT),
        (QPalette.ColorRole.HighlightedText, "#ffffff"), (QPalette.ColorRole.Link, ACCENT),
        (QPalette.ColorRole.PlaceholderText, MUTED),
    ):
        p.setColor(role, QColor(colour))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText, QPalette.ColorRole.WindowText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor("#5d636d"))
    app.setPalette(p)
    app.setStyleSheet(STYLE)
