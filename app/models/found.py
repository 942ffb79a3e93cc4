"""The models on this computer for the models dialog: ``engine.model.catalog.scan`` run on a worker thread (it
reads headers of every GGUF in the stores: never on the GUI thread), and each found model in words — the one
place the catalog's types become text."""

from __future__ import annotations

import threading
from typing import Callable

from PySide6.QtCore import QObject, Signal

from app.ground.format import human_bytes
from engine.model.catalog import FoundModel, Store

STORE_WORDS = {Store.HF_CACHE: "HF cache", Store.LM_STUDIO: "LM Studio", Store.OLLAMA: "Ollama",
               Store.FOLDER: "Folder"}
_LIVE: set["_Relay"] = set()  # relays of scans in flight: alive until their answer reached the GUI thread


class _Relay(QObject):
    """Carries one scan's answer from its thread to the GUI thread (a queued signal: it lives in the GUI thread)."""

    found = Signal(object)  # engine.model.catalog.Scan, or a str: why the scan failed


def start_scan(folders: list[str], done: Callable[[object], None]) -> None:
    """Scan the stores and ``folders`` on a daemon thread; ``done(Scan | str)`` runs on the GUI thread.
    A dialog closed meanwhile simply never hears back (its slot is disconnected with it)."""
    from engine.model.catalog import scan

    relay = _Relay()
    relay.found.connect(done)
    relay.found.connect(lambda _: _LIVE.discard(relay))
    _LIVE.add(relay)

    def run() -> None:
        try:
            result: object = scan(folders)
        except Exception as e:  # noqa: BLE001 - a scan that fails says so in the dialog, nothing more
            result = f"Looking for models failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        try:
            relay.found.emit(result)
        except RuntimeError:  # the application is quitting
            pass

    threading.Thread(target=run, name="kvscope-model-scan", daemon=True).start()


def item_text(m: FoundModel) -> str:
    """'LM Studio: lmstudio-community/Qwen2.5-0.5B-GGUF/qwen2.5-0.5b-q8_0.gguf — qwen2 · Q8_0 · 531 MiB on disk · 32,768
    tokens'; a model that cannot be opened ends '— cannot be opened' (the reason is its tooltip and banner)."""
    head = f"{STORE_WORDS[m.store]}: {m.name}"
    if m.problem:
        return f"{head} — cannot be opened"
    facts = [m.architecture, m.weights_type, f"{human_bytes(m.size_bytes)} on disk"]  # the verdict says them held
    if m.context_length:
        facts.append(f"{m.context_length:,} tokens")
    return f"{head} — {' · '.join(f for f in facts if f)}"


def item_tip(m: FoundModel) -> str:
    return f"{m.source}\n{m.problem}" if m.problem else m.source
