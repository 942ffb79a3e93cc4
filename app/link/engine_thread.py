"""``EngineThread``: the GUI's handle on the engine worker and its ``QThread`` (see ``app.link.worker``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from PySide6.QtCore import QObject, QThread, Signal

from app.link.backend import EngineBackend
from app.link.worker import EngineWorker
from engine.config import CacheConfig, ModelSpec, SamplingConfig


class EngineThread(QObject):
    """Owns the QThread and the worker; the GUI talks to the engine only through this object.

    Every command is one queued signal (``call``) carrying the worker method to run, wired before the thread starts.
    ``shutdown()`` stops any reply and joins the thread.
    """

    _call = Signal(object)  # one queued command: a callable run on the worker's thread, in the order sent

    def __init__(self, backend: EngineBackend | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("kvscope-engine")
        self.worker = EngineWorker(backend)
        self.worker.moveToThread(self.thread)
        self._call.connect(self.worker.run_call)
        # the last cache setting sent (None: none since the last refusal): commands run in the order sent, so a
        # reply asked for now runs under it, though the worker has not said ``applied`` yet
        self.sent_cache: CacheConfig | None = None
        self.thread.finished.connect(self.worker.deleteLater)  # deleted on its own thread
        self.thread.start()

    def call(self, slot: Callable[..., Any], *args: Any) -> None:
        """Run ``slot(*args)`` (a worker method) on the worker's thread, queued behind the commands sent before
        it — the one way the GUI thread reaches the worker (as ``EngineCore.call`` is the one way to the core)."""
        self._call.emit(functools.partial(slot, *args))

    # -- the commands, by name (each answered by the worker's signals) ------------------------------------
    def load(self, spec: ModelSpec, cache: CacheConfig | None = None) -> None:
        if cache is not None:
            self.sent_cache = cache
        self.call(self.worker.load, spec, cache)

    def submit(self, generation_id: int, messages: list[dict], sampling: SamplingConfig, chat: Any = None,
               tools: Any = None) -> None:
        """A reply to ``messages`` in ``chat``; ``tools``: a ``ToolUse`` its reply may call (the chat's MCP tools)."""
        self.call(self.worker.submit, generation_id, messages, sampling, chat, tools)

    def forget_chat(self, chat: Any) -> None:
        self.call(self.worker.forget_chat, chat)

    def describe_chat(self, chat: Any, messages: list[dict]) -> None:
        """Ask for the chat's snapshot and token count (answered by ``worker.described``)."""
        self.call(self.worker.describe_chat, chat, messages)

    def measure(self, request: int, messages: list[dict], index: int = -1) -> None:
        """Ask for a token count (answered by ``worker.measured``)."""
        self.call(self.worker.measure, request, messages, index)

    def foresee(self, request: int, messages: list[dict], chat: Any, cache: CacheConfig) -> None:
        """Ask what a reply would read and drop unread to fit the context (answered by ``worker.foreseen``)."""
        self.call(self.worker.foresee, request, messages, chat, cache)

    def cancel(self, generation_id: int = 0) -> None:
        # Set the flag now (thread-safe) so Stop takes effect at the very next step boundary.
        self.worker.request_cancel(generation_id)
        self.call(self.worker.cancel, generation_id)

    def apply_cache_config(self, cache: CacheConfig, chat: Any = None, ask_ms: float | None = None) -> None:
        """``cache`` for ``chat`` (None: the active one); with ``ask_ms``, a change that would read tokens again for
        that long is not applied but answered by ``worker.asked`` (see ``EngineWorker.apply_cache_config``)."""
        self.sent_cache = cache
        self.call(self.worker.apply_cache_config, cache, chat, ask_ms)

    def speculate(self, cfg: Any) -> None:
        """Speculative decoding (a ``SpecConfig``) for every chat; answered by ``worker.speculated`` or ``failed``."""
        self.call(self.worker.speculate, cfg)

    def set_fast_step(self, mode: str) -> None:
        """The compiled decode step: "auto" (compile in the background, keep it where it is faster) or "off"."""
        self.call(self.worker.set_fast_step, mode)

    def compare(self, comparison_id: int, messages: list[dict], sampling: SamplingConfig) -> None:
        """Start comparison ``comparison_id`` (its rows and end carry that id); it replaces one running."""
        self.call(self.worker.compare, comparison_id, messages, sampling)

    def cancel_compare(self, comparison_id: int = 0) -> None:
        """Stop comparison ``comparison_id`` (0: whichever runs) at its next step."""
        self.call(self.worker.cancel_compare, comparison_id)

    def serve(self) -> None:
        """Ask for the model and its engine core, for the API server (answered by ``worker.core_ready``)."""
        self.call(self.worker.serve)

    def configure_disk(self, cfg: Any, folder: str) -> None:
        """The KV disk tier's setting (``app.link.disk_tier.DiskConfig``) at ``folder``; answered by ``worker.disk.changed``."""
        self.call(self.worker.disk.configure, cfg, folder)

    def clear_disk(self) -> None:
        """Delete the KV disk tier's files (answered by ``worker.disk.changed``)."""
        self.call(self.worker.disk.clear)

    def configure_copies(self, cfg: Any) -> None:
        """Quantized copies' setting (``app.link.copies.CopiesConfig``) for the loads sent after it."""
        self.call(self.worker.copies.configure, cfg)

    def measure_copies(self) -> None:
        """Count the quantized copies (answered by ``worker.copies.changed``)."""
        self.call(self.worker.copies.measure)

    def clear_copies(self) -> None:
        """Delete the quantized copies (answered by ``worker.copies.changed``)."""
        self.call(self.worker.copies.clear)

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
        self.call(self.worker.stop)  # queued behind at most one step of the reply and one of a comparison
        return self.thread.wait(timeout_ms)
