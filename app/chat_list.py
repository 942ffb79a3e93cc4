"""The list of chats (newest first), with rename and delete from the context menu."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QInputDialog, QListWidget, QListWidgetItem, QMenu, QMessageBox, QWidget

from app.history import Chat


class ChatList(QListWidget):
    """Shows ``Chat`` rows; emits ``chat_selected(id)``, ``rename_requested``, ``delete_requested``."""

    chat_selected = Signal(int)
    rename_requested = Signal(int, str)
    delete_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ChatList")
        self._filling = False
        self.currentItemChanged.connect(self._on_current)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setUniformItemSizes(True)
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)

    def set_chats(self, chats: list[Chat], current_id: int | None) -> None:
        self._filling = True
        self.clear()
        for chat in chats:
            item = QListWidgetItem(chat.title or "New chat")
            item.setData(Qt.ItemDataRole.UserRole, chat.id)
            item.setToolTip(chat.title)
            self.addItem(item)
            if chat.id == current_id:
                self.setCurrentItem(item)
        self._filling = False

    def chat_ids(self) -> list[int]:
        return [self.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.count())]

    def _on_current(self, item: QListWidgetItem | None, _prev) -> None:
        if item is not None and not self._filling:
            self.chat_selected.emit(int(item.data(Qt.ItemDataRole.UserRole)))

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
            title, ok = QInputDialog.getText(self, "Rename chat", "Title", text=item.text())
            if ok and title.strip():
                self.rename_requested.emit(chat_id, title.strip())
        elif chosen is delete:
            if QMessageBox.question(self, "Delete chat", f"Delete “{item.text()}”?") == QMessageBox.StandardButton.Yes:
                self.delete_requested.emit(chat_id)
