"""The status bar in words: model, device, cache settings, context used, decode speed, load progress.

Fields are ``WordLabel``s: when the bar is narrow they drop whole words and end in "…" (the full text is
in the tooltip), so nothing is ever cut mid-word; the context field keeps its full width because it is the
one that warns.
"""

from __future__ import annotations

from PySide6.QtWidgets import QProgressBar, QStatusBar, QToolButton

from app.format import human_bytes
from app.glossary import OVERFLOWS, describe_cache
from app.widgets import WordLabel
from engine.config import CacheConfig

CONTEXT_FILLING, CONTEXT_FULL = "#ffb347", "#ff6b6b"  # the context field from 75% and from 90% used


class StatusBar:
    """Owns the fields of the window's ``QStatusBar``; ``cancel_requested`` is the Cancel button's signal."""

    def __init__(self, bar: QStatusBar) -> None:
        self.bar = bar
        self.model = WordLabel("No model yet")
        self.device = WordLabel("")
        self.cache = WordLabel("")
        self.context = WordLabel("Context: —")
        self.speed = WordLabel("")
        self.server = WordLabel("")  # "Serving at URL" while Server ▸ Start serving runs
        self.wait = WordLabel("")  # what the reply waits for, while it waits (app.reply_wait)
        self.disk = WordLabel("")  # "KV on disk 12.3 MiB": the KV disk tier's size (app.disk_dialog)
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(160)
        self.progress.setTextVisible(False)
        self.cancel = QToolButton()
        self.cancel.setText("Cancel")
        self.cancel.setToolTip("Stop loading this model (the model loaded before stays in use)")
        self.cancel_requested = self.cancel.clicked
        # Permanent widgets: a normal status-bar widget is hidden while a message shows, and every progress
        # step of a load is a message. Stretch: the model and cache fields give way first.
        bar.addPermanentWidget(self.progress)
        bar.addPermanentWidget(self.cancel)
        for field, stretch in ((self.server, 0), (self.wait, 4), (self.model, 2), (self.device, 1), (self.cache, 4),
                               (self.context, 0), (self.speed, 0), (self.disk, 0)):
            field.setObjectName("statusField")
            bar.addPermanentWidget(field, stretch)
        self.context.setMinimumWidth(self.context.fontMetrics().horizontalAdvance("Context: 99,999 of 99,999 tokens"))
        self.set_loading(False)
        self.server.setVisible(False)
        self.wait.setStyleSheet(f"color: {CONTEXT_FILLING}")
        self.wait.setVisible(False)
        self.disk.setVisible(False)

    def message(self, text: str, ms: int = 0) -> None:
        self.bar.showMessage(text, ms)

    def set_loading(self, on: bool, source: str = "") -> None:
        self.progress.setVisible(on)
        self.cancel.setVisible(on)
        if on:
            self.progress.setRange(0, 0)
            self.model.setText(f"Loading {source}…")

    def set_progress(self, fraction: float) -> None:
        if fraction >= 0:
            self.progress.setRange(0, 100)
            self.progress.setValue(int(fraction * 100))

    def show_model(self, name: str, source: str = "", device: str = "", reason: str = "") -> None:
        self.model.setText(f"Model: {name}")
        self.model.set_tip(source)
        if device:
            self.device.setText(f"on {device.upper() if device in ('cpu', 'mps') else device}{fallback_note(reason)}")
            self.device.set_tip(reason)

    def show_cache(self, cfg: CacheConfig) -> None:
        self.cache.setText(describe_cache(cfg))
        self.cache.set_tip("Cache settings (Cache policy panel): " + describe_cache(cfg))

    def show_server(self, url: str, model_id: str = "") -> None:
        """'Serving at URL' while the server runs ("" hides it)."""
        self.server.setText(f"Serving at {url}" if url else "")
        self.server.set_tip(f"OpenAI API at {url} (model “{model_id}”); Server ▸ Stop serving ends it" if url else "")
        self.server.setVisible(bool(url))

    def show_wait(self, text: str) -> None:
        """What the reply waits for and for how long ("" hides it). A field of its own: a status message would
        be drawn in no room at all, the permanent fields fill the bar."""
        self.wait.setText(text)
        self.wait.setVisible(bool(text))

    def show_disk(self, nbytes: int, folder: str = "") -> None:
        """'KV on disk 12.3 MiB' (negative: the tier is off, the field hidden)."""
        self.disk.setText(f"KV on disk {human_bytes(nbytes)}" if nbytes >= 0 else "")
        self.disk.set_tip(f"KV disk cache in {folder}: a chat reopened after a restart is restored from these pages "
                          "(Settings ▸ KV disk cache)" if nbytes >= 0 else "")
        self.disk.setVisible(nbytes >= 0)

    def show_speed(self, tokens_per_s: float) -> None:
        self.speed.setText(f"{tokens_per_s:.1f} tokens/s" if tokens_per_s else "")
        self.speed.set_tip("Decode speed of the last reply")

    def show_context(self, used: int, total: int, overflow: str, chat: int = 0) -> None:
        """'Context: used of total tokens' (``context_counts``), and the chat's tokens when some were dropped;
        amber from 75% and red from 90%; the tooltip defines each number and says what happens when it is full."""
        frac = used / total if total else 0.0
        colour = CONTEXT_FULL if frac >= 0.9 else CONTEXT_FILLING if frac >= 0.75 else ""
        text = f"Context: {used:,} of {total:,} tokens" if total else "Context: —"
        dropped = max(chat - used, 0)
        self.context.setText(text + (f" · chat {chat:,} ({dropped:,} dropped)" if dropped else ""))
        self.context.setStyleSheet(f"color: {colour}" if colour else "")
        self.context.level = "full" if colour == CONTEXT_FULL else "filling" if colour else ""
        when_full = OVERFLOWS[overflow].tip.splitlines()[0] if overflow in OVERFLOWS else overflow
        self.context.set_tip(
            f"Context used: {used:,} of the model's {total:,} positions ({100 * frac:.0f}%) — the tokens cached "
            "(as many as the fullest layer holds, the Layer occupancy panel's 'tokens cached') plus the one just "
            "generated, which the next step reads.\n"
            f"Tokens in the chat: {max(chat, used):,} — every token so far; those a policy or the context limit "
            f"dropped ({dropped:,}) are no longer read.\n"
            f"{when_full} (Cache policy ▸ When the context is full). Every dropped token shows in the page map "
            "and the occupancy panel.")


def context_counts(snap) -> tuple[int, int]:
    """(context used, tokens in the chat) of one snapshot, the definitions every readout shares: used = the tokens
    cached (the fullest layer's count, as Layer occupancy says) plus the one just generated and not yet fed; the
    chat = every token so far, dropped ones included. A model whose every layer keeps a fixed state (no tokens
    cached) uses its whole chat."""
    held = max((int(x) for x in snap.tokens_per_layer), default=0)
    chat = int(snap.seq_len)
    if held == 0 and snap.layer_kinds and all("state" in k for k in snap.layer_kinds):
        return chat, chat
    pending = 1 if chat - held - int(snap.evicted_total) >= 1 else 0
    return min(held + pending, chat), chat


def fallback_note(reason: str) -> str:
    """" — <why>" when the model runs on the CPU although a GPU was meant to be there (a CUDA build without the
    NVIDIA driver, ...): in view, not only in the tooltip. Nothing for a machine that simply has no GPU."""
    if not reason.startswith("CPU: ") or reason in ("CPU: chosen", "CPU: no CUDA or MPS device"):
        return ""
    return " — " + reason[5:].split(" (")[0]
