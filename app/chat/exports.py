"""File ▸ Export: the chat's cache trace as JSON or CSV, the panels as PNG files, the chat as Markdown.

Save dialogs open in the folder of the last export (at first the user's Documents folder, else home),
panel PNGs get names with the time (and a number if that exists), so an export never overwrites another,
and every failure to write becomes a message, never an exception.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from PySide6.QtCore import QStandardPaths, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QApplication, QFileDialog, QWidget

from app.history.store import HistoryStore
from app.settings.store import Settings
from app.ground.docks import on_screen
from app.ground.status_bar import StatusBar
from app.panels.trace import CacheTrace


def documents_dir() -> Path:
    """The user's Documents folder (home when the platform has none)."""
    loc = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    path = Path(loc) if loc else Path.home()
    return path if path.is_dir() else Path.home()


def unique_path(path: Path) -> Path:
    """``path``, or ``name-2.ext``, ``name-3.ext``, ... whichever does not exist yet."""
    n = 2
    candidate = path
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        n += 1
    return candidate


@contextmanager
def in_front(panel: QWidget, docks: dict) -> Iterator[None]:
    """``panel``'s dock brought in front of its tab group (and laid out) for as long as the block runs; the dock
    that was in front comes back after."""
    dock = next((d for d in docks.values() if d.widget() is panel or d.isAncestorOf(panel)), None)
    if dock is None or on_screen(panel):
        yield
        return
    window = dock.parentWidget()
    group = [d for d in window.tabifiedDockWidgets(dock)] if hasattr(window, "tabifiedDockWidgets") else []
    shown = next((d for d in group if d.widget() is not None and on_screen(d.widget())), None)
    dock.raise_()
    QApplication.processEvents()  # its page laid out at the group's size before the picture
    try:
        yield
    finally:
        if shown is not None:
            shown.raise_()


def safe_name(title: str) -> str:
    return "".join(c if c.isalnum() or c in " -_" else "_" for c in title)[:60].strip() or "chat"


class Exporter:
    """Export actions of the window. ``chat()`` gives (history chat id or None, model name)."""

    def __init__(self, parent: QWidget, settings: Settings, history: HistoryStore, trace: CacheTrace,
                 panels: list, status: StatusBar, chat: Callable[[], tuple[int | None, str]],
                 flush: Callable[[], None], show_error: Callable[[str], None]) -> None:
        self.parent = parent
        self.settings = settings
        self.history = history
        self.trace = trace
        self.panels = panels
        self.status = status
        self._chat = chat
        self._flush = flush
        self._show_error = show_error

    def start_dir(self) -> Path:
        last = Path(self.settings.get("export/folder") or "")
        return last if str(last) not in ("", ".") and last.is_dir() else documents_dir()

    def _remember(self, path: str | Path) -> None:
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        self.settings.set("export/folder", str(folder))

    def _write(self, path: str | Path, write: Callable[[Any], Any], what: str) -> None:
        try:
            write(path)
            self._remember(path)
            self._saved(f"Saved {what} as {path}.", Path(path).parent)
        except OSError as exc:
            self._show_error(f"Could not write {path}: {exc}")

    def export_trace(self, kind: str) -> None:
        if not len(self.trace):
            self._show_error("No cache trace for this chat yet: the trace records the replies written while the "
                             "app runs. Send a message first.")
            return
        name = self.start_dir() / f"kvscope-trace-{time.strftime('%Y%m%d-%H%M%S')}.{kind}"
        path, _ = QFileDialog.getSaveFileName(self.parent, "Export this chat's cache trace", str(name),
                                              "JSON (*.json)" if kind == "json" else "CSV (*.csv)")
        if path:
            write = self.trace.write_json if kind == "json" else self.trace.write_csv
            self._write(path, write, f"the cache trace ({len(self.trace)} steps)")

    def export_panels(self, folder: str | Path) -> list[Path]:
        """Save every panel as ``kvscope-<panel>-<time>.png`` in ``folder`` (never over an existing file), each as it
        looks in front: a panel behind a tab is brought forward for its picture (Qt never lays out a hidden tab's
        page: the Memory panel came out 119×264, its labels over its bar), then the tab shown before comes back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = []
        for panel in self.panels:
            name = panel.objectName().lower().replace("panel", "")
            path = unique_path(folder / f"kvscope-{name}-{stamp}.png")
            with in_front(panel, getattr(self.parent, "docks", {})):
                if panel.export_png(str(path)):
                    out.append(path)
        return out

    def export_pngs(self) -> None:
        folder = QFileDialog.getExistingDirectory(
            self.parent, "Choose a folder for the panel pictures (one PNG file per panel)", str(self.start_dir()))
        if folder:
            try:
                paths = self.export_panels(folder)
                self._remember(folder)
                self._saved(f"Saved {len(paths)} panel pictures (PNG) in {folder}: "
                            f"{', '.join(p.name for p in paths)}.", folder)
            except OSError as exc:
                self._show_error(f"Could not write the PNG files: {exc}")

    def _saved(self, text: str, folder: str | Path) -> None:
        """Say where an export went, in the message area (it stays until the next message), with the folder a
        click away; the status bar says it too."""
        self.status.message(text.splitlines()[0], 12000)
        open_folder = lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))  # noqa: E731
        notice = getattr(self.parent, "chat", None)
        if notice is not None:
            notice.notice.show_message(text, [("Open folder", open_folder)], tone="info")

    def export_chat_markdown(self, path: str | Path) -> Path:
        """Write the open chat as Markdown (messages, and each reply's stats and cache line)."""
        from app.chat.export import chat_markdown

        self._flush()  # what streamed so far is in history
        chat_id, model = self._chat()
        chat = self.history.chat(chat_id) if chat_id is not None else None
        if chat is None:
            raise ValueError("no chat is open")
        path = Path(path)
        path.write_text(chat_markdown(chat, self.history.messages(chat.id), model), encoding="utf-8")
        return path

    def export_chat(self) -> None:
        chat_id, _model = self._chat()
        if chat_id is None or not self.history.messages(chat_id):
            self._show_error("Nothing to export yet: this chat has no messages.")
            return
        title = (self.history.chat(chat_id).title or "chat").strip()
        name = self.start_dir() / f"{safe_name(title)}.md"
        path, _ = QFileDialog.getSaveFileName(self.parent, "Export the chat as Markdown", str(unique_path(name)),
                                              "Markdown (*.md)")
        if path:
            self._write(path, self.export_chat_markdown, "the chat")
