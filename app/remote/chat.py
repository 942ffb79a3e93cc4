"""Remote chats in the window: File ▸ Connect to a server… adds a chat whose replies stream from that server, in
the same chat pane, with the server's KV cache in the page map.

Design — the window's parts stay as they are; while a remote chat is on screen this controller *borrows* them:
the local chat leaves (``Conversation.leave``, its reply goes on in the background), the chat pane's requests
(send, stop, regenerate, edit, versions, system prompt) are re-wired from the conversation to here, the page map
and timing panel are fed from the remote view on a 4 Hz timer, and the local-only controls are greyed with the
server's fixed values. Opening a local chat or an API conversation gives everything back. It is made on first use
(``RemoteChats.of(window)``) or at start when the history holds remote chats (``restore``), and it stops its
threads when the window closes. Every change of a remote chat is written to the history as it happens
(``app.remote.saved``); connecting, reconnecting and deleting are in ``app.remote.connect``.

Network and ZMQ never run here: replies stream on the link's chat thread, ``/metrics`` on its poll thread, events
on the subscriber's thread (``app.remote.worker``); this thread only reads the view under its lock.
"""

from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import QLabel

from app.remote.connect import Connecting, offline_text
from app.remote.dialog import ConnectDialog
from app.remote.chat_list import RemoteChat, RemoteList, reply_stats
from app.remote.panels import RemotePanels, chunk_events, fixed_text
from app.remote.redraw import Redraw
from app.remote.saved import RemoteSaver
from app.remote.worker import RemoteLink
from app.chat.replies import pick_version, versions_of, with_version
from engine.remote.why import Before
from engine.snapshot import TokenEvent
from app.ground.screen import OnScreen, ReplyView
from engine.core.vocab import FinishReason

POLL_MS = 1000  # /metrics once a second (occupancy, hit rate, preemptions)
QUEUED = "waiting for this server's reply in another remote chat to finish · Stop (Esc) cancels"
PIN_NOTE = "Pinning is a local cache policy: the server decides which blocks it keeps"

def open_connect(window) -> ConnectDialog:
    """File ▸ Connect to a server…"""
    return RemoteChats.of(window).open_dialog()


def restore(window) -> None:
    """At start: the remote chats saved by earlier sessions are listed (not connected until asked)."""
    if window.conversation.history.chats(remote=True):
        RemoteChats.of(window).show_saved()


