"""Loading models for the main window (a mixin of ``MainWindow``): start-up load, File ▸ Models, Open folder,
Recent models, Cancel in the status bar, and what a load failure leaves behind (the model loaded before,
or the built-in demo at first launch)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog

from app.failure import Failure
from engine.config import ModelSpec
from engine.snapshot import ModelInfo


class ModelActions:
    """Model slots; they use the window's ``engine``, ``settings``, ``chat``, ``conversation``, status fields
    and panels."""

    def start(self) -> None:
        """Begin loading the model (call after the window is shown: torch loads on the worker)."""
        self.load_model(ModelSpec(source=self.model_source, quantization=self.settings.get("model/quantization"),
                                  device=self.settings.get("model/device")) if self.model_source != "demo"
                        else ModelSpec(source="demo", device=self.settings.get("model/device")))

    def load_model(self, spec: ModelSpec) -> None:
        if self.generation_id:
            self.stop()
        self._loading = True
        self._loading_spec = spec
        self.chat.set_ready(False, f"Loading {spec.source}…")
        self.load_progress.setRange(0, 0)
        self._show_loading(True)
        self.status_model.setText(f"loading {Path(spec.source).name or spec.source}…")
        self.engine.load(spec, self._applied_cache)

    def cancel_load(self) -> None:
        """Stop the model load in progress; the chat goes on with the model loaded before (or the demo)."""
        if self._loading:
            self.statusBar().showMessage("cancelling the load…")
            self.engine.cancel_load()

    def _show_loading(self, on: bool) -> None:
        self.load_progress.setVisible(on)
        self.load_cancel.setVisible(on)

    def _on_progress(self, message: str, fraction: float) -> None:
        self.statusBar().showMessage(message)
        if fraction >= 0:
            self.load_progress.setRange(0, 100)
            self.load_progress.setValue(int(fraction * 100))

    def _on_environment(self, env: dict) -> None:
        self.environment = dict(env or {})

    def _on_loaded(self, info: ModelInfo) -> None:
        self._loading = False
        self.info = info
        self._show_loading(False)
        self.statusBar().showMessage(f"{info.name} ready", 4000)
        self.status_model.setText(f"<b>{info.name}</b>")
        self.status_model.setToolTip(info.source)
        self.status_device.setText(f"{info.device} · {info.device_reason}")
        self.model_card.show_model(info)
        self.memory.clear()
        self.timing.clear()
        if not info.is_demo:
            self.settings.set("model/last", info.source)
            self.settings.add_recent_model(info.source)
        hint = ("This is the built-in demo model: random weights, so the text is gibberish, but every cache "
                "mode, page and timing is real. Open a real model from File ▸ Models…"
                if info.is_demo else f"{info.name} is ready. Say something.")
        self.conversation.ready = True
        self.chat.set_ready(True, hint)
        self.setWindowTitle(f"KV Scope — {info.name}")
        self.model_loaded.emit(info)

    def _open_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a model folder")
        if folder:
            self.load_model(ModelSpec(source=folder, quantization=self.settings.get("model/quantization"),
                                      device=self.settings.get("model/device")))

    def _fill_recent_menu(self) -> None:
        self.recent_menu.clear()
        self.recent_menu.addAction("demo (built-in, random weights)", lambda: self.load_model(ModelSpec(source="demo")))
        for source in self.settings.get("model/recent"):
            self.recent_menu.addAction(source, lambda s=source: self.load_model(
                ModelSpec(source=s, quantization=self.settings.get("model/quantization"),
                          device=self.settings.get("model/device"))))

    def open_models_dialog(self) -> None:
        from app.models_dialog import ModelsDialog

        dlg = ModelsDialog(self.settings, environment=self.environment, current=self.info, parent=self)
        if dlg.exec() and dlg.spec is not None:
            self.settings.set("model/quantization", dlg.spec.quantization)
            self.settings.set("model/device", dlg.spec.device)
            self.load_model(dlg.spec)


    def _on_load_failed(self, failure: Failure) -> None:
        """A load failed or was cancelled: the model loaded before stays; at first launch the demo opens."""
        self._loading = False
        self._show_loading(False)
        spec = getattr(self, "_loading_spec", None)
        if self.info is None and spec is not None and spec.source != "demo":
            self.show_error(f"{failure.message}\nOpening the built-in demo model instead.")
            self.load_model(ModelSpec(source="demo"))
            return
        self.show_error(failure.message)
        if self.info is not None:
            self.chat.set_ready(True)
            self.status_model.setText(f"<b>{self.info.name}</b>")
        else:
            self.chat.set_ready(False, "No model could be loaded. Open one from File ▸ Models…")
