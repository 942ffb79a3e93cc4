"""The list of chats (newest first), with rename and delete from the context menu.

Titles are plain text (a first message's Markdown is stripped); chats with the same title are told apart
by when they were started; a chat whose reply is still being written says so.
"""

from __future__ import annotations

import re
import time
from collections import Counter

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtWidgets import QInputDialog, QListWidget, QListWidgetItem, QMenu, QMessageBox, QWidget

from app.history.store import Chat


_MARKUP = re.compile(r"`{1,3}|\*{1,3}|_{2,3}|~~|^#{1,6}\s+|^>\s*|^\s*(?:[-+*]|\d+[.)])\s+", re.MULTILINE)
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
REPLYING = " — replying…"


def title_from(text: str, limit: int = 40) -> str:
    """A chat title from its first message: plain text (no Markdown), one line, at most ``limit`` long."""
    plain = _MARKUP.sub("", _LINK.sub(r"\1", text))
    line = " ".join(plain.split()) or "New chat"
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def display_titles(chats: list[Chat]) -> dict[int, str]:
    """Each chat's title in the list; chats with the same title get the date and time they started."""
    counts = Counter(c.title or "New chat" for c in chats)
    out = {}
    for c in chats:
        title = c.title or "New chat"
        if counts[title] > 1:
            title += " · " + time.strftime("%b %d %H:%M", time.localtime(c.created))
        out[c.id] = title
    seen = Counter(out.values())  # started in the same minute: the chat number settles it
    return {cid: t + (f" (#{cid})" if seen[t] > 1 else "") for cid, t in out.items()}


class ChatList(QListWidget):
    """Shows ``Chat`` rows; emits ``chat_selected(id)``, ``rename_requested``, ``delete_requested``."""

    chat_selected = Signal(int)
    rename_requested = Signal(int, str)
    delete_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ChatList")
        self._filling = False
        self.busy: int | None = None  # the chat whose reply is being written (shown as "replying…")
        self.model = ""  # the model loaded now: a chat another model wrote is marked with that model's name
        self._chats: list[Chat] = []
        self._current: int | None = None
        self.currentItemChanged.connect(self._on_current)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setUniformItemSizes(True)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        return QSize(220, 140)  # four or five chats; the list scrolls

    def set_busy(self, chat_id: int | None) -> None:
        """Mark the chat whose reply is being written (None: no reply runs)."""
        if chat_id != self.busy:
            self.busy = chat_id
            self.set_chats(self._chats, self._current)

    def set_model(self, name: str) -> None:
        """The model loaded now (chats another model wrote are marked with theirs)."""
        if name != self.model:
            self.model = name
            self.set_chats(self._chats, self._current)

    def set_chats(self, chats: list[Chat], current_id: int | None) -> None:
        self._filling = True
        self._chats, self._current = list(chats), current_id
        self.clear()
        titles = display_titles(chats)
        for chat in chats:
            other = chat.model_name if self.model and chat.model_name not in ("", self.model) else ""
            item = QListWidgetItem(titles[chat.id] + (f" · {other}" if other else "")
                                   + (REPLYING if chat.id == self.busy else ""))
            item.setData(Qt.ItemDataRole.UserRole, chat.id)
            started = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.created))
            written = f"\nwritten by {chat.model_name}" if chat.model_name else ""
            item.setToolTip(f"{chat.title}\nstarted {started}{written}")
            self.addItem(item)
            if chat.id == current_id:
                self.setCurrentItem(item)
        self._filling = False

    def select(self, chat_id: int) -> None:
        """Show ``chat_id`` as the chat on screen (without asking to open it)."""
        self._current = chat_id
        ids = self.chat_ids()
        if chat_id in ids and self.currentRow() != ids.index(chat_id):
            self._filling = True
            self.setCurrentRow(ids.index(chat_id))
            self._filling = False

    def deselect(self) -> None:
        """No chat on screen (an API conversation is): no row highlighted, also after the list is filled again;
        clicking the chat that was on screen opens it again."""
        self._current = None
        self._filling = True
        self.setCurrentRow(-1)
        self.clearSelection()
        self._filling = False

    def chat_ids(self) -> list[int]:
        return [self.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.count())]

    def mousePressEvent(self, event) -> None:  # noqa: N802 - Qt name
        if event.button() == Qt.MouseButton.RightButton:  # the menu opens; the chat on screen stays
            event.accept()
            return
        super().mousePressEvent(event)

    def _title(self, chat_id: int) -> str:
        return next((c.title for c in self._chats if c.id == chat_id), "")

    def _on_current(self, item: QListWidgetItem | None, _prev) -> None:
        if item is not None and not self._filling:
            self._current = int(item.data(Qt.ItemDataRole.UserRole))  # kept when the list is filled again
            self.chat_selected.emit(self._current)

    def _menu(self, pos) -> None:
        item = self.itemAt(pos)
        if item is None:
            return
        chat_id = int(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        rename = menu.addAction("Rename…")
        delete = menu.addAction("Delete")
        chosen = menu.exec(self.mapToGlobal(pos))
        if chosen is rename:
            title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=self._title(chat_id))
            if ok and title.strip():
                self.rename_requested.emit(chat_id, title.strip())
        elif chosen is delete:
            if QMessageBox.question(self, "Delete chat", f"Delete “{self._title(chat_id)}”?") == \
                    QMessageBox.StandardButton.Yes:
                self.delete_requested.emit(chat_id)
