"""The window's menus and shortcuts (the list in Help ▸ Keyboard shortcuts is ``app.shell.help.SHORTCUTS``)."""

from __future__ import annotations

from typing import Any

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMenu

from app.ground.docks import DOCKS
from app.remote.chat import open_connect
from app.shell.settings_dialog import open_settings


def _action(window, text: str, slot, shortcut: Any = None, tip: str = "", **kw) -> QAction:
    act = QAction(text, window, **kw)
    if shortcut is not None:
        act.setShortcut(QKeySequence(shortcut))
    if tip:
        act.setToolTip(tip)
        act.setStatusTip(tip)
    if kw.get("checkable"):
        act.toggled.connect(slot)
    else:
        act.triggered.connect(slot)
    window.addAction(act)  # shortcuts work wherever the focus is, also with the menu bar hidden
    return act


def build_menus(window) -> dict[str, Any]:
    """File, View, Tools, Settings, Server and Help for ``window`` (a ``MainWindow``); returns the actions tests and the
    window use, by name."""
    bar = window.menuBar()
    a: dict[str, Any] = {}
    for build in (_file_menu, _view_menu, _tools_menu, _settings_menu, _server_menu, _help_menu):
        build(window, bar, a)
    return a


def _file_menu(window, bar, a: dict[str, Any]) -> None:
    file_menu = bar.addMenu("&File")
    a["models"] = _action(window, "&Models…", window.models.open_models_dialog, "Ctrl+M")
    a["open"] = _action(window, "&Open model folder…", window.models.open_folder, QKeySequence.StandardKey.Open)
    file_menu.addActions([a["models"], a["open"]])
    a["recent"] = recent = file_menu.addMenu("&Recent models")
    recent.aboutToShow.connect(lambda: window.models.fill_recent_menu(recent))
    a["new"] = _action(window, "&New chat", window.new_chat, QKeySequence.StandardKey.New)
    file_menu.addAction(a["new"])
    a["connect"] = _action(window, "&Connect to a server…", lambda: open_connect(window),
                           tip="Chat with a model on an OpenAI-compatible server (vLLM, engine serve) and draw its "
                               "KV cache from the server's events")
    file_menu.addAction(a["connect"])
    file_menu.addSeparator()
    export: QMenu = file_menu.addMenu("&Export")
    ex = window.exporter
    export.addAction(_action(window, "This chat's cache trace as &JSON…", lambda: ex.export_trace("json")))
    export.addAction(_action(window, "This chat's cache trace as &CSV…", lambda: ex.export_trace("csv")))
    export.addAction(_action(window, "Panels as &PNG…", ex.export_pngs))
    export.addAction(_action(window, "Chat as &Markdown…", ex.export_chat))
    file_menu.addSeparator()
    file_menu.addAction(_action(window, "&Quit", window.close, QKeySequence.StandardKey.Quit))


def _view_menu(window, bar, a: dict[str, Any]) -> None:
    view = bar.addMenu("&View")
    # one entry a panel, named as its title; "Why recomputed?" shows its readout in front (it sits tabbed behind
    # Timing, where its dock's own show / hide entry did nothing visible; the menu listed it twice, under two names)
    a["why"] = _action(window, dict(DOCKS)["why"], window.show_why,
                       tip="The last prompt of this chat: which tokens were computed instead of reused, and why")
    for key, dock in window.docks.items():
        view.addAction(a["why"] if key == "why" else dock.toggleViewAction())
    view.addSeparator()
    a["panels"] = _action(window, "Live panels", window.set_panels_enabled, checkable=True,
                          checked=window.scheduler.enabled,
                          tip="Redraw the panels while the model talks (off: they pause and say so)")
    view.addAction(a["panels"])
    view.addAction(_action(window, "Reset layout", window.layout_docks.arrange))
    view.addAction(_action(window, "Focus the message box", window.chat.input.setFocus, "Ctrl+L"))


def _tools_menu(window, bar, a: dict[str, Any]) -> None:
    tools = bar.addMenu("&Tools")
    a["compare"] = _action(window, "&Compare cache settings on this chat…", window.open_compare, "Ctrl+K")
    tools.addAction(a["compare"])
    a["regenerate"] = _action(window, "&Regenerate the last reply", window.on_screen.regenerate, "Ctrl+R")
    tools.addAction(a["regenerate"])
    tools.addSeparator()
    a["fast_step"] = _action(window, "Compiled &decode step", window.set_fast_step, checkable=True,
                             checked=bool(window.settings.get("engine/fast_step")),
                             tip="Compile the model's decode step in the background (eager answers meanwhile) and "
                                 "use it where it measures faster; the timing panel says which ran each token")
    tools.addAction(a["fast_step"])


def _settings_menu(window, bar, a: dict[str, Any]) -> None:
    settings = bar.addMenu("S&ettings")
    a["settings"] = _action(window, "&Settings…", lambda: open_settings(window, "server"), "Ctrl+,",
                            tip="The server's port, address and API keys, speculation's auto-off, the KV disk cache, "
                                "quantized copies and what new chats start with")
    a["kv_disk"] = _action(window, "&KV disk cache…", lambda: open_settings(window, "disk"),
                           tip="Keep the chats' KV cache on disk (on/off, budget, location, Clear), so a chat reopened "
                               "after a restart is restored instead of read again")
    a["quant_copies"] = _action(window, "&Quantized copies…", lambda: open_settings(window, "copies"),
                                tip="Keep the 8-bit / 4-bit weights a model folder was quantized to at its first load "
                                    "(on/off, budget, location, Clear), so the next load maps them instead")
    settings.addActions([a["settings"], a["kv_disk"], a["quant_copies"]])


def _server_menu(window, bar, a: dict[str, Any]) -> None:
    server = bar.addMenu("&Server")
    a["serve_start"] = _action(window, "&Start serving", window.server.start,
                               tip="Serve the loaded model as an OpenAI API (on 127.0.0.1 unless Settings ▸ Server "
                                   "lets other machines in); you go on chatting: your chat runs first, the API's "
                                   "requests beside it")
    a["serve_stop"] = _action(window, "S&top serving", lambda: window.server.stop(), tip="Stop the API server")
    a["serve_stop"].setEnabled(False)
    a["serve_settings"] = _action(window, "Server s&ettings…", lambda: open_settings(window, "server"),
                                  tip="Port, other machines, API keys")
    server.addActions([a["serve_start"], a["serve_stop"]])
    server.addSeparator()
    server.addAction(a["serve_settings"])
    window.server.choose_address = a["serve_settings"].trigger  # a start refused: its notice's way to another port


def _help_menu(window, bar, a: dict[str, Any]) -> None:
    help_menu = bar.addMenu("&Help")
    a["what"] = _action(window, "What am I seeing?", window.show_help, "F1")
    a["shortcuts"] = _action(window, "Keyboard shortcuts", window.show_shortcuts)
    help_menu.addActions([a["what"], a["shortcuts"]])
    help_menu.addSeparator()
    help_menu.addAction(_action(window, "About KV Scope", window.about))
