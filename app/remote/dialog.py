"""File ▸ Connect to a server…: the address of an OpenAI-compatible server (vLLM, or another KV Scope's ``engine
serve``), an optional API key and, where the server's ``/kv_event_sources`` does not say, its KV events endpoint.

Connect opens the server on a ``RemoteLink``'s own thread (``app.remote.worker``): reading ``/v1/models``,
``/metrics`` and joining the event stream can take seconds, and a dead address up to the client's timeout, so
the window never waits on it. A failure is one line under the fields and nothing else changes.
"""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.remote.worker import RemoteLink

DEFAULT_URL = "http://127.0.0.1:8000"
last_values = {"url": DEFAULT_URL, "events": ""}  # this session's last entries (the key is never kept)
FIRST_MODEL = "the server's first model"


class ConnectDialog(QDialog):
    """Asks for a server and connects to it off the GUI thread; ``connected(RemoteLink, model)`` once it answered
    and serves the model asked for ('' : its first)."""

    connected = Signal(object, str)

    def __init__(self, parent: QWidget | None = None,
                 known: Callable[[str, str], RemoteLink | None] | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ConnectDialog")
        self.known = known  # (url, key) -> the link already open to that server, if any
        self.setWindowTitle("Connect to a server")
        self.link: RemoteLink | None = None
        self.url = QLineEdit(last_values["url"])
        self.url.setPlaceholderText(DEFAULT_URL)
        self.url.setToolTip("The server's base URL, http:// or https:// (with or without /v1)")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("optional: the server's --api-key")
        self.events = QLineEdit(last_values["events"])
        self.events.setPlaceholderText("optional: e.g. tcp://host:5557")
        self.events.setToolTip("The KV events endpoint, when the server's /kv_event_sources does not say it (a "
                               "tunnelled server: the local end of the tunnel)")
        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.lineEdit().setPlaceholderText(f"optional: {FIRST_MODEL}")
        self.model.setToolTip("Which of the server's models to chat with (GET /v1/models lists them; empty: the "
                              "first)")
        self.error = QLabel("")  # one line; the whole message in its tooltip
        self.error.setObjectName("errorLine")
        self.error.setStyleSheet("color: #ff6b6b")
        self.error.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.error.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        form = QFormLayout()
        form.addRow("Server URL", self.url)
        form.addRow("API key", self.key)
        form.addRow("Model", self.model)
        form.addRow("KV events", self.events)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.connect_button = self.buttons.addButton("Connect", QDialogButtonBox.ButtonRole.AcceptRole)
        self.connect_button.setDefault(True)
        self.buttons.accepted.connect(self.connect_to_server)
        self.buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.error)
        layout.addWidget(self.buttons)
        self.setMinimumWidth(520)

    @property
    def busy(self) -> bool:
        """A connection is being tried."""
        return self.link is not None

    def connect_to_server(self) -> None:
        """Connect (the Connect button): on the link's thread; ``_on_opened`` or ``_on_failed`` follows."""
        if self.busy:
            return
        url = self.url.text().strip()
        if not url:
            self.show_error("Give the server's address, e.g. " + DEFAULT_URL)
            return
        last_values.update(url=url, events=self.events.text().strip())
        self.show_error("")
        open_link = self.known(url, self.key.text().strip()) if self.known is not None else None
        if open_link is not None:  # one link per server: a second one would join its event stream twice
            self._done(open_link)
            return
        self.connect_button.setEnabled(False)
        self.connect_button.setText("Connecting…")
        self.link = RemoteLink()
        self.link.opened.connect(self._on_opened)
        self.link.open_failed.connect(self._on_failed)
        self.link.open(url, self.key.text().strip(), self.events.text().strip())

    def show_error(self, message: str) -> None:
        line = message.splitlines()[0] if message else ""
        self.error.setText(line)
        self.error.setToolTip(line)

    def _idle(self) -> None:
        self.link = None
        self.connect_button.setEnabled(True)
        self.connect_button.setText("Connect")

    def prefill(self, url: str, events: str, model: str) -> None:
        """Fill the fields (a saved chat connecting again); the key is left empty: it was never saved."""
        self.url.setText(url)
        self.events.setText(events)
        self.model.setEditText(model)
        self.key.clear()

    def _done(self, link: RemoteLink) -> bool:
        """The server answered: use it if it serves the model asked for (else say which it serves)."""
        wanted = self.model.currentText().strip()
        served = link.engine.models
        if wanted and wanted not in served:
            self.model.clear()
            self.model.addItems(served)
            self.model.setEditText(wanted)
            self.show_error(f"{link.engine.client.url} does not serve {wanted!r}; it serves: {', '.join(served)}")
            return False
        self.connected.emit(link, wanted)
        self.accept()
        return True

    def _on_opened(self, link: RemoteLink) -> None:
        if link is not self.link:
            return
        self._idle()
        if not self._done(link):
            link.shutdown()

    def _on_failed(self, message: str) -> None:
        link = self.link
        self._idle()
        if link is not None:
            link.shutdown()
        self.show_error(message)

    def reject(self) -> None:
        """Cancel: a connection still being tried is dropped (its thread ends once the attempt does)."""
        link = self.link
        self._idle()
        if link is not None:
            link.abandon()
        super().reject()
