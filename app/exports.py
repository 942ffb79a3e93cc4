"""File ▸ Export for the main window (a mixin of ``MainWindow``): the cache trace as JSON or CSV, the panels
as PNG files, the chat as Markdown. Every failure to write becomes a message, never an exception."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog


class ExportActions:
    """Export slots; they use the window's ``trace``, ``panels``, ``history``, ``conversation``, ``info``,
    ``chat_id``, ``show_error`` and status bar."""

    def _export_trace(self, kind: str) -> None:
        if not len(self.trace):
            self.show_error("No cache trace yet: send a message first.")
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export cache trace", f"kvscope-trace.{kind}",
                                              "JSON (*.json)" if kind == "json" else "CSV (*.csv)")
        if path:
            try:
                self.trace.write_json(path) if kind == "json" else self.trace.write_csv(path)
                self.statusBar().showMessage(f"wrote {path}", 4000)
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc}")

    def export_panels(self, folder: str | Path) -> list[Path]:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        out = []
        for panel in self.panels:
            path = folder / f"{panel.objectName().lower().replace('panel', '')}.png"
            if panel.export_png(str(path)):
                out.append(path)
        return out

    def _export_pngs(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Export panels as PNG into…")
        if folder:
            try:
                paths = self.export_panels(folder)
                self.statusBar().showMessage(f"wrote {len(paths)} PNG files to {folder}", 4000)
            except OSError as exc:
                self.show_error(f"Could not write PNGs: {exc}")

    def export_chat_markdown(self, path: str | Path) -> Path:
        """Write the open chat as Markdown (messages, and each reply's stats and cache line)."""
        from app.chat_export import chat_markdown

        self.conversation.flush()  # what streamed so far is in history
        chat = self.history.chat(self.chat_id) if self.chat_id is not None else None
        if chat is None:
            raise ValueError("no chat is open")
        path = Path(path)
        model = self.info.name if self.info is not None else ""
        path.write_text(chat_markdown(chat, self.history.messages(chat.id), model), encoding="utf-8")
        return path

    def _export_chat(self) -> None:
        if self.chat_id is None or not self.history.messages(self.chat_id):
            self.show_error("Nothing to export yet: this chat has no messages.")
            return
        title = (self.history.chat(self.chat_id).title or "chat").strip()
        safe = "".join(c if c.isalnum() or c in " -_" else "_" for c in title)[:60].strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat as Markdown", f"{safe}.md", "Markdown (*.md)")
        if path:
            try:
                self.export_chat_markdown(path)
                self.statusBar().showMessage(f"wrote {path}", 4000)
            except OSError as exc:
                self.show_error(f"Could not write {path}: {exc}")
