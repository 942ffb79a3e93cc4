"""Settings ▸ Settings… on the real window and engine: the server's port, other machines (opt-in, API keys),
speculation's auto-off, new chats' system prompt; each applied from the dialog and seen by its owner and the INI
file. ``--model demo`` is remembered as the last model."""

from __future__ import annotations

import configparser
import socket

import httpx
from app_helpers import close_window, open_window

from app.main import parse_args

DEADLINE_MS = 60_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ini(window) -> configparser.ConfigParser:
    """The settings file as another program would read it (after the app synced it)."""
    window.settings.sync()
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(window.settings.path)
    return parser


def open_from_menu(qtbot, w):
    w.menu_actions["settings"].trigger()
    dialog = w.settings_dialog
    qtbot.waitUntil(dialog.isVisible)
    return dialog


def test_a_new_port_applied_while_serving_moves_the_server(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    first, second = free_port(), free_port()
    w.settings.set("server/port", first)
    try:
        with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS):
            w.menu_actions["serve_start"].trigger()
        dialog = open_from_menu(qtbot, w)
        page = dialog.server
        assert dialog.tabs.currentWidget() is page and page.port.value() == first
        assert page.port_line.text() == f"KV Scope serves here now: http://127.0.0.1:{first}/v1"
        assert not page.host.isEnabled() and not page.warning.isVisible()  # this machine only, by default
        page.port.setValue(second)
        assert page.port_line.text() == f"Port {second} is free: Start serving listens at http://127.0.0.1:{second}/v1"
        with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS,
                              check_params_cb=lambda url: url == f"http://127.0.0.1:{second}"):
            dialog.apply_button.click()
        assert w.server.url == f"http://127.0.0.1:{second}" and w.status.server.text().endswith(f":{second}/v1")
        assert ini(w)["server"]["port"] == str(second)
        assert httpx.get(f"http://127.0.0.1:{second}/health", timeout=10).status_code == 200
        with socket.socket() as s:  # the old port is free again
            s.bind(("127.0.0.1", first))
        dialog.accept()
        assert not dialog.isVisible()
    finally:
        close_window(w)


def test_a_busy_port_gets_one_line_and_a_way_to_another(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    busy = holder.getsockname()[1]
    try:
        w.settings.set("server/port", busy)  # as if another program took 8000 since the last start
        with qtbot.waitSignal(w.error_shown, timeout=DEADLINE_MS) as err:
            w.menu_actions["serve_start"].trigger()
        assert err.args[0] == f"The server did not start: port {busy} is in use by another program."
        buttons = w.chat.notice.action_buttons
        assert [b.text() for b in buttons] == ["Choose another port…"]
        buttons[0].click()  # the notice's way on: the dialog, on its Server page
        dialog = w.settings_dialog
        page = dialog.server
        assert dialog.isVisible() and dialog.tabs.currentWidget() is page
        assert page.port_line.text() == f"Port {busy} is in use by another program: pick another (Find a free port)."
        other = free_port()
        page.port.setValue(other)
        page.port.setValue(busy + 1 if busy + 1 != other else busy + 2)  # a typed port
        holder2 = socket.socket()  # ...that is busy too: Apply refuses it, saying why
        holder2.bind(("127.0.0.1", 0))
        holder2.listen()
        page.port.setValue(holder2.getsockname()[1])
        assert not dialog.apply()
        assert page.problem_line.isVisible() and "is in use by another program" in page.problem_line.text()
        assert ini(w)["server"]["port"] == str(busy)  # nothing applied
        holder2.close()
        page.find_port.click()
        chosen = page.port.value()
        assert chosen != busy and page.port_line.text().startswith(f"Port {chosen} is free")
        dialog.accept()
        assert not dialog.isVisible() and ini(w)["server"]["port"] == str(chosen)
        with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS) as started:
            w.menu_actions["serve_start"].trigger()
        assert started.args[0] == f"http://127.0.0.1:{chosen}"
    finally:
        holder.close()
        close_window(w)


