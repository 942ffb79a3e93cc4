"""Remote chats as data, and their list under the chats.

A remote chat's replies come from another machine's engine. It is saved in the history file like a local chat,
marked with its server (URL, model, events endpoint — never the API key), and listed apart from the local chats,
each row marked "⇄ stories260K @ 127.0.0.1:8000". After a restart a saved one shows its transcript and connects
again when asked (the key is asked for again).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtWidgets import QListWidget, QListWidgetItem, QMenu, QWidget

from app.chat.chat_list import REPLYING
from app.ground.glossary import CONTROLS
from app.ground.reuse_words import footer_line
from engine.remote.why import account_dict, account_line

MARK = "⇄"  # a chat whose replies come from a server


@dataclass
class Message:
    """One message of a remote chat, shaped like the history's rows the chat pane shows (``id``: its row there)."""
    role: str
    content: str
    position: int
    stats: dict = field(default_factory=dict)
    id: int = 0


def host_port(url: str) -> str:
    """'127.0.0.1:8000' of a server URL (the URL itself when it cannot be read)."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return url
    return f"{parts.hostname}:{port}" if parts.hostname else url


@dataclass
class RemoteChat:
    """A chat with one server: ``id`` is its chat id in the history; ``link`` its ``RemoteLink`` (None: not
    connected — a chat saved by an earlier session); ``url`` / ``model_name`` / ``events`` the server it was
    with. ``generation``: the reply in flight (0: none)."""
    id: int
    link: Any
    url: str = ""
    model_name: str = ""
    events: str = ""
    title: str = ""
    system_prompt: str = ""
    loaded: bool = True  # its messages were read from the history (a saved chat's are read when first opened)
    messages: list[Message] = field(default_factory=list)
    generation: int = 0
    cancel: threading.Event | None = None
    versions: list = field(default_factory=list)  # the versions the reply in flight will sit beside
    ids: list[int] = field(default_factory=list)  # prompt + reply token ids of its last finished reply
    live_ids: list[int] = field(default_factory=list)  # the reply in flight's: prompt, then tokens as they stream
    live_prompt: bool = False  # its prompt ids came (until then its chain is unknown)
    reply: Any = None  # its last finished ``engine.remote.client.Reply``
    before: Any = None  # its last request (``engine.remote.why.Before``): what the next one's account compares to
    chunks: int = 0  # streamed chunks of the reply in flight
    sent: float = 0.0  # when it was asked for (monotonic)
    last_arrival: float = 0.0  # its last chunk's arrival (monotonic)

    @property
    def chain_ids(self) -> list[int]:
        """The token ids whose blocks are this chat's: the reply in flight's once its prompt is known."""
        return self.live_ids if self.generation and self.live_prompt else self.ids

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.engine is not None

    @property
    def server(self) -> str:
        if self.connected:
            client = self.link.engine.client
            return f"{client.host}:{client.port}"
        return host_port(self.url)

    @property
    def model(self) -> str:
        return self.model_name or (self.link.engine.model if self.connected else "?")

    @property
    def label(self) -> str:
        """'⇄ stories260K @ 127.0.0.1:8000', with the chat's title (its first message) once there is one."""
        return f"{MARK} {self.model} @ {self.server}" + (f" — {self.title}" if self.title else "")

    def api_messages(self) -> list[dict]:
        """What the server is sent: the system prompt, then the user messages and the replies with text."""
        out = [{"role": "system", "content": self.system_prompt.strip()}] if self.system_prompt.strip() else []
        out += [{"role": m.role, "content": m.content} for m in self.messages
                if m.role == "user" or (m.role == "assistant" and m.content)]
        return out


