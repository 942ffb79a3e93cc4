"""Loading models: the start-up load, File ▸ Models, Open folder, Recent models, Cancel in the status bar, and
what a failed load leaves behind (the model loaded before, or at first launch the built-in stories260K, then the
random-weight demo).

The controller owns the load's state (``info``, ``loading``) and the status bar's model fields; what a
loaded model means for the rest of the window (panels, chat pane, title) is the window's ``loaded`` slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QFileDialog, QMenu, QWidget

from app.settings.cache_settings import model_spec, weights_choice
from app.ground.failure import Failure
from app.settings.store import Settings
from app.ground.status_bar import StatusBar
from app.link.engine_thread import EngineThread
from engine.model.builtin import BUILTIN_LABEL, BUILTIN_MODEL, DEMO_LABEL, is_builtin
from engine.config import CacheConfig, ModelSpec
from engine.snapshot import ModelInfo


class ModelController(QObject):
    """``loaded(ModelInfo)`` after a load; ``ready_changed(ready, hint)`` whenever a chat can (or cannot)
    be had, with the chat pane's hint; load failures go to ``show_error``."""

    loaded = Signal(object)
    ready_changed = Signal(bool, str)

    def __init__(self, window: QWidget, engine: EngineThread, settings: Settings, status: StatusBar,
                 cache: Callable[[], CacheConfig], show_error: Callable[[str], None]) -> None:
        super().__init__(window)
        self.window = window
        self.engine = engine
        self.settings = settings
        self.status = status
        self._cache = cache
        self._show_error = show_error
        self.info: ModelInfo | None = None
        self.loading = False
        self.spec: ModelSpec | None = None
        self.fallback = False  # the load in progress stands in for one that failed: not the user's choice
        self.environment: dict = {}
        w = engine.worker
        w.progress.connect(self._on_progress)
        w.loaded.connect(self._on_loaded)
        w.environment.connect(lambda env: setattr(self, "environment", dict(env or {})))
        status.cancel_requested.connect(self.cancel)

    def start(self, source: str) -> None:
        """Begin loading ``source`` (call after the window is shown: torch loads on the worker)."""
        self.load(model_spec(self.settings, source))

    def load(self, spec: ModelSpec, fallback: bool = False) -> None:
        """Load ``spec`` on the worker; ``fallback``: it stands in for a load that failed, so it is not remembered
        as the last model."""
        self.loading = True
        self.fallback = fallback
        self.spec = spec
        self.ready_changed.emit(False, f"Loading {spec.source}…")
        self.status.set_loading(True, Path(spec.source).name or spec.source)
        self.engine.load(spec, self._cache())

    def cancel(self) -> None:
        """Stop the model load in progress; the chat goes on with the model loaded before (or the built-in one)."""
        if self.loading:
            self.status.message("Cancelling the load…")
            self.engine.cancel_load()

    def _on_progress(self, message: str, fraction: float) -> None:
        self.status.message(message)
        self.status.set_progress(fraction)

    def _on_loaded(self, info: ModelInfo) -> None:
        self.loading = False
        self.info = info
        self.status.set_loading(False)
        self.status.message(f"{info.name} is ready", 4000)
        self.status.show_model(info.name, info.source, info.device, info.device_reason)
        if not self.fallback:  # the last model chosen (the demo too, as --help says); a stand-in is not chosen
            self.settings.set("model/last", info.source)
            if not info.is_demo and not is_builtin(info.source):  # both built-in models have their own menu lines
                self.settings.add_recent_model(info.source)
        self.loaded.emit(info)
        self.ready_changed.emit(True, ready_hint(info))

    def on_failed(self, failure: Failure) -> None:
        """A load failed or was cancelled: the model loaded before stays; at first launch the built-in stories260K
        opens (and if even that fails, the random-weight demo, which needs no files)."""
        self.loading = False
        self.status.set_loading(False)
        if self.info is None and self.spec is not None and self.spec.source != "demo":
            fallback = "demo" if is_builtin(self.spec.source) else BUILTIN_MODEL
            label = DEMO_LABEL if fallback == "demo" else BUILTIN_LABEL
            self._show_error(f"{failure.message}\nOpening {label} instead.")
            self.load(model_spec(self.settings, fallback), fallback=True)
            return
        self._show_error(failure.message)
        if self.info is not None:
            self.status.show_model(self.info.name, self.info.source)
            self.ready_changed.emit(True, ready_hint(self.info))  # the chat goes on with it
        else:
            self.status.show_no_model()
            self.ready_changed.emit(False, "No model could be loaded. Open one from File ▸ Models…")

    # -- menus and dialogs ------------------------------------------------------------------------------
    def open_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self.window, "Open a model folder")
        if folder:
            self.load(model_spec(self.settings, folder))

    def fill_recent_menu(self, menu: QMenu) -> None:
        menu.clear()
        menu.addAction(BUILTIN_LABEL, lambda: self.load(model_spec(self.settings, BUILTIN_MODEL)))
        menu.addAction(DEMO_LABEL, lambda: self.load(model_spec(self.settings, "demo")))
        for source in self.settings.get("model/recent"):
            menu.addAction(source, lambda s=source: self.load(model_spec(self.settings, s)))

    def open_models_dialog(self) -> None:
        from app.models.dialog import ModelsDialog

        dlg = ModelsDialog(self.settings, environment=self.environment, current=self.info, parent=self.window)
        spec_controls = getattr(self.window, "spec_controls", None)
        if spec_controls is not None:  # "Use as draft model": speculative decoding's choice, as its own button
            dlg.draft_chosen.connect(spec_controls.choose_draft)
        if dlg.exec() and dlg.spec is not None:
            self.settings.set("model/quantization", weights_choice(dlg.spec))
            self.settings.set("model/device", dlg.spec.device)
            self.load(dlg.spec)


def ready_hint(info: ModelInfo) -> str:
    """The chat pane's hint once ``info`` is loaded: what the built-in models can and cannot do."""
    if info.is_demo:
        return ("This is the demo model: random weights, so the text is gibberish, but every cache mode, page and "
                "timing is real. The built-in stories260K writes real text; bigger models: File ▸ Models…")
    if is_builtin(info.source):
        return ("This is stories260K, the built-in model: 260 thousand parameters trained on children's stories. "
                "Start a story (\"Once upon a time\") and watch the cache fill. Bigger models: File ▸ Models…")
    return f"{info.name} is ready. Say something."
