"""Fidelity on the user's chat, in the window: the Memory panel's "Check fidelity" button, its result line, the
worst tokens tinted in the transcript, and the Compare dialog's grid of every precision × policy (its plot).

``FidelityController`` (GUI thread) sends the chat on screen to the worker's ``FidelityControl`` and takes its
answers (tagged with the check's id): progress and the result for the Memory panel, the rows for whoever listens
(``rows_changed``: the Compare dialog's plot), and when the check ends the worst tokens of the user's setting
placed in the bubbles (engine message index → the bubble at that stored position).
"""

from __future__ import annotations

import itertools
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.link.fidelity_task import LABEL_SUFFIX
from app.controls.lossy import Measured

_ids = itertools.count(1)
WORTH_A_TINT = 5e-4  # nats: a token whose KL rounds to 0.000 (and whose top token agrees) is not tinted


def summary(report: dict[str, Any]) -> str:
    """'int4 (your setting) on the last turn (129 tokens): KL 0.0055 · top-1 98.4% · perplexity ×1.021 · 0.6 s'."""
    s = report.get("setting")
    if not s:
        return "Fidelity: nothing was measured."
    if s.get("error"):
        return f"Fidelity of {s['label']}: {s['error']}"
    where = "the last turn" if report.get("scope") == "last-turn" else "the chat"
    dropped = report.get("dropped_tokens", 0)
    cut = f" (its first {dropped:,} tokens left out: the context)" if dropped else ""
    ref = report.get("reference") or {}
    secs = ref.get("seconds", 0.0) + s.get("seconds", 0.0)  # this check's own time (a grid's other rows apart)
    return (f"Fidelity of {s['label']} on {where} ({s['tokens']:,} tokens){cut}: KL {s['mean_kl']:.4f} nats/token · "
            f"top-1 {100 * s['top1_agreement']:.1f}% · perplexity ×{s['perplexity_ratio']:.3f} · "
            f"checked in {secs:.1f} s")


def engine_positions(conversation) -> list[int | None]:
    """For each message of ``conversation.engine_messages()``: the stored position of its bubble (None: the
    system prompt, which has no bubble)."""
    chat_id = conversation.chat_id
    chat = conversation.history.chat(chat_id) if chat_id is not None else None
    if chat is None:
        return []
    out: list[int | None] = [None] if chat.system_prompt.strip() else []
    for m in conversation.history.messages(chat_id):
        if m.role == "user" or (m.role == "assistant" and m.content):
            out.append(m.position)
    return out


class FidelityController(QObject):
    """The window's fidelity checks: one at a time (the worker's); the latest report kept (``report``)."""

    rows_changed = Signal(object)  # list of row dicts so far (the reference's first)
    progress_changed = Signal(object)  # (fraction, seconds left or None, what runs now)
    finished = Signal(str, object)  # reason ("done", "cancelled", why it failed), the report (dict or None)

    def __init__(self, window) -> None:
        super().__init__(window)
        self.w = window
        self.check_id = 0
        self.running = False
        self.rows: list[dict] = []
        self.report: dict[str, Any] | None = None
        self._positions: list[int | None] = []
        ctl = window.engine.worker.fidelity
        ctl.row.connect(self._on_row)
        ctl.progress.connect(self._on_progress)
        ctl.finished.connect(self._on_finished)
        window.memory.fidelity_requested.connect(self.check)
        window.memory.fidelity_stop_requested.connect(self.cancel)
        window.conversation.chat_opened.connect(lambda _chat: self.clear_marks())

    def check(self, grid: bool = False) -> int:
        """Check the chat on screen under the chats' cache setting (with ``grid``, every precision × policy too);
        its id (0: nothing to check, said in the Memory panel)."""
        messages = self.w.conversation.engine_messages()
        if self.w.info is None:
            self.w.memory.set_fidelity("Load a model first.", running=False)
            return 0
        if not any(m["role"] == "user" for m in messages):
            self.w.memory.set_fidelity("Send a message first: the check reads your chat.", running=False)
            return 0
        self.clear_marks()
        self.check_id, self.running, self.rows, self.report = next(_ids), True, [], None
        self._positions = engine_positions(self.w.conversation)
        self.w.memory.set_fidelity("Checking fidelity on this chat…", running=True)
        self.w.engine.call(self.w.engine.worker.fidelity.start, self.check_id, messages, None, grid)
        return self.check_id

    def cancel(self) -> None:
        if self.running:
            self.w.engine.call(self.w.engine.worker.fidelity.cancel, self.check_id)

    def _on_row(self, check_id: int, row: dict) -> None:
        if check_id == self.check_id:
            self.rows.append(row)
            self.rows_changed.emit(list(self.rows))

    def _on_progress(self, check_id: int, progress: tuple) -> None:
        if check_id != self.check_id or not self.running:
            return
        fraction, left, doing = progress
        eta = f" · about {max(1, round(left))} s left" if left is not None else ""
        self.w.memory.set_fidelity(f"Checking fidelity: {doing.replace(LABEL_SUFFIX, '')} · {100 * fraction:.0f}%"
                                   f"{eta}", running=True)
        self.progress_changed.emit(progress)

    def _on_finished(self, check_id: int, reason: str, report: Any) -> None:
        if check_id != self.check_id:
            return
        self.running, self.report = False, report
        info = self.w.info
        if info is not None and self.rows:  # what each setting costs on this model: said before a lossy one is used
            Measured(self.w.settings).record(info.source, self.rows)
        if report is not None and report.get("setting"):
            self.w.memory.set_fidelity(summary(report) + ("" if reason == "done" else f" (stopped: {reason})"),
                                       running=False)
            self.mark_worst(report)
        else:
            self.w.memory.set_fidelity(f"Fidelity not checked: {reason}", running=False)
        self.finished.emit(reason, report)

    def mark_worst(self, report: dict) -> None:
        """Tint the worst tokens of the user's setting in their bubbles, each bubble saying how many and the worst."""
        by_bubble: dict[int, list[dict]] = {}
        for w in report.get("worst", ()):
            if w.get("agree", True) and float(w.get("kl", 0.0)) < WORTH_A_TINT:
                continue  # the same top token, next to no divergence: nothing lost there (KL 0.000 was tinted red)
            m = w.get("message", -1)
            pos = self._positions[m] if 0 <= m < len(self._positions) else None
            if pos is not None and w.get("chars"):
                by_bubble.setdefault(pos, []).append(w)
        for bubble in self.w.chat.bubbles:
            found = by_bubble.get(bubble.position)
            if not found:
                continue
            top = max(found, key=lambda w: w["kl"])
            line = (f"{len(found)} of the fidelity check's {len(report['worst'])} worst tokens here (tinted); the "
                    f"worst: {top['text'].strip() or repr(top['text'])!r}, KL {top['kl']:.3f}"
                    f"{'' if top['agree'] else ', another top-1 token'}")
            bubble.set_fidelity([w["chars"] for w in found], line)

    def clear_marks(self) -> None:
        for bubble in self.w.chat.bubbles:
            if bubble.fidelity_spans or bubble.fidelity_label.isVisible():
                bubble.set_fidelity([], "")
