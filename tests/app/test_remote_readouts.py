"""The readouts that describe what is on screen say so in the server's words while a remote chat is shown — the
page map's legend, hover and "?" help, the status bar's model, device, cache, context and speed fields — and give
the local chat's back exactly when it returns (real window, real ``python -m engine serve``)."""

from __future__ import annotations

import pytest
from app_helpers import close_window, open_window, wait_reply
from PySide6.QtWidgets import QStatusBar, QWidget
from test_remote_app import Server, connect, send

from app.ground.status_bar import LOCAL_FIELDS
from engine.config import SamplingConfig

LOCAL_TOKEN_WORDS = ("sink", "quantized", "pinned", "evicted")  # strip states a remote chat's strip never has


@pytest.fixture
def server(stories_path):
    srv = Server(stories_path)
    yield srv
    srv.kill()


def fields(status) -> dict:
    """Each status field as seen: text, tooltip set on purpose, colour, shown or not."""
    return {n: (getattr(status, n).text(), getattr(status, n).explicit_tip, getattr(status, n).styleSheet(),
                not getattr(status, n).isHidden()) for n in LOCAL_FIELDS}


def legends(page_map) -> tuple[str, str]:
    return page_map.legend.text(), page_map.strip_legend.text()


def settled(qtbot, w) -> dict:
    """The status fields once two reads 300 ms apart agree (the panels' last frame after a reply is queued)."""
    seen = [fields(w.status)]

    def same() -> bool:
        qtbot.wait(300)
        seen.append(fields(w.status))
        return seen[-1] == seen[-2]

    qtbot.waitUntil(same, timeout=60_000)
    return seen[-1]


def help_text(qtbot, w) -> str:
    w.page_map.help_button.click()
    qtbot.wait(10)
    dialogs = [d for d in w.findChildren(QWidget) if d.objectName() == "panelHelp" and d.isVisible()]
    text = dialogs[-1].findChild(QWidget, "helpText").text()
    for d in dialogs:
        d.close()
    return text


def check_remote_readouts(qtbot, w, rc, port: int) -> None:
    """While the remote chat is on screen: the server's words, never the local chat's."""
    legend, strip = legends(w.page_map)
    for word in ("blocks:", "this chat", "other requests", "free", "evicted"):
        assert word in legend
    assert "pages:" not in legend and "active (by turn)" not in legend and "restored from disk" not in legend
    assert "this chat's tokens" in strip and not any(word in strip for word in LOCAL_TOKEN_WORDS)
    assert "block of the server's KV cache" in help_text(qtbot, w)

    s = w.status
    assert s.model.text() == f"⇄ stories260K @ 127.0.0.1:{port}" and s.device.text() == "on the server"

    def cache_said(text: str):  # /metrics is polled on the link's thread
        def said() -> bool:
            w.remote.draw(force=True)
            return s.cache.text() == text
        return said

    # engine serve says its pool's size once a request made it (vLLM allocates it at start)
    qtbot.waitUntil(cache_said("server cache: block size 16 · prefix caching on"), timeout=60_000)
    assert s.context.text() == "Context: —" and s.speed.text() == ""  # no reply yet: nothing of the local chat's
    assert send(qtbot, w, "Once upon a time") == "max_tokens"
    qtbot.waitUntil(cache_said("server cache: block size 16 · 2,048 blocks · prefix caching on"), timeout=60_000)
    n = len(rc.reply.prompt_ids) + len(rc.reply.token_ids)
    assert n == len(rc.ids) == rc.reply.usage["total_tokens"]
    assert s.context.text() == f"Context: {n:,} tokens" and "of 512" not in s.context.text()
    assert s.context.styleSheet() == "" and f"({len(rc.reply.prompt_ids):,} tokens)" in s.context.toolTip()
    from app.remote.chat_list import measured_speed

    speed = measured_speed(rc.reply)
    assert s.speed.text() == (f"{speed:.1f} tokens/s" if speed else "") and s.speed.isHidden() == (not speed)
    def drawn_as_this_chat() -> bool:  # the reply's KV events come on the subscriber's thread
        w.remote.draw(force=True)
        return w.page_map.describe_page(0).startswith("block 0 · this chat · 16 tokens")

    qtbot.waitUntil(drawn_as_this_chat, timeout=60_000)
    assert w.page_map.describe_token(0).endswith("in its cached blocks")


