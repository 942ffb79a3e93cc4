"""The chat pane: system prompt, transcript of Markdown bubbles, and the input with Send/Stop.

Enter sends, Shift+Enter inserts a new line, Esc stops. The pane only shows and asks; the window decides
what a request means for the engine and the history store. The transcript holds only what is saved with
the chat; anything else shows in the notice bar above it (``app.ground.notice``). Streaming text is buffered by
the bubble and drawn by ``render()``, which the window calls from its ≤30 Hz refresh timer.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.chat.chat_input import ChatInput
from app.chat.message_view import MessageView
from app.controls.lossy import lossy_parts
from app.ground.screen import OnScreen
from app.ground.notice import NoticeBar
from app.chat.transcript import Transcript
from app.ground.widgets import WordLabel

MIN_CHAT_PX = 340  # the chat pane never gets narrower than a bubble's buttons (so bubbles wrap, never clip)
PLACEHOLDER = "Message the model — Enter to send, Shift+Enter for a new line"
SEND_TIP = "Send the message (Enter or Ctrl+Enter)"
# the last one repeats a line: the model goes on repeating it, which prompt lookup (Speculative decoding) guesses
# right — stories260K, greedy: 212 of 269 draft tokens kept (79%); at temperature 0.7 10-20%
REPEAT_STARTER = ("Tom has a big red ball. Tom has a big red ball. Tom has a big red ball. Tom has a big red "
                  "ball.")
SUGGESTIONS = ("Once upon a time, a little fox", "Tell me a story about a dragon", "What is a KV cache?",
               REPEAT_STARTER)


class ChatPane(QWidget):
    """Transcript + input. Signals carry what the user asked for; slots show what happened."""

    send_requested = Signal(str)
    stop_requested = Signal()
    regenerate_requested = Signal()
    edit_requested = Signal(int, str)  # position of the user message, new text
    pin_requested = Signal(int, bool)  # position of the message, pinned
    version_requested = Signal(int, int)  # position of the reply, version to show
    why_requested = Signal()  # a reply footer's "Why?": show the "Why recomputed?" readout
    new_chat_requested = Signal()
    repeat_requested = Signal(str)  # the repeat starter, when ``repeat_demo`` takes it (app.chat.spec_demo)
    system_prompt_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ChatPane")
        self.generating = False
        self._ready = False
        self._hint = ""
        self.read_only = ""  # why nothing can be typed here (an API conversation is on screen); "" when it can
        self.repeat_demo = False  # the repeat starter shows prompt lookup (``repeat_requested``), not a plain send
        self.priority = False  # the eviction policy is Priority pinning (pinned messages' lines say so)
        self.tint = False  # replies tint their accepted draft tokens (speculative decoding)
        self._build_header()
        self._build_transcript()
        self._build_input()
        self._lay_out()
        self.set_ready(False, "Starting the engine…")
        self.set_generating(False)

    def _build_header(self) -> None:
        """Title, New chat, the system prompt (sent 400 ms after the last keystroke) and the notice bar."""
        self.title = WordLabel("New chat")  # shortened at a word with "…"
        self.title.setObjectName("chatTitle")
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)  # never widens the pane
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new chat (Ctrl+N); this one stays in the list")
        self.system_prompt = QLineEdit()
        self.system_prompt.setPlaceholderText("System prompt for this chat (optional)")
        self.system_prompt.setObjectName("systemPrompt")
        self.system_prompt.setToolTip("Instructions the model sees before the chat. Under Priority pinning it is "
                                      "never dropped from the cache.")
        self._sys_timer = QTimer(self)
        self._sys_timer.setSingleShot(True)
        self._sys_timer.setInterval(400)
        self._sys_timer.timeout.connect(lambda: self.system_prompt_changed.emit(self.system_prompt.text()))
        self.system_prompt.textEdited.connect(lambda _t: self._sys_timer.start())
        self.notice = NoticeBar()  # what is not part of the chat (a failed load, refused settings)
        self.lossy_chip = QLabel("")  # the chat's cache loses information (K/V below 8 bits, eviction): said while on
        self.lossy_chip.setObjectName("lossyChip")
        self.lossy_chip.setVisible(False)

    def _build_transcript(self) -> None:
        """The scrolling transcript, with the empty chat's hint and suggestions."""
        self.empty_hint = QLabel()
        self.empty_hint.setObjectName("emptyHint")
        self.empty_hint.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_hint.setWordWrap(True)
        self.suggestions = QWidget()
        row = QVBoxLayout(self.suggestions)
        row.setAlignment(Qt.AlignmentFlag.AlignHCenter)
        for prompt in SUGGESTIONS:
            b = QPushButton(prompt if prompt is not REPEAT_STARTER else "Tom has a big red ball… (prompt lookup)")
            if prompt is REPEAT_STARTER:  # a long label would widen the chat column
                b.setToolTip(f"Sends “{prompt}” with prompt lookup (Speculative decoding) on and greedy sampling for "
                             "this reply: the model repeats it, and the guesses it keeps are tinted")
            b.setObjectName("suggestion")
            b.setCursor(Qt.CursorShape.PointingHandCursor)
            b.clicked.connect(lambda _=False, p=prompt: self._suggest(p))
            row.addWidget(b, 0, Qt.AlignmentFlag.AlignHCenter)
        self.scroll = Transcript(self._bubble, (self.empty_hint, self.suggestions))  # owns the bubbles
        self.scroll.setMinimumWidth(MIN_CHAT_PX)

    def _build_input(self) -> None:
        """The message box and its Send, Stop and Regenerate buttons."""
        self.input = ChatInput()
        self.input.setObjectName("chatInput")
        self.input.setPlaceholderText(PLACEHOLDER)
        self.input.setTabChangesFocus(True)
        self.input.setMaximumHeight(96)
        self.input.submitted.connect(self.submit)
        self.input.escape_pressed.connect(self._on_escape)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primaryButton")
        self.send_button.clicked.connect(self.submit)
        self.stop_button = QPushButton("Stop (Esc)")
        self.stop_button.setToolTip("Stop the reply; what it wrote so far stays, marked as stopped")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.clicked.connect(self.stop_requested)
        self.regen_button = QPushButton("Regenerate")
        self.regen_button.setToolTip("Ask for another reply (Ctrl+R); the current one stays as a version")
        self.regen_button.clicked.connect(self.regenerate_requested)
        self.new_button.clicked.connect(self.new_chat_requested)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, activated=self._on_escape)

    def _lay_out(self) -> None:
        top = QHBoxLayout()
        top.addWidget(self.title, 1)
        top.addWidget(self.lossy_chip)
        top.addWidget(self.new_button)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.regen_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.input, 1)
        bottom.addLayout(buttons)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addLayout(top)
        layout.addWidget(self.system_prompt)
        layout.addWidget(self.notice)
        layout.addWidget(self.scroll, 1)
        layout.addLayout(bottom)

    # state ----------------------------------------------------------------------------------------------
    @property
    def readiness(self) -> tuple[bool, str]:
        """(a model is loaded, the hint the empty transcript shows): what ``set_ready`` was last given."""
        return self._ready, self._hint

    def set_ready(self, ready: bool, hint: str = "") -> None:
        """Whether a model is loaded; ``hint`` shows in the empty transcript."""
        self._ready = ready
        self._hint = hint
        self.empty_hint.setText(hint)
        self._update_buttons()
        self._update_empty()

    def set_generating(self, generating: bool) -> None:
        self.generating = generating
        self._update_buttons()

    def set_read_only(self, reason: str) -> None:
        """Show a transcript nobody types into here (``reason`` says why, in the input and on Send); ""
        makes the pane a chat again."""
        self.read_only = reason
        self.input.setReadOnly(bool(reason))
        self.input.setPlaceholderText(reason or PLACEHOLDER)
        self.system_prompt.setVisible(not reason)  # an API conversation's system prompt is in its tokens
        self.empty_hint.setText(reason or self._hint)  # until its transcript comes: not "ready, say something"
        self._update_buttons()
        self._update_empty()

    def send_blocked(self) -> str:
        """Why Send is grey now ("" when it is not): a greyed button always says why, in its tooltip."""
        if self.read_only:
            return self.read_only
        if not self._ready:
            return self._hint or "No model is loaded"
        return "A reply is being written: Stop (Esc) ends it" if self.generating else ""

    def _update_buttons(self) -> None:
        idle = self._ready and not self.generating and not self.read_only
        self.send_button.setEnabled(idle)
        self.send_button.setToolTip(self.send_blocked() or SEND_TIP)
        self.stop_button.setEnabled(self.generating)
        self.regen_button.setEnabled(idle and self.scroll.has_reply)
        self.scroll.set_actions_enabled(idle)

    def _update_empty(self) -> None:
        self.empty_hint.setVisible(not self.bubbles)
        self.suggestions.setVisible(not self.bubbles and self._ready and not self.read_only)

    @property
    def bubbles(self) -> list[MessageView]:
        """The bubbles built, oldest first: a window of consecutive messages, the newest ones unless the
        view was scrolled far up (see ``app.chat.transcript``)."""
        return self.scroll.bubbles

    @property
    def streaming(self) -> MessageView | None:
        """The reply being streamed (the transcript's ``live`` bubble), or None."""
        return self.scroll.live

    @streaming.setter
    def streaming(self, bubble: MessageView | None) -> None:
        self.scroll.live = bubble

    def _suggest(self, prompt: str) -> None:
        if self._ready and not self.generating and not self.read_only:
            demo = prompt is REPEAT_STARTER and self.repeat_demo
            (self.repeat_requested if demo else self.send_requested).emit(prompt)

    def set_chat(self, title: str, system_prompt: str) -> None:
        self.title.setText(title)
        self.system_prompt.setText(system_prompt)

    # transcript -----------------------------------------------------------------------------------------
    def clear(self) -> None:
        self.scroll.clear()
        self._update_empty()
        self._update_buttons()

    def set_messages(self, messages: list[Any]) -> None:
        """Show stored messages (objects with role, content, position, stats; oldest first)."""
        self.scroll.set_records(messages)
        self._update_empty()
        self._update_buttons()

    def add_message(self, role: str, text: str, position: int) -> MessageView:
        """Add the newest message's bubble."""
        bubble = self._bubble(role, text, position)
        self.scroll.append(bubble)
        self._update_empty()
        self._update_buttons()
        return bubble

    def _bubble(self, role: str, text: str, position: int) -> MessageView:
        bubble = MessageView(role, text, position)
        bubble.tint = self.tint
        bubble.priority = self.priority
        bubble.edit_submitted.connect(self.edit_requested)
        bubble.regenerate_requested.connect(self.regenerate_requested)
        bubble.pin_toggled.connect(self.pin_requested)
        bubble.version_requested.connect(self.version_requested)
        bubble.why_requested.connect(self.why_requested)
        return bubble

    def truncate_after(self, position: int) -> None:
        """Drop the messages after ``position`` (edit-and-resend, regenerate)."""
        self.scroll.truncate_after(position)
        self._update_empty()
        self._update_buttons()

    def set_text_at(self, position: int, text: str) -> None:
        """Show new text for the message at ``position`` (an edited message)."""
        self.scroll.set_text_at(position, text)

    def set_unsaved(self, positions: set[int], text: str = "not saved — retrying") -> None:
        """Mark the messages at ``positions`` as not in the history file yet; unmark the others."""
        self.scroll.set_unsaved(positions, text)

    def begin_reply(self, position: int, earlier_versions: int = 0) -> MessageView:
        """A new reply's bubble (``earlier_versions``: versions it was regenerated from, shown as 'n / n')."""
        self.streaming = self.add_message("assistant", "", position)
        self.streaming.set_live(True)
        if earlier_versions:
            self.streaming.set_versions([{}] * earlier_versions, earlier_versions)
        self.scroll.show_newest()
        return self.streaming

    def resume_reply(self, position: int, pending: str, notes: list[str], draft_spans=()) -> None:
        """The chat of a reply still being written is back on screen: its bubble (saved text so far) goes on
        streaming, with the text not saved yet and its notes."""
        self.scroll.show_newest()
        bubble = next((b for b in self.bubbles if b.position == position), None)
        if bubble is None:
            bubble = self.add_message("assistant", "", position)
        self.streaming = bubble
        bubble.stats = {}
        bubble.set_live(True)
        bubble.append(pending)
        bubble.draft_spans = [list(span) for span in draft_spans]  # the reply's, over saved and pending text
        bubble.set_notes(notes)
        bubble.render()

    def _bubble_at(self, position: int) -> MessageView | None:
        return next((b for b in self.bubbles if b.position == position), None)

    def show_version(self, position: int, text: str, stats: dict[str, Any]) -> None:
        """Show another version of the reply at ``position``."""
        bubble = self._bubble_at(position)
        if bubble is not None:
            bubble.set_text(text)
            bubble.set_stats(stats)

    def show_pinned_tokens(self, position: int, tokens: int) -> None:
        bubble = self._bubble_at(position)
        if bubble is not None:
            bubble.set_pinned_tokens(tokens)

    def append_delta(self, delta: str, draft: bool = False) -> None:
        """Streamed text of the reply (``draft``: an accepted draft token's)."""
        if self.streaming is not None:
            self.streaming.append(delta, draft)

    def watch(self, screen) -> None:
        """Follow the cache setting applied to the chat on screen (``app.ground.screen.Screen``): pinned messages' lines
        say whether Priority pinning keeps them."""
        screen.connect("settings", lambda _cfg: self._on_settings(screen))
        screen.connect("kind", lambda _kind: self._on_settings(screen))

    def _on_settings(self, screen) -> None:
        """The chat's cache setting: pinned lines say whether Priority pinning keeps them, and a lossy setting
        (K/V below 8 bits, an eviction policy) is marked on the chat while it is on."""
        cfg = screen.settings
        if cfg is None:
            return
        self.set_priority(cfg.policy == "priority")
        parts = lossy_parts(cfg) if screen.kind is OnScreen.LOCAL else []
        self.lossy_chip.setText("lossy cache" if parts else "")
        self.lossy_chip.setToolTip("This chat's cache loses information (" + ", ".join(parts) + "): replies may "
                                   "differ from the full cache's. Cache policy changes it; Memory ▸ Check fidelity "
                                   "measures it." if parts else "")
        self.lossy_chip.setVisible(bool(parts))

    def set_priority(self, on: bool) -> None:
        """Priority pinning is (not) the eviction policy: pinned messages' lines say whether it keeps them."""
        self.priority = bool(on)
        for bubble in self.bubbles:
            bubble.set_priority(self.priority)

    def set_tint(self, on: bool) -> None:
        """Tint accepted draft tokens in every reply (the bubbles built later too)."""
        self.tint = bool(on)
        for bubble in self.bubbles:
            bubble.set_tint(self.tint)

    def render(self) -> None:
        """Draw buffered streaming text (called at ≤30 Hz)."""
        if self.streaming is not None:
            self.streaming.render()

    def show_reply_notes(self, notes: list[str]) -> None:
        """Notes of the reply in flight, under it while it streams (``finish_reply`` keeps them)."""
        if self.streaming is not None:
            self.streaming.set_notes(notes)

    def finish_reply(self, text: str | None, stats: dict[str, Any]) -> None:
        if self.streaming is None:
            return
        if text is not None and text != self.streaming.text:
            self.streaming.set_text(text)
        self.streaming.render()
        self.streaming.set_stats(stats)
        self.streaming.set_live(False)
        self.streaming = None

    def user_text_at(self, position: int) -> str:
        return self.scroll.text_at(position, "user")

    # input ----------------------------------------------------------------------------------------------
    def submit(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or not self._ready or self.generating or self.read_only:
            return
        self.input.clear()
        self.send_requested.emit(text)

    def _on_escape(self) -> None:
        if self.generating:
            self.stop_requested.emit()
