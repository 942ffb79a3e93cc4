"""The status bar in words: model, device, cache settings, context used, decode speed, load progress.

Fields are ``WordLabel``s: when the bar is narrow they drop whole words and end in "…" (the full text is
in the tooltip), so nothing is ever cut mid-word; the context field keeps its full width because it is the
one that warns.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtWidgets import QProgressBar, QStatusBar, QToolButton

from app.ground.format import human_bytes
from app.ground.glossary import OVERFLOWS, describe_cache
from app.ground.widgets import WordLabel
from engine.config import CacheConfig
from engine.snapshot import TOKEN_NOT_CACHED

CONTEXT_FILLING, CONTEXT_FULL = "#ffb347", "#ff6b6b"  # the context field from 75% and from 90% used
KEEPS_MODEL_PX, KEEPS_DEVICE_PX = 180, 120  # the most of their text's width these fields keep when the bar is narrow
LOCAL_FIELDS = ("model", "device", "cache", "context", "speed", "disk")  # what a remote chat on screen describes


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
        self.wait = WordLabel("")  # what the reply waits for, while it waits (app.chat.reply_wait)
        self.disk = WordLabel("")  # "KV on disk 12.3 MiB": the KV disk tier's size (app.controls.disk_dialog)
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
        # The model's name and its device keep their words up to these widths: at 1024 px a context field with its
        # dropped tokens ("· chat 435 (174 dropped)", ~150 px more) squeezed them to "Model…" and "on…", while
        # the cache settings, the longest field, are the ones to give way.
        self.model.keeps_px, self.device.keeps_px = KEEPS_MODEL_PX, KEEPS_DEVICE_PX
        self.set_loading(False)
        self.server.setVisible(False)
        self.wait.setStyleSheet(f"color: {CONTEXT_FILLING}")
        self.wait.setVisible(False)
        self.disk.setVisible(False)
        self._local: dict[str, dict] | None = None  # while a remote chat is shown: the local fields to give back

    def watch(self, screen) -> None:
        """Show what the screen's record (``app.ground.screen.Screen``) says of the chat on screen: its context, the
        cache setting it runs under, its decode speed, and what the engine just said of it."""
        screen.connect("context", self._on_context)
        screen.connect("shown_settings", lambda cfg: cfg is not None and self.show_cache(cfg))
        screen.connect("speed", self.show_speed)
        screen.connect("said", lambda notes: notes and self.message("; ".join(notes), 6000))

    def _on_context(self, c) -> None:
        if c is None:
            self._set("context", text="Context: —", style="", level="", tip="")
        else:
            self.show_context(c.used, c.total, c.overflow, c.chat)

    def message(self, text: str, ms: int = 0) -> None:
        self.bar.showMessage(text, ms)

    def set_loading(self, on: bool, source: str = "") -> None:
        self.progress.setVisible(on)
        self.cancel.setVisible(on)
        if on:
            self.progress.setRange(0, 0)
            self._set("model", text=f"Loading {source}…")

    def set_progress(self, fraction: float) -> None:
        if fraction >= 0:
            self.progress.setRange(0, 100)
            self.progress.setValue(int(fraction * 100))

    def show_model(self, name: str, source: str = "", device: str = "", reason: str = "") -> None:
        self._set("model", text=f"Model: {name}", tip=source)
        if device:
            self._set("device", text=f"on {device.upper() if device in ('cpu', 'mps') else device}"
                                     f"{fallback_note(reason)}", tip=reason)

    def show_no_model(self) -> None:
        """'No model': none could be loaded."""
        self._set("model", text="No model")

    def show_cache(self, cfg: CacheConfig) -> None:
        self._set("cache", text=describe_cache(cfg), tip="Cache settings (Cache policy panel): " + describe_cache(cfg))

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
        self._set("disk", text=f"KV on disk {human_bytes(nbytes)}" if nbytes >= 0 else "",
                  tip=f"KV disk cache in {folder}: a chat reopened after a restart is restored from these pages. "
                      "Only full pages of chats at the model's own K/V precision and with no eviction are written "
                      "(the prefix cache's pages): a chat with quantized keys or values or an eviction policy adds "
                      "nothing here and is read again when reopened (Settings ▸ KV disk cache)"
                  if nbytes >= 0 else "", visible=nbytes >= 0)

    def show_speed(self, tokens_per_s: float) -> None:
        self._set("speed", text=f"{tokens_per_s:.1f} tokens/s" if tokens_per_s else "",
                  tip="Decode speed of the last reply")

    def show_context(self, used: int, total: int, overflow: str, chat: int = 0) -> None:
        """'Context: used of total tokens' (``context_counts``), and the chat's tokens when some were dropped;
        amber from 75% and red from 90%; the tooltip defines each number and says what happens when it is full."""
        frac = used / total if total else 0.0
        colour = CONTEXT_FULL if frac >= 0.9 else CONTEXT_FILLING if frac >= 0.75 else ""
        text = f"Context: {used:,} of {total:,} tokens" if total else "Context: —"
        dropped = max(chat - used, 0)
        when_full = OVERFLOWS[overflow].tip.splitlines()[0] if overflow in OVERFLOWS else overflow
        self._set(
            "context", text=text + (f" · chat {chat:,} ({dropped:,} dropped)" if dropped else ""),
            style=f"color: {colour}" if colour else "",
            level="full" if colour == CONTEXT_FULL else "filling" if colour else "",
            tip=f"Context used: {used:,} of the model's {total:,} positions ({100 * frac:.0f}%) — the tokens cached "
            "(as many as the fullest layer holds, the Layer occupancy panel's 'tokens cached') plus the one just "
            "generated, which the next step reads.\n"
            f"Tokens in the chat: {max(chat, used):,} — every token so far; those a policy or the context limit "
            f"dropped ({dropped:,}) are no longer read.\n"
            f"{when_full} (Cache policy ▸ When the context is full). Every dropped token shows in the page map "
            "and the occupancy panel.")

    # -- a remote chat on screen --------------------------------------------------------------------------
    @property
    def remote(self) -> bool:
        """A remote chat is described (``show_remote``) until ``show_local``."""
        return self._local is not None

    def show_remote(self, fields: dict[str, tuple[str, str]]) -> None:
        """Describe the remote chat on screen: ``fields`` maps each of ``LOCAL_FIELDS`` to (text, tooltip); one
        left out, or with no text, is hidden. The first call keeps the local fields' texts, tooltips, colours and
        visibility; local news that comes meanwhile (a load, a reply of a chat off screen) updates what was kept,
        so ``show_local`` gives back what the local chat would show by then."""
        if self._local is None:
            self._local = {name: _state(getattr(self, name)) for name in LOCAL_FIELDS}
        for name in LOCAL_FIELDS:
            text, tip = fields.get(name, ("", ""))
            _apply(getattr(self, name), {"text": text, "tip": tip, "style": "", "level": "", "visible": bool(text)})

    def show_local(self) -> None:
        """The local chat (or API conversation) is back on screen: the fields as ``show_remote`` kept them."""
        if self._local is None:
            return
        kept, self._local = self._local, None
        for name, state in kept.items():
            _apply(getattr(self, name), state)

    def _set(self, name: str, **state) -> None:
        """Set a local field (``_apply``'s keys) — or, while a remote chat is described, what ``show_local`` will
        give back: the remote chat's words stay on screen."""
        if self._local is not None:
            self._local[name].update(state)
        else:
            _apply(getattr(self, name), state)


def _state(label: WordLabel) -> dict:
    """What ``show_remote`` keeps of a field: its text, tooltip set on purpose, colour, warning level, visibility."""
    return {"text": label.text(), "tip": label.explicit_tip, "style": label.styleSheet(),
            "level": getattr(label, "level", ""), "visible": not label.isHidden()}


def _apply(label: WordLabel, state: dict) -> None:
    """Set what ``state`` names of a field; what is already so is left alone (a remote chat's fields are set at
    every redraw, and a style sheet set again re-polishes the label)."""
    if "text" in state and label.text() != state["text"]:
        label.setText(state["text"])
        keeps = getattr(label, "keeps_px", 0)
        if keeps:
            label.setMinimumWidth(min(label.sizeHint().width(), keeps))  # the whole text and the theme's padding
    if "tip" in state and label.explicit_tip != state["tip"]:
        label.set_tip(state["tip"])
    if "style" in state and label.styleSheet() != state["style"]:
        label.setStyleSheet(state["style"])
    if "level" in state:
        label.level = state["level"]
    if "visible" in state and label.isHidden() == state["visible"]:
        label.setVisible(state["visible"])


def context_counts(snap) -> tuple[int, int]:
    """(context used, tokens in the chat) of one snapshot, the definitions every readout shares: used = the tokens
    cached (the fullest layer's count, as Layer occupancy says) plus the one just generated and not yet fed; the
    chat = every token so far, dropped ones included. A model whose every layer keeps a fixed state (no tokens
    cached) uses its whole chat."""
    held = max((int(x) for x in snap.tokens_per_layer), default=0)
    chat = int(snap.seq_len)
    if snap.mode == "off":  # nothing cached: every step reads the whole chat (it said "chat 512 (511 dropped)")
        return chat, chat
    if held == 0 and snap.layer_kinds and all("state" in k for k in snap.layer_kinds):
        return chat, chat
    pending = 1 if chat - held - int(snap.evicted_total) >= 1 else 0
    return min(held + pending, chat), chat


def evicted_counts(snap) -> tuple[int, int]:
    """(evicted from the fullest layer, evicted from every layer) of one snapshot: the chat's fed tokens the layer
    holding most no longer holds — the status bar's "dropped" less the token just generated — and those no layer
    holds (the token strip's red, ``evicted_total``). They differ where each layer evicts its own tokens (H2O scores
    each layer's attention): Layer occupancy said "118 evicted" beside the status bar's "176 dropped"."""
    held = max((int(x) for x in snap.tokens_per_layer), default=0)
    everywhere = int(snap.evicted_total)
    if snap.mode == "off" or (held == 0 and snap.layer_kinds and all("state" in k for k in snap.layer_kinds)):
        return everywhere, everywhere  # nothing cached, or fixed states only: no layer's count to go by
    waiting = int(np.count_nonzero(np.asarray(snap.token_state) == TOKEN_NOT_CACHED))  # not fed yet
    return max(int(snap.seq_len) - held - waiting, everywhere), everywhere


def fallback_note(reason: str) -> str:
    """" — <why>" when the model runs on the CPU although a GPU was meant to be there (a CUDA build without the
    NVIDIA driver, ...): in view, not only in the tooltip. Nothing for a machine that simply has no GPU."""
    if not reason.startswith("CPU: ") or reason in ("CPU: chosen", "CPU: no CUDA or MPS device"):
        return ""
    return " — " + reason[5:].split(" (")[0]