def test_remote_readouts_say_the_servers_words_and_give_the_local_ones_back(qtbot, data_dir, stories_path, server):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12))
    try:
        w.send("Once upon a time")  # a local reply: context, speed and a coloured legend to give back
        assert wait_reply(qtbot, w)[1]
        local_chat, local_legends = w.chat_id, legends(w.page_map)
        before = settled(qtbot, w)
        assert "of 512" in before["context"][0] and before["speed"][0].endswith("tokens/s")
        assert before["model"][0] == "Model: stories260K"
        local_help = help_text(qtbot, w)

        rc = connect(qtbot, w, server.url)
        assert w.remote.current is rc and w.status.remote
        check_remote_readouts(qtbot, w, rc, server.port)

        w.chat_list.setCurrentRow(w.chat_list.chat_ids().index(local_chat))  # the local chat comes back
        assert w.remote.current is None and w.chat_id == local_chat and not w.status.remote
        assert legends(w.page_map) == local_legends and help_text(qtbot, w) == local_help
        assert w.page_map.help_key == "" and not w.page_map.remote
        assert fields(w.status) == before  # at once: what was kept
        assert settled(qtbot, w) == before  # and after the local chat is described again

        w.remote.list.setCurrentRow(0)  # the remote chat again: its own words, its last reply's tokens
        n = len(rc.ids)
        assert w.status.context.text() == f"Context: {n:,} tokens" and "blocks:" in legends(w.page_map)[0]
        w.new_chat()  # a new local chat: the local words, its own (empty) context
        assert legends(w.page_map) == local_legends and w.status.model.text() == before["model"][0]
        new = settled(qtbot, w)
        assert new["context"][0] == "Context: 0 of 512 tokens" and new["speed"][0] == ""
        assert all(new[k] == before[k] for k in ("model", "device", "cache"))
    finally:
        close_window(w)
        w.close()


def test_local_news_while_a_remote_chat_is_shown_is_what_comes_back(qtbot):
    """Local updates while remote fields are shown leave them on screen and are what ``show_local`` gives back:
    texts, tooltips, the context field's colour and warning level, visibility."""
    from app.ground.status_bar import CONTEXT_FULL, StatusBar

    bar = QStatusBar()
    qtbot.addWidget(bar)
    s = StatusBar(bar)
    s.show_model("stories260K", "/models/stories260K", "cpu")
    s.show_context(100, 512, "stop")
    s.show_speed(42.0)
    remote = {"model": ("⇄ m @ h:1", "tip m"), "device": ("on the server", "tip d"),
              "context": ("Context: 7 tokens", "tip c")}
    s.show_remote(remote)
    assert s.remote and s.model.text() == "⇄ m @ h:1" and s.model.toolTip() == "tip m"
    assert s.cache.isHidden() and s.speed.isHidden() and not s.context.isHidden()

    s.show_context(500, 512, "stop")  # the local chat's news: kept for later, the remote words stay
    s.show_speed(0)
    s.show_model("other", "/models/other", "cpu")
    s.set_loading(True, "next")
    assert s.model.text() == "⇄ m @ h:1" and s.context.text() == "Context: 7 tokens"
    assert s.context.styleSheet() == "" and s.context.level == "" and s.speed.isHidden()
    s.show_remote(remote)  # a redraw: still what was kept before it
    s.set_loading(False)

    s.show_local()
    assert not s.remote and s.model.text() == "Loading next…" and s.model.toolTip() == "/models/other"
    assert s.context.text() == "Context: 500 of 512 tokens" and s.context.level == "full"
    assert CONTEXT_FULL in s.context.styleSheet() and "500 of the model's 512" in s.context.toolTip()
    assert s.speed.text() == "" and not s.speed.isHidden() and s.device.text() == "on CPU"
    s.show_local()  # twice: nothing more
    assert s.model.text() == "Loading next…"


def test_the_page_map_legend_round_trips(qtbot):
    """``set_legend_mode``: the remote words, then the local legend exactly as built (no server needed)."""
    from app.shell.help import PANEL_HELP, show_panel_help
    from app.panels.page_map import PageMapPanel

    panel = PageMapPanel()
    qtbot.addWidget(panel)
    local = legends(panel)
    panel.set_legend_mode("remote")
    assert legends(panel) != local and panel.legend.text().startswith("blocks:")
    dlg = show_panel_help(panel)
    assert PANEL_HELP["RemotePageMap"].text[:60] in dlg.findChild(QWidget, "helpText").text()
    dlg.close()
    panel.set_legend_mode("local")
    assert legends(panel) == local and panel.help_key == ""
    dlg = show_panel_help(panel)
    assert PANEL_HELP["PageMapPanel"].text[:60] in dlg.findChild(QWidget, "helpText").text()
    dlg.close()
