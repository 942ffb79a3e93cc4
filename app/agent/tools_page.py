"""Settings ▸ Tools: the MCP servers whose tools chats may call (off by default), and whether the reply to each of
your messages must call one. Each server is a command line that starts a stdio MCP server (``uvx mcp-server-time``,
``npx -y @modelcontextprotocol/server-filesystem ~/notes``, ``python my_server.py``); the line under the table says
the tools each one gives, or why it did not start."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.agent.mcp_hub import ServerSpec

CHOICES = (("auto", "The model decides"), ("first", "Call a tool first (the reply to each of your messages)"))


class ToolsPage(QWidget):
    """``load(settings)``, ``problem()`` (one line, "" when the table can be saved), ``save(settings)`` (True when
    something changed: the servers start again)."""

    def __init__(self, agent=None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.enabled = QCheckBox("Chats may call tools from MCP servers (each call asks you first)")
        self.table = QTableWidget(0, 2)
        self.table.setHorizontalHeaderLabels(["name", "command line (a stdio MCP server)"])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        add, remove = QPushButton("Add server"), QPushButton("Remove")
        add.clicked.connect(lambda: self.add_server("", ""))
        remove.clicked.connect(lambda: self.table.removeRow(self.table.currentRow()))
        self.choice = QComboBox()
        for value, text in CHOICES:
            self.choice.addItem(text, value)
        self.found = QLabel("")
        self.found.setWordWrap(True)
        self.found.setObjectName("hint")
        self.problem_line = QLabel("")
        self.problem_line.setObjectName("problem")
        self.problem_line.setWordWrap(True)
        self.problem_line.setVisible(False)
        row = QHBoxLayout()
        row.addWidget(add)
        row.addWidget(remove)
        row.addStretch(1)
        form = QFormLayout()
        form.addRow("When you send a message", self.choice)
        layout = QVBoxLayout(self)
        layout.addWidget(self.enabled)
        layout.addWidget(self.table, 1)
        layout.addLayout(row)
        layout.addLayout(form)
        layout.addWidget(self.problem_line)
        layout.addWidget(self.found)
        if agent is not None:
            agent.listed.connect(self.show_found)
            self.show_found(agent.tools, agent.problems)

    def add_server(self, name: str, command: str, on: bool = True) -> None:
        r = self.table.rowCount()
        self.table.insertRow(r)
        item = QTableWidgetItem(name)
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
        item.setCheckState(Qt.CheckState.Checked if on else Qt.CheckState.Unchecked)
        self.table.setItem(r, 0, item)
        self.table.setItem(r, 1, QTableWidgetItem(command))

    def load(self, settings) -> None:
        self.enabled.setChecked(bool(settings.get("mcp/enabled")))
        self.table.setRowCount(0)
        for s in settings.get("mcp/servers") or []:
            if isinstance(s, dict):
                self.add_server(str(s.get("name", "")), str(s.get("command", "")), bool(s.get("on", True)))
        i = self.choice.findData(settings.get("mcp/tool_choice"))
        self.choice.setCurrentIndex(max(i, 0))
        self.problem_line.setVisible(False)

    def servers(self) -> list[dict]:
        out = []
        for r in range(self.table.rowCount()):
            name, command = self.table.item(r, 0), self.table.item(r, 1)
            text = (name.text().strip() if name else "", command.text().strip() if command else "")
            if any(text):
                out.append({"name": text[0], "command": text[1],
                            "on": name is None or name.checkState() == Qt.CheckState.Checked})
        return out

    def problem(self) -> str:
        """Why the table cannot be saved (a row without a name or a readable command, a name twice); ""."""
        seen = set()
        for s in self.servers():
            try:
                ServerSpec.from_line(s["name"], s["command"])
            except ValueError as e:
                return str(e)
            if s["name"] in seen:
                return f"{s['name']}: two servers have this name"
            seen.add(s["name"])
        return ""

    def save(self, settings) -> bool:
        values = {"mcp/enabled": self.enabled.isChecked(), "mcp/servers": self.servers(),
                  "mcp/tool_choice": self.choice.currentData()}
        changed = any(settings.get(k) != v for k, v in values.items())
        for k, v in values.items():
            settings.set(k, v)
        return changed

    def show_found(self, tools: list, problems: list) -> None:
        """What the servers gave: 'weather: get_weather, get_forecast · files: read_file' and the problems."""
        by: dict[str, list[str]] = {}
        for t in tools:
            by.setdefault(t.server, []).append(t.name)
        lines = [f"{server}: {', '.join(names)}" for server, names in by.items()]
        self.found.setText("Tools now: " + " · ".join(lines + [f"{p}" for p in problems]) if lines or problems
                           else "No tools now (off, or no server configured).")
