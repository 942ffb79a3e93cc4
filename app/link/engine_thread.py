"""``EngineThread``: the GUI's handle on the engine worker and its ``QThread`` (see ``app.link.worker``)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, QThread, Signal

from app.link.backend import EngineBackend
from app.link.worker import EngineWorker
from engine.config import CacheConfig, ModelSpec, SamplingConfig


class EngineThread(QObject):
    """Owns the QThread and the worker; the GUI talks to the engine only through this object.

    Requests are signals connected (queued) to the worker's slots, wired before the thread starts.
    ``shutdown()`` stops any reply and joins the thread.
    """

    _load = Signal(object, object)
    _submit = Signal(int, object, object, object)
    _forget = Signal(object)
    _cancel = Signal(int)
    _apply = Signal(object)
    _speculate = Signal(object)
    _fast = Signal(str)
    _compare = Signal(int, object, object)
    _describe = Signal(object, object)
    _measure = Signal(int, object, int)
    _cancel_compare = Signal(int)
    _stop = Signal()
    _serve = Signal()
    _disk = Signal(object, str)
    _disk_clear = Signal()

    def __init__(self, backend: EngineBackend | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("kvscope-engine")
        self.worker = EngineWorker(backend)
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._submit.connect(self.worker.submit)
        self._cancel.connect(self.worker.cancel)
        self._apply.connect(self.worker.apply_cache_config)
        self._speculate.connect(self.worker.speculate)
        self._fast.connect(self.worker.set_fast_step)
        self._compare.connect(self.worker.compare)
        self._cancel_compare.connect(self.worker.cancel_compare)
        self._stop.connect(self.worker.stop)
        self._forget.connect(self.worker.forget_chat)
        self._describe.connect(self.worker.describe_chat)
        self._measure.connect(self.worker.measure)
        self._serve.connect(self.worker.serve)
        self._disk.connect(self.worker.disk.configure)
        self._disk_clear.connect(self.worker.disk.clear)
        self.thread.finished.connect(self.worker.deleteLater)  # deleted on its own thread
        self.thread.start()

    def load(self, spec: ModelSpec, cache: CacheConfig | None = None) -> None:
        self._load.emit(spec, cache)

    def submit(self, generation_id: int, messages: list[dict], sampling: SamplingConfig, chat: Any = None) -> None:
        self._submit.emit(generation_id, messages, sampling, chat)

    def forget_chat(self, chat: Any) -> None:
        self._forget.emit(chat)

    def describe_chat(self, chat: Any, messages: list[dict]) -> None:
        """Ask for the chat's snapshot and token count (answered by ``worker.described``)."""
        self._describe.emit(chat, messages)

    def measure(self, request: int, messages: list[dict], index: int = -1) -> None:
        """Ask for a token count (answered by ``worker.measured``)."""
        self._measure.emit(request, messages, index)

    def cancel(self, generation_id: int = 0) -> None:
        # Set the flag now (thread-safe) so Stop takes effect at the very next step boundary.
        self.worker.request_cancel(generation_id)
        self._cancel.emit(generation_id)

    def apply_cache_config(self, cache: CacheConfig) -> None:
        self._apply.emit(cache)

    def speculate(self, cfg: Any) -> None:
        """Speculative decoding (a ``SpecConfig``) for every chat; answered by ``worker.speculated`` or ``failed``."""
        self._speculate.emit(cfg)

    def set_fast_step(self, mode: str) -> None:
        """The compiled decode step: "auto" (compile in the background, keep it where it is faster) or "off"."""
        self._fast.emit(mode)

    def compare(self, comparison_id: int, messages: list[dict], sampling: SamplingConfig) -> None:
        """Start comparison ``comparison_id`` (its rows and end carry that id); it replaces one running."""
        self._compare.emit(comparison_id, messages, sampling)

    def cancel_compare(self, comparison_id: int = 0) -> None:
        """Stop comparison ``comparison_id`` (0: whichever runs) at its next step."""
        self._cancel_compare.emit(comparison_id)

    def serve(self) -> None:
        """Ask for the model and its engine core, for the API server (answered by ``worker.core_ready``)."""
        self._serve.emit()

    def configure_disk(self, cfg: Any, folder: str) -> None:
        """The KV disk tier's setting (``app.controls.disk_tier.DiskConfig``) at ``folder``; answered by ``worker.disk.changed``."""
        self._disk.emit(cfg, folder)

    def clear_disk(self) -> None:
        """Delete the KV disk tier's files (answered by ``worker.disk.changed``)."""
        self._disk_clear.emit()

    def cancel_load(self) -> None:
        """Stop a model load in progress (thread-safe, takes effect at its next stage or tensor). The model
        loaded before, if any, stays in use."""
        self.worker.load_cancel.set()

    def shutdown(self, timeout_ms: int = 2000) -> bool:
        """Cancel any reply, stop the thread's loop and join it. True if the thread ended in time."""
        if not self.thread.isRunning():
            return True
        self.worker.request_cancel()
        self.worker.load_cancel.set()  # a load in progress ends at its next tensor, not after the whole model
        self._stop.emit()  # queued behind at most one step of the reply and one of a comparison
        return self.thread.wait(timeout_ms)
