"""A chat in the window runs an agent loop with tools from an MCP server (#50 item 5): a real stdio server written
here with the ``mcp`` package's server, a random Qwen2 over Qwen2.5's tokenizer and published template (its call
forced by the grammar: "Call a tool first"), the real window and engine. The call is shown and waits for the user's
word; Run calls the server, its result joins the chat as a tool message and the model goes on from it (reusing the
cache it fed); Don't run runs nothing and says so to the model; off by default; bad settings are one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from app_helpers import close_window, open_window, wait_reply
from table_checks import shoot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from tool_models import save_qwen_folder  # noqa: E402  (tests/engine's tool models)

from engine.config import SamplingConfig  # noqa: E402

pytest.importorskip("mcp")

SERVER = '''
import json, sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

server = MCPServer("weather")
LOG = sys.argv[1]


@server.tool()
def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """The weather in a city."""
    with open(LOG, "a") as f:
        f.write(json.dumps({"city": city}) + "\\n")
    return f"Sunny in {city}, 21 degrees"


if __name__ == "__main__":
    server.run()
'''
SHORT = SamplingConfig(temperature=0.0, max_new_tokens=48)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return save_qwen_folder(tmp_path_factory.mktemp("qwen-tools"))


@pytest.fixture()
def weather(tmp_path):
    script, log = tmp_path / "weather_server.py", tmp_path / "calls.jsonl"
    script.write_text(SERVER)
    return f'"{sys.executable}" "{script}" "{log}"', log


def _configure(qtbot, w, command: str, choice: str = "first") -> None:
    w.settings.set("mcp/servers", [{"name": "weather", "command": command, "on": True}])
    w.settings.set("mcp/tool_choice", choice)
    w.settings.set("mcp/enabled", True)
    w.agent.configure()
    qtbot.waitUntil(lambda: not w.agent.listing, timeout=60_000)
    assert [t.name for t in w.agent.tools] == ["get_weather"] and w.agent.problems == []


def _call_shown(qtbot, w):
    qtbot.waitUntil(lambda: w.agent.dialog is not None and w.agent.dialog.isVisible(), timeout=60_000)
    return w.agent.dialog


def test_a_chat_calls_an_mcp_tool_after_the_user_says_run_and_goes_on_from_its_result(qtbot, data_dir, qwen_folder,
                                                                                        weather):
    command, log = weather
    w = open_window(qtbot, data_dir, str(qwen_folder), sampling=SHORT)
    try:
        assert not w.settings.get("mcp/enabled") and w.agent.tools == []  # off by default
        _configure(qtbot, w, command)
        w.send("What is the weather in Paris?")
        first = w.generation_id
        dialog = _call_shown(qtbot, w)
        args = json.loads(dialog.arguments.toPlainText())
        assert set(args) == {"city"} and not log.exists()  # shown, and nothing ran before the user's word
        assert "get_weather" in dialog.head.text() and "weather" in dialog.head.text()
        shoot(dialog, "mcp-confirm.png")
        rows = w.history.messages(w.chat_id)
        call = rows[-1].stats["tool_calls"][0]
        assert rows[-1].role == "assistant" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == args
        assert "<tool_call>" not in rows[-1].content  # the call is not shown as text
        with qtbot.waitSignal(w.reply_finished, timeout=60_000,
                              check_params_cb=lambda g, _r: g != first) as went_on:
            dialog.run_button.click()
        assert [json.loads(x) for x in log.read_text().splitlines()] == [args]  # the server ran it, once
        rows = w.history.messages(w.chat_id)
        tool = next(m for m in rows if m.role == "tool")
        assert tool.content == f"Sunny in {args['city']}, 21 degrees"
        assert tool.stats["status"] == "done" and tool.stats["tool_call_id"] == call["id"]
        bubble = next(b for b in w.chat.bubbles if b.role == "tool")
        assert bubble.role_label.text().startswith("Tool · get_weather (weather) · ")
        assert went_on.args[1] in ("max_tokens", "eos")
        before, after = rows[1].stats, rows[-1].stats  # the model went on from the result, reusing all it had fed:
        # the prompt and its call (but the call's last token, never fed), though the template re-renders the call
        assert rows[-1].role == "assistant"
        assert after["reused_tokens"] == before["prompt_tokens"] + before["generated_tokens"] - 1
        assert after["prompt_tokens"] > after["reused_tokens"]  # the result's tokens were read
        qtbot.waitUntil(lambda: "called get_weather" in w.chat.bubbles[1].body.text(), timeout=5_000)  # not "no text"
        assert w.agent.dialog is None
        w.resize(1280, 720)
        qtbot.wait(200)
        shoot(w, "mcp-chat-1280.png")
    finally:
        close_window(w)


def test_dont_run_runs_nothing_tells_the_model_and_stops_the_loop(qtbot, data_dir, qwen_folder, weather):
    command, log = weather
    w = open_window(qtbot, data_dir, str(qwen_folder), sampling=SHORT)
    try:
        _configure(qtbot, w, command)
        w.send("What is the weather in Rome?")
        dialog = _call_shown(qtbot, w)
        dialog.skip_button.click()
        qtbot.wait(300)
        assert not log.exists() and not w.generation_id  # nothing ran, the model did not go on
        tool = w.history.messages(w.chat_id)[-1]
        assert tool.role == "tool" and tool.stats["status"] == "declined" and "declined" in tool.content
        w.send("Thanks anyway.")  # the chat goes on: a declined call keeps its result, the template renders it
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos", "stop_string")
        chat = w.chat_id
    finally:
        close_window(w)
    w = open_window(qtbot, data_dir, str(qwen_folder), sampling=SHORT)  # after a restart: the same chat, read back
    try:
        w.open_chat(chat)
        roles = [b.role for b in w.chat.bubbles]
        assert roles == ["user", "assistant", "tool", "user", "assistant"]
        assert "called get_weather" in w.chat.bubbles[1].body.text()
        assert w.chat.bubbles[2].role_label.text().endswith("declined by you")
        qtbot.waitUntil(lambda: not w.agent.listing and bool(w.agent.tools), timeout=60_000)  # on, as saved
        w.settings.set("mcp/tool_choice", "auto")
        w.send("And tomorrow?")  # the chat's calls and results rendered with the tools, the model free to answer
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos", "stop_string")
        assert w.history.messages(chat)[-1].stats["reused_tokens"] > 0  # the reopened chat's cache, from disk
    finally:
        close_window(w)


def test_the_tools_page_checks_the_servers_and_says_what_each_gives(qtbot, data_dir, qwen_folder, weather):
    from app.shell.settings_dialog import open_settings

    command, _log = weather
    w = open_window(qtbot, data_dir, str(qwen_folder), sampling=SHORT)
    try:
        dlg = open_settings(w, "tools")
        page = dlg.tools
        page.enabled.setChecked(True)
        page.add_server("weather", command)
        page.add_server("broken", 'python "unclosed')
        assert not dlg.apply() and page.problem_line.text().startswith("broken: the command line cannot be read")
        page.table.removeRow(1)
        page.add_server("missing", "/no/such/mcp-server")
        assert dlg.apply()
        qtbot.waitUntil(lambda: "weather: get_weather" in page.found.text(), timeout=60_000)
        assert 'missing: could not start "/no/such/mcp-server": no such program' in page.found.text()
        assert [t.name for t in w.agent.tools] == ["get_weather"]  # the server that started gives its tools
        dlg.close()
    finally:
        close_window(w)


@pytest.mark.slow
def test_the_agent_loop_as_a_state_machine(qtbot, data_dir, qwen_folder, weather):
    """Messages (a call forced or not), Run, Don't run, closing the question and a message sent while it waits, in
    any order: nothing runs without Run (the server's log counts the calls that ran), the question shows exactly
    while a call waits, every call in the chat has one result after it, and the chat stays one the model answers."""
    from hypothesis import settings as hyp_settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

    command, log = weather
    w = open_window(qtbot, data_dir, str(qwen_folder), sampling=SHORT)
    _configure(qtbot, w, command)

    def settled() -> bool:  # no reply runs; a call waits only for the user's word (its question shown)
        return not w.generation_id and (not w.agent.busy or w.agent.dialog is not None)

    class Loop(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            w.new_chat()
            self.ran = len(log.read_text().splitlines()) if log.exists() else 0

        @rule(forced=st.booleans())
        def send(self, forced):
            w.settings.set("mcp/tool_choice", "first" if forced else "auto")
            w.send("What is the weather today?")
            qtbot.waitUntil(settled, timeout=60_000)

        @precondition(lambda self: w.agent.dialog is not None)
        @rule(run=st.booleans())
        def answer(self, run):
            (w.agent.dialog.run_button if run else w.agent.dialog.skip_button).click()
            self.ran += run
            qtbot.waitUntil(lambda: not w.agent.busy, timeout=60_000)
            qtbot.waitUntil(settled, timeout=60_000)

        @precondition(lambda self: w.chat_id is not None)
        @rule()
        def regenerate(self):  # the last reply asked again (a waiting call's message replaced with it)
            w.on_screen.regenerate()  # what the chat's Regenerate button asks
            qtbot.waitUntil(settled, timeout=60_000)

        @precondition(lambda self: w.agent.dialog is not None)
        @rule()
        def close_question(self):
            w.agent.dialog.close()
            qtbot.waitUntil(settled, timeout=60_000)

        @invariant()
        def nothing_runs_unasked_and_every_call_has_its_result(self):
            assert (len(log.read_text().splitlines()) if log.exists() else 0) == self.ran
            shown = w.agent.dialog is not None and w.agent.dialog.isVisible()
            assert shown == w.agent.busy
            if w.agent.busy or w.chat_id is None:
                return
            rows, i = w.history.messages(w.chat_id), 0
            while i < len(rows):
                assert rows[i].role != "tool", rows[i]  # a result stands after its call, never alone
                calls = rows[i].stats.get("tool_calls") or [] if rows[i].role == "assistant" else []
                results = rows[i + 1:i + 1 + len(calls)]
                assert [r.stats.get("tool_call_id") for r in results] == [c["id"] for c in calls], rows[i]
                assert all(r.role == "tool" for r in results)
                i += 1 + len(calls)

    try:
        run_state_machine_as_test(Loop, settings=hyp_settings(max_examples=4, stateful_step_count=6, deadline=None))
    finally:
        close_window(w)


def test_a_model_whose_template_takes_no_tools_answers_without_them_and_says_so(qtbot, data_dir, stories_path,
                                                                               weather):
    command, _log = weather
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SHORT)
    try:
        _configure(qtbot, w, command, choice="auto")
        w.send("Once upon a time")
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
        reply = w.history.messages(w.chat_id)[-1]
        assert reply.content and "tool_calls" not in reply.stats
        assert any("takes no tools" in n for n in reply.stats.get("notes", [])), reply.stats.get("notes")
    finally:
        close_window(w)
