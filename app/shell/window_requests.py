"""What callers ask of the main window (``app.shell.window.MainWindow``, which takes these methods from
``WindowRequests``): the menus, the self-test, the benchmarks and the tests. Each request is handed to the part that
does it (the window's ``models``, ``on_screen``, ``conversation``, ``cache``, ``scheduler``, ``exporter``, ...):
nothing here keeps state of its own.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QMessageBox

from app.compare.dialog import open_compare
from app.shell import help as app_help
from engine.config import CacheConfig, ModelSpec


class WindowRequests:
    """The main window's requests (a base of ``MainWindow``, before ``QMainWindow``: its names win, as when they were
    the window's own). Reads the parts ``MainWindow`` builds."""

    def start(self) -> None:
        """Begin loading the model (call after the window is shown: torch loads on the worker)."""
        self.models.start(self.model_source)

    def load_model(self, spec: ModelSpec) -> None:
        self.models.load(spec)

    def send(self, text: str) -> None:
        self.on_screen.send(text)

    def stop(self) -> None:
        self.on_screen.stop()

    def new_chat(self) -> None:
        self.conversation.new_chat()

    def open_chat(self, chat_id: int) -> None:
        self.conversation.open_chat(chat_id)

    def apply_cache_config(self, cfg: CacheConfig) -> None:
        """``cfg`` for the chat on screen, as chosen (Compare, the self-test, tests): nothing asked first."""
        self.cache.apply(cfg, confirmed=True)

    def set_fast_step(self, on: bool) -> None:
        """Tools ▸ Compiled decode step: compile the model's decode step in the background and use it where it
        measures faster (on), or always run eager (off)."""
        self.settings.set("engine/fast_step", bool(on))
        self.engine.set_fast_step("auto" if on else "off")

    def set_panels_enabled(self, on: bool) -> None:
        self.scheduler.set_enabled(on)
        self.settings.set("panels/enabled", bool(on))

    def export_panels(self, folder) -> list:
        return self.exporter.export_panels(folder)

    def export_chat_markdown(self, path):
        return self.exporter.export_chat_markdown(path)

    def open_compare(self) -> Any:
        """Generate this chat's next reply once per cache setting, side by side, in a non-modal dialog."""
        self._compare_dialog = open_compare(
            self, self.engine, self._compare_dialog, self.info is not None and not self.models.loading,
            self.conversation.engine_messages(), lambda: self.sampling_override or self.sampling.sampling(),
            self.show_error)
        return self._compare_dialog

    def show_help(self) -> None:
        app_help.show_all_help(self)

    def show_shortcuts(self) -> None:
        app_help.show_shortcuts(self)

    def about(self) -> None:
        QMessageBox.about(self, "About KV Scope",
                          "<b>KV Scope</b><br>Chat with a local model and watch its KV cache work: per-layer "
                          "occupancy, the page map, per-token timing and memory, with cache policies you can "
                          "change while it talks.")

    def show_error(self, message: str, notice: bool = True, actions=()) -> None:
        """Every failure ends here: the status bar, and (``notice``) the message area above the transcript, with
        a button per (label, action) in ``actions``, kept there until the user dismisses it. Nothing here is saved;
        a reply's own failure is shown and saved with the reply."""
        if notice:
            self.chat.notice.add_problem(message, actions)
        self.status.message(message.splitlines()[0], 8000)
        self.error_shown.emit(message)
