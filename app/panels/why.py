"""Why recomputed?: the misses of the chat on screen's last prompt — which prompt tokens were computed instead of
read from the cache, and why (``engine.snapshot.CacheAccount`` from the snapshot; the words are
``app.ground.reuse_words``'). Each range gets its reason's colour (the page map's token strip uses the same ones),
where it sits in the chat when the reply knows (``set_places``), and the engine's one-line detail."""

from __future__ import annotations

import html

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import QLabel, QScrollArea

from app.panels.base import Panel
from app.panels.strip import REASON_COLOURS
from app.ground.reuse_words import (ALL_REUSED, NO_ACCOUNT, NO_TURN, MissRow, computed_words, counts_of, detail_words,
                                   explained, misses_of, reason_label, recomputed_of, where)
from engine.snapshot import CacheSnapshot

MAX_ROWS = 200  # a prompt cut into more ranges lists the first ones


def summary(account) -> str:
    """'prompt 1,200 tokens: <b>50</b> reused, <b>1,150</b> computed (1,149 recomputed, 1 new), 20 dropped unread to
    fit the context' — the reply footer's numbers and words (``reuse_words.computed_words``)."""
    c = counts_of(account)
    computed = computed_words(c).replace(f"computed {c.computed:,}", f"<b>{c.computed:,}</b> computed", 1)
    text = f"prompt {c.prompt:,} tokens: <b>{c.reused:,}</b> reused, {computed}"
    return text + (f", {c.dropped:,} dropped unread to fit the context" if c.dropped else "")


def row_html(m: MissRow, places: list[dict] | None) -> str:
    """One miss: chip, range, reason, where in the chat; the detail under it."""
    last = max(m.start, m.end - 1)
    span = f"tokens {m.start:,}–{last:,}" if m.tokens > 1 else f"token {m.start:,}"
    at, to = where(m.start, places), where(last, places)
    inside = "" if at == "the prompt" else f" · {at}" + (f" to {to}" if to not in (at, "the prompt") else "")
    colour = REASON_COLOURS.get(m.reason, "#ffffff")
    return (f'<p style="margin:0 0 6px 0"><span style="color:{colour}; font-size:13px">■</span>&nbsp;'
            f"<b>{html.escape(reason_label(m.reason))}</b> · {span} ({m.tokens:,}){html.escape(inside)}<br>"
            f'<span style="color:#8a919c">{html.escape(detail_words(m))}</span></p>')


def readout_html(account, places: list[dict] | None) -> str:
    """The body: the empty state, or each miss in order."""
    misses = misses_of(account)
    if account is None or not (account.get("prompt", 0) if isinstance(account, dict) else account.prompt):
        return html.escape(NO_TURN)
    if not explained(misses):
        if recomputed_of(account) <= 1:
            return html.escape(ALL_REUSED)
        head = "Nothing was recomputed: the tokens computed were new (not in the cache before)."
    else:
        head = ""
    rows = "".join(row_html(m, places) for m in misses[:MAX_ROWS])
    more = f"<p>… and {len(misses) - MAX_ROWS:,} more ranges</p>" if len(misses) > MAX_ROWS else ""
    return (f"<p>{html.escape(head)}</p>" if head else "") + rows + more


class WhyPanel(Panel):
    """The last prompt's misses of the chat on screen, from its snapshots (any step of the reply: the account is
    the prompt's)."""

    title = "Why recomputed?"

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.body = QLabel(html.escape(NO_TURN))
        self.body.setObjectName("whyReadout")
        self.body.setWordWrap(True)
        self.body.setTextFormat(Qt.TextFormat.RichText)
        self.body.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.view = QScrollArea()
        self.view.setWidgetResizable(True)
        self.view.setFrameShape(QScrollArea.Shape.NoFrame)
        self.view.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.view.setWidget(self.body)
        self._layout.addWidget(self.view, 1)
        self.fit_button.setVisible(False)  # nothing to fit: a list
        self.caption.setText("Last prompt of this chat: no turn yet.")

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(320, 220)

    def watch(self, screen) -> None:
        """Show the account the screen's record (``app.ground.screen.Screen``) holds for the chat on screen: its last
        prompt's, live while a reply reads it, as saved with the reply after (the footer's numbers, after a restart
        too)."""
        screen.connect("account", self.show_account)

    def show_account(self, account: dict | None) -> None:
        """``account``: a cache account as saved with a reply (``CacheAccount.to_dict`` and ``prompt``), with where its
        misses sit in the chat (``places``); None: no turn yet."""
        self.last_snapshot = None
        if not account:
            self.clear()
            return
        places = account.get("places") or None
        said = summary(account) if account.get("prompt") else "no turn yet"
        self.caption.setText(f"Last prompt of this chat · {said}")
        text = readout_html(account, places)
        if text != self.body.text():
            self.body.setText(text)
        self._count()

    def show_caption(self, snap: CacheSnapshot) -> None:
        account = snap.account
        said = summary(account) if account is not None and account.prompt else "no turn yet"
        self.caption.setText(f"Last prompt of this chat · {said}")

    def show_snapshot(self, snap: CacheSnapshot) -> None:
        self.last_snapshot = snap
        self.show_caption(snap)
        text = (html.escape(NO_ACCOUNT) if snap.account is None and snap.seq_len else
                readout_html(snap.account, None))
        if text != self.body.text():
            self.body.setText(text)
        self._count()

    def clear(self) -> None:
        self.last_snapshot = None
        self.caption.setText("Last prompt of this chat: no turn yet.")
        self.body.setText(html.escape(NO_TURN))

    def text(self) -> str:
        """The readout as plain text (what a user reads), for tests and exports."""
        from PySide6.QtGui import QTextDocument

        doc = QTextDocument()
        doc.setHtml(self.body.text())
        return doc.toPlainText()