class RemoteList(QListWidget):
    """The remote chats (shown once there is one); ``chat_selected(id)`` when the user picks one."""

    chat_selected = Signal(int)
    new_requested = Signal(int, str)  # another chat with this chat's server (and that model; '': this chat's)
    close_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("RemoteList")
        self._filling = False
        self._models: dict[int, list[str]] = {}  # chat id -> the models its server serves (connected ones)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)
        self.setUniformItemSizes(True)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.currentItemChanged.connect(self._on_current)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(220, 60)  # one or two servers; the list scrolls

    def set_chats(self, chats: list[RemoteChat], current: int | None) -> None:
        self._filling = True
        self.clear()
        self._models = {rc.id: list(rc.link.engine.models) for rc in chats if rc.connected}
        for rc in chats:
            item = QListWidgetItem(rc.label + (REPLYING if rc.generation else ""))
            item.setData(Qt.ItemDataRole.UserRole, rc.id)
            item.setToolTip(f"{rc.url} · model {rc.model}\nreplies come from this server; the chat is saved in "
                            "the history" + ("" if rc.connected else "\nnot connected: open it to connect again"))
            self.addItem(item)
            if rc.id == current:
                self.setCurrentItem(item)
        self._filling = False

    def chat_ids(self) -> list[int]:
        return [self.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.count())]

    def deselect(self) -> None:
        """No remote chat on screen: no row highlighted; clicking one opens it again."""
        self._filling = True
        self.setCurrentRow(-1)
        self.clearSelection()
        self._filling = False

    def _on_current(self, item: QListWidgetItem | None, _prev) -> None:
        if item is not None and not self._filling:
            self.chat_selected.emit(int(item.data(Qt.ItemDataRole.UserRole)))

    def mousePressEvent(self, event) -> None:  # noqa: N802 - Qt name
        if event.button() == Qt.MouseButton.RightButton:  # the menu opens; the chat on screen stays
            event.accept()
            return
        super().mousePressEvent(event)

    def _menu(self, pos) -> None:
        item = self.itemAt(pos)
        if item is None:
            return
        chat_id = int(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        models = self._models.get(chat_id, [])
        if len(models) > 1:  # the server serves several: the new chat's model is picked here
            sub = menu.addMenu("New chat on this server")
            new = {sub.addAction(m): m for m in models}
        else:
            new = {menu.addAction("New chat on this server"): ""}
        close = menu.addAction("Delete this chat")
        close.setToolTip("Deletes it from the history (its messages go; the server keeps nothing of it)")
        chosen = menu.exec(self.mapToGlobal(pos))
        if chosen in new:
            self.new_requested.emit(chat_id, new[chosen])
        elif chosen is close:
            self.close_requested.emit(chat_id)


BURST_NOTE = "its tokens arrived in one burst (buffered on the way): the decode speed cannot be measured here"


def measured_speed(reply) -> float | None:
    """The reply's decode tok/s as this client saw the chunks arrive; None when they came in one burst — in one or
    two socket reads (``Reply.in_one_burst``): the server's pace is not in their arrival times then, and n / ~0 s
    would be a nonsense figure. (It judged by speed, chunks under 1 ms apart on average: stories260K served on its
    compiled step streams a token every ~0.8 ms, one read each, and was called a burst.)"""
    return None if reply.in_one_burst else reply.decode_tokens_per_s


def budget_note(budget) -> str:
    """A reply's max_tokens lowered to the server's context (``engine.remote.budget.TokenBudget``), in one line."""
    asked = f"{CONTROLS['max_new_tokens'].name} {budget.asked:,}"
    fits = (f"the {budget.room:,} that fit after the {budget.prompt_tokens:,}-token prompt" if budget.room is not None
            else "what fits after the prompt")
    return f"The server's context holds {budget.context:,} tokens: {asked} was lowered to {fits}"


def _worth_a_note(account) -> bool:
    """Something was reused, or a reason other than new tokens stopped it (a first prompt's "never stored" is
    no news)."""
    first = account.misses[0] if account.misses else None
    return first is not None and (first.start > 0 or first.reason.value != "new")


def reply_stats(reply, reason: str) -> dict:
    """What shows under a remote reply: speed, TTFT, tokens, how it stopped, what the prefix cache reused."""
    stats = {"stop_reason": reason, "generated_tokens": max(len(reply.token_ids), len(reply.token_times))}
    speed = measured_speed(reply)
    if speed is None:
        stats["notes"] = [BURST_NOTE]
    elif speed:
        stats["decode_tokens_per_s"] = round(speed, 2)
    if reply.budget is not None:
        stats["notes"] = [*stats.get("notes", []), budget_note(reply.budget)]
    if reply.ttft_s is not None:
        stats["ttft_ms"] = round(reply.ttft_s * 1e3, 1)
    prompt = int(reply.usage.get("prompt_tokens") or 0)
    if prompt:  # the server's prefix cache: cached_tokens of the prompt were not computed again
        cached = reply.cached_tokens
        stats.update(reused_tokens=cached, recomputed_tokens=prompt - cached, first_divergence=cached if cached else -1)
    if reply.cache is not None:  # why the rest was computed (engine.remote.why): the footer's line, the misses
        a = reply.cache  # its reused tokens are the server's cached_tokens when it reports them
        stats.update(reused_tokens=a.reused, recomputed_tokens=a.recomputed, cache=account_dict(a),
                     first_divergence=a.misses[0].start if a.misses else -1, cache_line=account_line(a))
        if _worth_a_note(a) and not footer_line(stats):  # the footer says nothing of new tokens: a note does
            stats["notes"] = [*stats.get("notes", []), stats["cache_line"]]
    if reply.error:
        stats["error"] = reply.error
    return stats