class RemoteChats(QObject, Connecting):
    """The window's remote chats. ``current``: the one on screen (None: a local chat or API conversation is).

    Signals (for tests and the self-test): ``chat_added(RemoteChat)``, ``link_attached(RemoteChat)`` (a saved chat
    connected again), ``reply_finished(generation, reason)``.
    """

    chat_added = Signal(object)
    link_attached = Signal(object)
    reply_finished = Signal(int, str)

    @classmethod
    def of(cls, window) -> "RemoteChats":
        if getattr(window, "remote", None) is None:
            window.remote = cls(window)
        return window.remote

    def __init__(self, window) -> None:
        super().__init__(window)
        self.window, self.pane = window, window.chat
        self.chats: dict[int, RemoteChat] = {}  # by their chat id in the history
        self.current: RemoteChat | None = None
        self.links: list[RemoteLink] = []
        self.dialog: ConnectDialog | None = None
        self.saver = RemoteSaver(window.conversation.history)
        self._reconnecting: RemoteChat | None = None  # the saved chat the dialog connects again, if any
        self.closed = False
        self._next_gen = 1_000_000  # apart from the local replies' ids (the timing panel)
        self._ready = (True, "")  # the pane's local readiness, given back on leaving
        self.label = QLabel("Remote chats")
        self.label.setToolTip("Chats whose replies come from a server (File ▸ Connect to a server…)")
        self.list = RemoteList()
        # Two rows at least, no more: the chats dock is not scrolled, and a taller minimum would raise the
        # window's minimum height (1280×720 must still fit).
        self.list.setMinimumHeight(2 * self.list.fontMetrics().height() + 8)
        box = window.chats_box.layout()
        box.insertWidget(1, self.label)
        box.insertWidget(2, self.list, 1)
        self.label.setVisible(False)
        self.list.setVisible(False)
        self.panels = RemotePanels(window)
        self.lock = self.panels.lock
        self.redraw = Redraw(self, self._draw, self._view)
        self.poll = QTimer(self)
        self.poll.setInterval(POLL_MS)
        self.poll.timeout.connect(self._poll)
        self.list.chat_selected.connect(self.open_chat)
        self.list.new_requested.connect(self._new_like)
        self.list.close_requested.connect(self.close_chat)
        window.on_screen.subscribe(self._on_screen)  # a local chat or an API conversation took the screen
        window.models.ready_changed.connect(self._on_ready)
        window.on_screen.register(OnScreen.REMOTE, self)

    # -- on screen ------------------------------------------------------------------------------------------
    def open_chat(self, chat_id: int) -> None:
        rc = self.chats.get(chat_id)
        if rc is None or rc is self.current:
            return
        self.saver.load(rc)
        if rc.link is None:  # a saved chat: a server open already (another chat's) carries it on
            rc.link = next((link for link in self.links if link.engine.client.url == rc.url), None)
        if self.current is None:
            self._take_screen()
        self.current = rc
        self._refresh_list()
        self._show(rc)

    def _take_screen(self) -> None:
        """The local chat (or API conversation) leaves; the pane's requests come here."""
        w = self.window
        if w.conversation.chat_id is not None:
            w.conversation.leave()
        if w.api_view.session_id:
            w.api_list.deselect()
            w.api_view.session_id = 0
        self._ready = self.pane.readiness
        self.window.on_screen.show(OnScreen.REMOTE)  # the pane's requests and the menu's come here now
        self.panels.borrow()
        self.redraw.start()
        self.poll.start()

    def _show(self, rc: RemoteChat) -> None:
        p = self.pane
        # the screen's record: a remote chat, whose panels this controller draws from the server's view
        self.window.on_screen.update(chat=("remote", rc.id), generation=0, latest=None, frame=None,
                                     reply=ReplyView(), account=None, speed=0.0, context=None)
        p.notice.clear()
        p.set_read_only("")
        p.set_ready(rc.connected, self._hint(rc))
        p.set_chat(rc.label, rc.system_prompt)
        p.set_messages(rc.messages)
        if rc.generation:
            p.resume_reply(rc.messages[-1].position, "", [])
        p.set_generating(bool(rc.generation))
        self._no_pins()
        self.window.timing.clear()
        if rc.generation:  # a reply streaming in the background: its timing so far
            self.window.timing.show_reply(rc.generation)
        if not rc.connected:
            self._show_offline(rc)
            return
        self.lock.lock(fixed_text(rc.link.engine.fixed_settings()))
        if rc.link.engine.note:
            p.notice.show_message(rc.link.engine.note)
        self._poll()
        self.draw(force=True)

    def _show_offline(self, rc: RemoteChat) -> None:
        """A saved chat whose server is not connected: its transcript, and a way to connect again."""
        self.lock.lock(f"{rc.url} is not connected")
        self.window.status.show_remote({"model": (f"{rc.label.split(' — ')[0]} · not connected", rc.url)})
        self.window.page_map.clear()
        self.window.page_map.caption.setText(f"Not connected to {rc.server}: connect to draw its KV cache")
        self.pane.notice.show_message(offline_text(rc), [("Connect…", lambda: self.open_dialog(rc))], tone="info")

    @staticmethod
    def _hint(rc: RemoteChat) -> str:
        if not rc.connected:
            return offline_text(rc)
        return (f"Chat with {rc.model} on {rc.server}: replies stream from the server, and the page map draws its "
                "KV cache from the server's events.")

    def leave(self) -> None:
        """A local chat or an API conversation took the screen: everything borrowed goes back."""
        if self.current is None:
            return
        self.current = None
        self.list.deselect()
        self.redraw.stop()
        self.poll.stop()
        self.pane.set_ready(*self._ready)
        self.panels.give_back()

    def _no_pins(self) -> None:
        """Pinning is a local cache policy: a remote chat's bubbles do not offer it (bubbles are built lazily, so
        this runs after each change of the transcript)."""
        for bubble in self.pane.bubbles:
            bubble.pin_button.setVisible(False)

    def _on_screen(self, old: OnScreen, new: OnScreen) -> None:
        if old is OnScreen.REMOTE and new is not OnScreen.REMOTE:
            self.leave()

    def _on_ready(self, ready: bool, hint: str) -> None:
        """The local model's readiness changed (a load): kept for later; the remote chat stays usable."""
        if self.current is not None:
            self._ready = (ready, hint)
            self.pane.set_ready(True, self._hint(self.current))

    def _refresh_list(self) -> None:
        self.list.set_chats(list(self.chats.values()), self.current.id if self.current else None)
        if self.current is not None:
            self.pane.title.setText(self.current.label)

    # -- requests (the pane's, while a remote chat is on screen) --------------------------------------------
    def send(self, text: str) -> None:
        rc = self.current
        if rc is None or rc.generation or not rc.connected or not text.strip():
            return
        self.pane.notice.clear()  # the user moved on from whatever it said
        self.saver.add(rc, "user", text)
        self.pane.add_message("user", text, rc.messages[-1].position)
        self._request(rc)
        self._no_pins()
        self._refresh_list()

    def _request(self, rc: RemoteChat, versions: list | None = None) -> None:
        w = self.window
        try:
            sampling = w.sampling_override or w.sampling.sampling()
        except ValueError as e:
            w.show_error(str(e))
            return
        api = rc.api_messages()
        self.saver.add(rc, "assistant", "")
        self._next_gen += 1
        rc.generation, rc.cancel, rc.versions = self._next_gen, threading.Event(), list(versions or [])
        rc.chunks, rc.sent, rc.live_ids, rc.live_prompt = 0, time.monotonic(), [], False
        rc.last_arrival = rc.sent
        bubble = self.pane.begin_reply(rc.messages[-1].position, len(rc.versions))
        if any(c.generation and c.link is rc.link for c in self.chats.values() if c is not rc):
            bubble.set_waiting(QUEUED)  # one reply at a time per server: its chat thread streams them in turn
        self.pane.set_generating(True)
        w.timing.begin_reply(rc.generation, rc.label)
        rc.link.chat(rc.generation, rc.model, api, sampling.max_new_tokens, sampling.temperature, rc.cancel,
                     rc.before)
        self._refresh_list()

    def stop(self) -> None:
        """Stop (Esc): the reply ends at its next chunk, its text kept and marked as stopped by you."""
        rc = self.current
        if rc is not None and rc.cancel is not None:
            rc.cancel.set()

    def regenerate(self) -> None:
        """Ask again for the last reply; the one it replaces stays as a version (as in a local chat)."""
        rc = self.current
        if rc is None or rc.generation or not rc.connected or not any(m.role == "user" for m in rc.messages):
            return
        last = rc.messages[-1]
        versions = versions_of(last.content, last.stats) if last.role == "assistant" else []
        self._truncate(rc, max(m.position for m in rc.messages if m.role == "user"))
        self._request(rc, versions)
        self._no_pins()

    def edit(self, position: int, text: str) -> None:
        """Replace a past user message, drop what followed and ask again."""
        rc = self.current
        target = next((m for m in rc.messages if m.position == position), None) if rc is not None else None
        if rc is None or rc.generation or not rc.connected or target is None or target.role != "user":
            return
        self.saver.edit(target, text)
        self._truncate(rc, position)
        self.pane.set_text_at(position, text)
        self._request(rc)
        self._no_pins()

    def _truncate(self, rc: RemoteChat, position: int) -> None:
        self.saver.truncate(rc, position)
        self.pane.truncate_after(position)

    def show_version(self, position: int, index: int) -> None:
        rc = self.current
        m = next((m for m in rc.messages if m.position == position), None) if rc is not None else None
        picked = pick_version(m.stats, index) if m is not None and not rc.generation else None
        if picked is not None:
            self.saver.finish(m, *picked)
            self.pane.show_version(position, *picked)

    def pin(self, _position: int, _pinned: bool) -> None:
        self.window.status.message(PIN_NOTE, 6000)

    def set_system_prompt(self, text: str) -> None:
        if self.current is not None:
            self.saver.set_system_prompt(self.current, text)

    # -- the link's events ------------------------------------------------------------------------------------
    def _chat_of(self, generation: int) -> RemoteChat | None:
        return next((rc for rc in self.chats.values() if rc.generation == generation), None)

    def _on_prompt(self, generation: int, prompt_ids: list) -> None:
        rc = self._chat_of(generation)
        if rc is not None and not self.closed:
            rc.live_ids = list(prompt_ids) + rc.live_ids  # the tokens streamed so far follow it
            rc.live_prompt = True

    def _on_delta(self, generation: int, text: str, ids: list, arrival: float, together: bool = False) -> None:
        rc = self._chat_of(generation)
        if rc is None or self.closed:
            return
        self.saver.append(rc.messages[-1], text, rc.chunks + 1)
        rc.live_ids += ids
        if rc is self.current:
            self.pane.append_delta(text)
        together = rc.chunks > 0 and together  # the same socket read as the chunk before (``Reply.together``)
        for event in chunk_events(generation, rc.chunks, arrival, rc.last_arrival, len(ids), together):
            self.window.timing.add_token(event)  # counted off screen too (``TimingPanel.show_reply``)
        rc.chunks += 1
        rc.last_arrival = arrival

    def _on_finished(self, generation: int, reply) -> None:
        rc = self._chat_of(generation)
        if rc is None or self.closed:
            return
        rc.generation, rc.cancel = 0, None
        msg = rc.messages[-1]
        text = reply.text or msg.content
        reason = FinishReason.ERROR if reply.error else FinishReason.from_openai(reply.finish_reason)
        stats = reply_stats(reply, reason)
        if rc.versions:
            stats = with_version(rc.versions, text, stats)
        self.saver.finish(msg, text, stats)
        if reply.prompt_ids:
            rc.ids = list(reply.prompt_ids) + list(reply.token_ids)
            rc.before = Before(tuple(rc.ids), tuple(rc.api_messages()), reply.finished_at)
        rc.reply = reply
        if reply.ttft_s is not None:  # the first bar: the client's TTFT, the prompt's size
            self.window.timing.add_token(TokenEvent(generation, 0, -1, "", "prefill", reply.ttft_s * 1e3,
                                                    len(reply.prompt_ids)))
        rc.link.refresh(now=not reply.error)  # the reply moved the hit rate and occupancy (and the server is up)
        if rc is self.current:
            self.pane.finish_reply(text or None, stats)
            self.pane.set_generating(False)
            if reply.error:
                self.window.show_error(f"The remote reply stopped: {reply.error}")
            self.draw(force=True)
        elif reply.error:
            self.window.status.message(f"{rc.label}: {reply.error}", 8000)
        self._refresh_list()
        self.reply_finished.emit(generation, reason)

    # -- panels ---------------------------------------------------------------------------------------------
    def _poll(self) -> None:
        if self.current is not None and self.current.connected:
            self.current.link.refresh()

    def _on_events(self) -> None:
        if self.current is not None and self.current.link is self.sender():
            self.redraw.events_arrived()

    def _view(self):
        rc = self.current
        return rc.link.engine.view if rc is not None and rc.connected else None

    def _draw(self, force: bool) -> None:
        if self.current is not None and self.current.connected:
            self.panels.draw(self.current, force)

    def draw(self, force: bool = False) -> None:
        """The page map and timing panel of the remote chat on screen (``app.remote.redraw`` says when)."""
        self.redraw.now(force)

    # -- closing --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """The window closes: replies in flight stop, the threads and event subscribers end."""
        if self.closed:
            return
        self.closed = True
        self.redraw.stop()
        self.poll.stop()
        if self.dialog is not None and self.dialog.busy:
            self.dialog.reject()  # the attempt in progress is dropped, not waited for
        for rc in self.chats.values():
            if rc.cancel is not None:
                rc.cancel.set()
        for link in self.links:
            link.shutdown()


