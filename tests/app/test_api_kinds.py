"""An agent's API conversation on the page map: its tool calls and tool results are their own kinds on the token
strip's top row, coloured and named like system / user / assistant messages, with a legend entry each, and a token's
hover line names its message ("tool result 1") — the real window serving a random Qwen2 over Qwen2.5's tokenizer and
published template, the official openai client, a grammar-forced call."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from PySide6.QtWidgets import QDockWidget
from app_helpers import close_window, open_window
from table_checks import shoot
from test_server_menu import free_port, start_serving

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from tool_models import save_qwen_folder  # noqa: E402  (tests/engine's tool models)

from transformers import AutoTokenizer  # noqa: E402

from app.panels.strip import KIND_COLOURS  # noqa: E402
from engine.server.render import spans as message_spans  # noqa: E402
from engine.server.schemas import parse_chat  # noqa: E402

SEARCH = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}}, "required": ["q"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "weather"}'}}
MESSAGES = [{"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees, light wind from the west."}]


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return save_qwen_folder(tmp_path_factory.mktemp("qwen-tools"))


def test_tool_calls_and_results_are_their_own_kinds_on_the_token_strip(qtbot, data_dir, qwen_folder):
    w = open_window(qtbot, data_dir, str(qwen_folder))
    w.settings.set("server/port", free_port())
    try:
        url = start_serving(qtbot, w)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        qtbot.waitUntil(lambda: w.api_list.count() == 1, timeout=60_000)
        w.api_list.setCurrentRow(0)
        qtbot.waitUntil(lambda: w.page_map.snapshot is not None and bool(w.page_map.snapshot.messages),
                        timeout=60_000)
        snap = w.page_map.snapshot
        req = parse_chat({"model": "m", "messages": MESSAGES, "tools": TOOLS})  # the messages as the server reads them
        spans = message_spans(AutoTokenizer.from_pretrained(qwen_folder), req.messages, req.tools)
        kinds = [m[2] for m in snap.messages]
        assert kinds == ["system", "user", "tool_call", "tool_result", "reply"]
        assert [m[:2] for m in snap.messages[:4]] == spans  # where the template puts each message
        assert snap.messages[-1][1] == len(snap.token_state)  # the reply runs to the conversation's last token
        assert snap.messages[-1][0] < r.usage.prompt_tokens < snap.messages[-1][0] + 8  # after the reply's header
        # the strip's top row: each message in its kind's colour
        image = w.page_map.strip.image
        assert image.shape[0] == w.page_map.strip_rows >= 2
        for a, b, kind, _n in snap.messages:
            rgb = np.array([int(KIND_COLOURS[kind][i:i + 2], 16) for i in (1, 3, 5)])
            assert (image[-1, a:b, :3] == rgb).all(), kind
        legend = w.page_map.reuse_legend.text()
        assert w.page_map.reuse_legend.isVisibleTo(w.page_map)
        for name in ("system prompt", "user", "tool call", "tool result", "the latest reply"):
            assert name in legend, legend
        a, b = snap.messages[3][:2]
        said = w.page_map.describe_token((a + b) // 2)
        assert f"tool result 1 (tokens {a:,}–{b - 1:,})" in said, said
        assert "tool call 1" in w.page_map.describe_token(snap.messages[2][0])
        w.resize(1280, 720)
        dock = w.page_map
        while not isinstance(dock, QDockWidget):
            dock = dock.parentWidget()
        dock.raise_()
        qtbot.wait(300)
        shoot(w, "api-kinds-1280.png")
    finally:
        close_window(w)