def test_other_machines_need_the_opt_in_and_a_key(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    port = free_port()
    w.settings.set("server/port", port)
    try:
        dialog = open_from_menu(qtbot, w)
        page = dialog.server
        page.host.setText("0.0.0.0")
        assert page.address().listen_host == "127.0.0.1"  # a typed address is not used without the opt-in
        page.remote.setChecked(True)
        assert page.host.isEnabled() and page.warning.isVisible() and "plain HTTP" in page.warning.text()
        assert page.problem_line.text() == ("Other machines may connect only with an API key: type one (or more) "
                                            "under API keys.")
        assert not dialog.apply() and w.settings.get("server/remote") is False  # nothing applied
        page.keys.setText("s3cret, second-key")
        assert page.problem_line.isHidden()
        assert dialog.apply()
        saved = ini(w)["server"]
        assert (saved["remote"], saved["host"]) == ("true", "0.0.0.0")
        assert w.server.address.api_keys == ("s3cret", "second-key") and w.server.address.listen_host == "0.0.0.0"
        with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS) as started:
            w.menu_actions["serve_start"].trigger()
        assert started.args[0] == f"http://0.0.0.0:{port}"
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        ok = httpx.get(base + "/v1/models", timeout=10, headers={"Authorization": "Bearer second-key"})
        assert ok.status_code == 200 and ok.json()["data"]
        page.remote.setChecked(False)  # back to this machine only: the server moves there
        with qtbot.waitSignal(w.server.serving, timeout=DEADLINE_MS,
                              check_params_cb=lambda url: url == f"http://127.0.0.1:{port}"):
            dialog.apply_button.click()
        assert ini(w)["server"]["remote"] == "false"
    finally:
        close_window(w)


def test_auto_off_and_the_new_chats_system_prompt(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        assert w.speculation.applied.auto_off
        dialog = open_from_menu(qtbot, w)
        dialog.tabs.setCurrentWidget(dialog.speculation)
        assert dialog.speculation.auto_off.isChecked()
        dialog.speculation.auto_off.setChecked(False)
        dialog.chats.system_prompt.setText("You tell short stories.")
        with qtbot.waitSignal(w.speculation.changed, timeout=DEADLINE_MS) as applied:  # after the worker applied it
            dialog.accept()
        assert applied.args[0].auto_off is False and w.speculation.applied.auto_off is False
        assert w.spec_controls.config().auto_off is False  # the dock's next change keeps it
        assert ini(w)["spec"]["auto_off"] == "false"
        assert ini(w)["chat"]["system_prompt"] == "You tell short stories."
        w.menu_actions["new"].trigger()
        assert w.chat.system_prompt.text() == "You tell short stories."
        assert w.history.chat(w.chat_id).system_prompt == "You tell short stories."
        w.sampling.temperature.setValue(1.7)
        w.menu_actions["settings"].trigger()
        w.settings_dialog.chats.restore.click()
        assert w.sampling.temperature.value() == 0.7 and w.settings.get("sampling/temperature") == 0.7
    finally:
        close_window(w)


def test_model_demo_is_remembered_and_a_stand_in_is_not(qtbot, data_dir):
    args = parse_args(["--model", "demo", "--data-dir", str(data_dir)])
    w = open_window(qtbot, data_dir, args.model)
    try:
        assert w.info.is_demo and w.settings.get("model/last") == "demo"
        assert w.settings.get("model/recent") == []  # the demo has its own line in Recent models
    finally:
        close_window(w)
    w2 = open_window(qtbot, data_dir, parse_args(["--data-dir", str(data_dir)]).model)  # no --model: the last one
    try:
        assert w2.model_source == "demo" and w2.info.is_demo
    finally:
        close_window(w2)
    missing = data_dir / "no such model"
    w3 = open_window(qtbot, data_dir, str(missing))  # fails; stories260K opens in its place
    try:
        assert w3.info.name == "stories260K"
        assert w3.settings.get("model/last") == "demo"  # the stand-in was not chosen: still the last choice
    finally:
        close_window(w3)
