"""Settings ▸ Server: the port (with a line saying whether it is free, and Find a free port), the opt-in for
other machines (their address and the API keys they must send, with the warning), as a ``ServerAddress``."""

from __future__ import annotations

from PySide6.QtWidgets import (QCheckBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox,
                               QVBoxLayout, QWidget)

from app.server.address import (PortState, ServerAddress, check, describe_port, free_port, parse_keys, port_state,
                                url_for)

WARN, BAD = "#ffb347", "#ff8080"  # the theme's warning orange and error red (app.ground.theme)
REMOTE_WARNING = ("Anyone who can reach this address and has a key can use the model. The server speaks plain HTTP "
                  "(keys and text travel unencrypted) and the keys are kept in plain text in settings.ini: use it on "
                  "networks you trust.")


class ServerPage(QWidget):
    """Edits a ``ServerAddress``; ``problem()`` is the one line that keeps it from being applied ("" if none)."""

    def __init__(self, server, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.server = server  # app.server.controller.ServerController: its address in force, and whether it runs
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setToolTip("The port Server ▸ Start serving listens on")
        self.find_port = QPushButton("Find a free port")
        self.find_port.setToolTip("Pick a port no program uses now")
        self.find_port.clicked.connect(self._find_free)
        port_row = QHBoxLayout()
        port_row.addWidget(self.port)
        port_row.addWidget(self.find_port)
        port_row.addStretch(1)
        self.port_line = QLabel("")
        self.port_line.setObjectName("PortLine")
        self.port_line.setWordWrap(True)
        self.remote = QCheckBox("Let other machines connect (they need an API key)")
        self.remote.setToolTip("Off: only this machine can connect (the server listens on 127.0.0.1)")
        self.host = QLineEdit()
        self.host.setToolTip("The address to listen on: 0.0.0.0 for every network of this machine, or one of its "
                             "addresses")
        self.keys = QLineEdit()
        self.keys.setPlaceholderText("one or more, separated by commas")
        self.keys.setToolTip("Clients send one as \"Authorization: Bearer KEY\"; each key is a tenant of its own (no "
                             "prefix cache is shared between keys). Optional on this machine only.")
        self.warning = QLabel(REMOTE_WARNING)
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet(f"color: {WARN};")
        self.problem_line = QLabel("")
        self.problem_line.setObjectName("errorLine")  # the theme's red
        self.problem_line.setWordWrap(True)
        form = QFormLayout()
        form.addRow("Port", port_row)
        form.addRow("", self.port_line)
        form.addRow(self.remote)
        form.addRow("Address", self.host)
        form.addRow("API keys", self.keys)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.warning)
        layout.addWidget(self.problem_line)
        layout.addStretch(1)
        for signal in (self.port.valueChanged, self.remote.toggled, self.host.textChanged, self.keys.textChanged):
            signal.connect(self._sync)

    def load(self, addr: ServerAddress) -> None:
        """Show ``addr`` (the saved one)."""
        self.port.setValue(addr.port)
        self.remote.setChecked(addr.remote)
        self.host.setText(addr.host)
        self.keys.setText(", ".join(addr.api_keys))
        self._sync()

    def address(self) -> ServerAddress:
        return ServerAddress(self.port.value(), self.remote.isChecked(), self.host.text().strip(),
                             parse_keys(self.keys.text()))

    def port_state(self) -> PortState:
        """FREE also for the port the running server listens on now: it is ours, and Apply stops it first."""
        addr = self.address()
        if self.server.running and self.server.serving_at is not None and self.server.serving_at.port == addr.port:
            return PortState.FREE
        return port_state(addr.listen_host, addr.port)

    def problem(self) -> str:
        """Why this address cannot be applied: a rule it breaks, or a port that cannot be used (an address left as
        saved is applied anyway: its port may be free again when the server starts)."""
        addr = self.address()
        if check(addr):
            return check(addr)
        state = self.port_state()
        if state is not PortState.FREE and addr != self.server.address:
            return describe_port(state, addr.listen_host, addr.port)
        return ""

    def _sync(self) -> None:
        remote = self.remote.isChecked()
        self.host.setEnabled(remote)
        self.warning.setVisible(remote)
        addr = self.address()
        state = self.port_state()
        if self.server.running and self.server.serving_at == addr:
            self.port_line.setText(f"KV Scope serves here now: {self.server.url}/v1")
        elif state is PortState.FREE:
            self.port_line.setText(f"Port {addr.port} is free: Start serving listens at {url_for(addr)}/v1")
        else:
            self.port_line.setText(describe_port(state, addr.listen_host, addr.port))
        self.port_line.setProperty("busy", state is not PortState.FREE)
        self.port_line.setStyleSheet("" if state is PortState.FREE else f"color: {BAD};")
        self.problem_line.setText(check(addr))
        self.problem_line.setVisible(bool(check(addr)))

    def _find_free(self) -> None:
        self.port.setValue(free_port(self.address().listen_host))
