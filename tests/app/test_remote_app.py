"""Remote chats on the real window against a real ``python -m engine serve`` subprocess with KV events on:
File ▸ Connect to a server…, a reply streamed from it (its blocks drawn while it streams and exactly after),
regenerate / edit / Stop, a second chat on the same server, the server killed mid-reply and then gone, started
again on the same ports (backoff, events reconnect), a wrong API key and a closed port (one line in the dialog),
an API conversation taking turns with a remote chat, the window closed mid-reply — and the window usable
throughout. Screenshots at 1280×720 go to $KVSCOPE_SHOTS (default /tmp) as remote_*.png."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from app_helpers import close_window, open_window, wait_reply

from app.ground.docks import on_screen
from app.remote.chat import QUEUED
from app.ground.screen import OnScreen

from engine import snapshot as S
from engine.config import SamplingConfig

REPO = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("KVSCOPE_SHOTS", "/tmp"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``engine serve`` on free ports with ZMQ KV events (and a replay endpoint), page size 16."""

    def __init__(self, model: Path, *extra: str) -> None:
        self.port, ev, replay = free_port(), free_port(), free_port()
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ev}",
               "topic": "kv-events", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}  # this machine only
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", str(self.port),
                     "--page-size", "16", "--kv-events-config", json.dumps(cfg), *extra]
        self.start()

    def start(self) -> None:
        """Start it (again: on the same ports)."""
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine serve exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=1) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError:  # it answers (401 with --api-key)
                return
            except OSError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError("engine serve did not answer in 90 s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
        self.proc.wait(10)


@pytest.fixture
def server(stories_path):
    srv = Server(stories_path)
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def shared_server(stories_path):
    """One server for the tests that neither kill nor restart it (stories260K: its context is 512 tokens)."""
    srv = Server(stories_path)
    yield srv
    srv.kill()


def connect(qtbot, w, url: str):
    """File ▸ Connect to a server…, the URL typed, Connect pressed: the remote chat once the server answered."""
    w.menu_actions["connect"].trigger()
    dialog = w.remote.dialog
    assert dialog.isVisible()
    dialog.url.setText(url)
    with qtbot.waitSignal(w.remote.chat_added, timeout=30_000) as blocker:
        dialog.connect_button.click()
        assert dialog.busy  # Connect returned at once: the attempt runs on the link's thread
    return blocker.args[0]


def send(qtbot, w, text: str, timeout_ms: int = 60_000) -> str:
    w.chat.input.setPlainText(text)
    with qtbot.waitSignal(w.remote.reply_finished, timeout=timeout_ms) as blocker:
        w.chat.submit()
    return blocker.args[1]


def shot(w, name: str) -> None:
    w.resize(1280, 720)
    assert w.minimumSizeHint().height() <= 720, name  # the remote parts never force a taller window
    w.repaint()
    w.grab().save(str(SHOTS / f"remote_{name}.png"))


def active_cells(page_map) -> tuple[int, int]:
    """Cells in the active state, and cells drawn in the active (first turn's) colour."""
    from app.panels.page_map import TURN_COLOURS, _rgb

    colour = _rgb(TURN_COLOURS[0]).astype(np.uint8)
    rgb = page_map.colours[..., :3].reshape(-1, 3)
    return int(np.count_nonzero(page_map.grid == S.PAGE_ACTIVE)), int(np.count_nonzero((rgb == colour).all(axis=1)))


def check_connected(w, rc, port: int) -> None:
    """The remote chat took the screen: its row marked with the server, the local-only controls fixed."""
    assert on_screen(w.page_map)  # the remote view's panel comes to the front
    assert w.remote.current is rc and w.chat_id is None  # the local chat left the screen
    row = w.remote.list.item(0).text()
    assert row.startswith("⇄ stories260K @ 127.0.0.1:") and str(port) in row
    assert w.remote.list.isVisible() and not w.remote.dialog.isVisible()
    lock = w.remote.lock.label
    assert lock.isVisible() and "fixed by the server: block size 16, KV dtype" in lock.text()
    assert not w.controls.mode.isEnabled() and not any(t.isEnabled() for t in w.remote.lock._targets())
    assert not w.menu_actions["compare"].isEnabled()


def check_first_reply(qtbot, w, rc) -> None:
    """A reply streams in as the engine sent it; the page map shows exactly the view's blocks of this chat."""
    assert send(qtbot, w, "Once upon a time") == "max_tokens"
    reply = rc.reply
    assert reply.error is None and reply.text
    assert w.chat.bubbles[-1].text == reply.text == rc.messages[-1].content  # what the engine streamed
    assert "TTFT" in w.chat.bubbles[-1].stats_label.text()
    ids = reply.prompt_ids + reply.token_ids
    assert len(ids) > 16
    view = rc.link.engine.view
    qtbot.waitUntil(lambda: view.snapshots(ids)[0].chat_blocks >= (len(ids) - 1) // 16, timeout=10_000)
    expected = view.snapshots(ids)[0].chat_blocks
    w.remote.draw(force=True)
    assert expected > 0 and active_cells(w.page_map) == (expected, expected)
    assert f"this chat <b>{expected}</b>" in w.page_map.caption.text()
    timing = w.timing.caption.text()
    assert "TTFT" in timing and ("tok/s" in timing or "in one burst" in timing)
    assert w.timing.current.prefill_tokens == len(reply.prompt_ids)  # the first bar: the client's TTFT

    def metrics_in_caption() -> bool:  # /metrics is polled on the link's poll thread; the map may be in a tab
        w.remote.draw(force=True)
        return "prefix cache hit rate 0% (0 of " in w.page_map.readout and "/2048 blocks" in w.page_map.caption.text()

    qtbot.waitUntil(metrics_in_caption, timeout=5000)
    shot(w, "chat")
    w.page_map.grab().save(str(SHOTS / "remote_page_map.png"))


def check_regenerate_switch_edit_stop(qtbot, w, rc, local_chat: int, occupancy_in_front: bool) -> None:
    # the same prompt again (regenerate): the server's prefix cache serves it, and the old reply is a version
    local_before = [(m.role, m.content) for m in w.history.messages(local_chat)]
    with qtbot.waitSignal(w.remote.reply_finished, timeout=60_000):
        w.menu_actions["regenerate"].trigger()  # Tools ▸ Regenerate (Ctrl+R) follows the chat on screen
    assert rc.reply.cached_tokens > 0 and len(rc.messages[-1].stats["versions"]) == 2
    assert "reused" in w.chat.bubbles[-1].cache_label.text()
    # the bubble's own Regenerate too: both act on the remote chat, never on the local one behind it
    with qtbot.waitSignal(w.remote.reply_finished, timeout=60_000):
        w.chat.bubbles[-1].regen_button.click()
    assert len(rc.messages[-1].stats["versions"]) == 3 and w.remote.current is rc
    assert w.on_screen.kind is OnScreen.REMOTE and w.conversation.running is None
    assert [(m.role, m.content) for m in w.history.messages(local_chat)] == local_before
    assert not w.chat.stop_button.isEnabled()  # no reply runs anywhere (a stuck local "…" kept it enabled)

    # back to the local chat: everything the remote chat borrowed comes back
    w.chat_list.setCurrentRow(w.chat_list.chat_ids().index(local_chat))
    assert w.chat_id == local_chat and w.remote.current is None
    assert w.controls.mode.isEnabled() and not w.remote.lock.label.isVisible()
    assert w.menu_actions["compare"].isEnabled() and on_screen(w.occupancy) == occupancy_in_front
    w.remote.list.setCurrentRow(0)
    assert w.remote.current is rc and w.chat.bubbles[-1].text == rc.messages[-1].content

    # edit the first message (through the pane, as its Save does): what followed goes, a new reply comes
    with qtbot.waitSignal(w.remote.reply_finished, timeout=60_000):
        w.chat.edit_requested.emit(0, "Once upon a time there was a cat")
    assert [m.role for m in rc.messages] == ["user", "assistant"] and rc.messages[-1].content
    assert rc.messages[0].content == "Once upon a time there was a cat" == w.chat.bubbles[0].text

    # Stop: the reply ends at its next chunk, its text kept, marked as stopped by you
    w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=300)
    w.chat.input.setPlainText("Tell me a story")
    with qtbot.waitSignal(w.remote.reply_finished, timeout=60_000) as stopped:
        w.chat.submit()
        qtbot.waitUntil(lambda: rc.chunks > 2, timeout=30_000)
        w.chat.stop_button.click()
    assert stopped.args[1] == "cancelled" and "stopped by you" in w.chat.bubbles[-1].stats_label.text()
    assert len(rc.reply.token_ids) < 300


def check_server_gone(qtbot, w, rc, server) -> None:
    # a second chat on the same server (the list's menu): its greedy story runs the full 300 tokens, and the
    # server is killed at its first chunk with text: the reply ends with the reason, its text kept
    second = w.remote.new_chat(rc.link)
    assert w.remote.current is second and w.remote.list.count() == 2 and not w.chat.bubbles
    w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=300)

    def kill(_gen, text, *_a) -> None:  # on the chat thread
        if text:
            server.kill()

    rc.link.worker.delta.connect(kill)
    assert send(qtbot, w, "Once upon a time") == "error"
    rc.link.worker.delta.disconnect(kill)
    stopped = second.messages[-1]
    assert stopped.content and stopped.stats["error"] and w.chat.bubbles[-1].text == stopped.content
    assert "The remote reply stopped" in w.chat.notice.label.text()
    shot(w, "killed")

    # and now it is gone: the next reply says so at once, and the window stays usable
    assert send(qtbot, w, "Are you there?") == "error"
    assert "refused the connection" in w.chat.notice.label.text()
    qtbot.waitUntil(lambda: (w.remote.draw(force=True), "not answering" in w.page_map.caption.text())[1],
                    timeout=5000)
    assert w.chat.send_button.isEnabled() and not w.chat.generating
    w.remote.close_chat(second.id)  # the last local chat comes back; the server's first chat stays
    assert w.remote.current is None and w.chat_id is not None and w.remote.list.count() == 1
    assert w.controls.mode.isEnabled() and rc.link in w.remote.links and not rc.link.closed
    w.remote.list.setCurrentRow(0)
    assert w.remote.current is rc and w.chat.bubbles[-1].text == rc.messages[-1].content
    w.new_chat()  # a local chat, answered by the local engine
    assert w.remote.current is None and w.chat.send_button.isEnabled()
    w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=8)
    w.send("Once upon a time")
    assert wait_reply(qtbot, w)[1] and w.chat.bubbles[-1].text and w.remote.current is None
    link = rc.link
    w.remote.close_chat(rc.id)  # its server's last chat: the link's threads and subscribers end
    assert link.closed and not w.remote.links and not w.remote.list.isVisible()
    assert not any(t.isRunning() for t in link.threads)


def test_remote_chat_streams_draws_its_blocks_and_survives_the_server(qtbot, data_dir, stories_path, server):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=30))
    try:
        local_chat, occupancy_in_front = w.chat_id, on_screen(w.occupancy)
        rc = connect(qtbot, w, server.url)
        check_connected(w, rc, server.port)
        check_first_reply(qtbot, w, rc)
        check_regenerate_switch_edit_stop(qtbot, w, rc, local_chat, occupancy_in_front)
        check_server_gone(qtbot, w, rc, server)
    finally:
        close_window(w)
        w.close()


def test_a_wrong_api_key_is_one_line_and_the_right_one_connects(qtbot, data_dir, stories_path):
    srv = Server(stories_path, "--api-key", "sesame")
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.menu_actions["connect"].trigger()
        dialog = w.remote.dialog
        dialog.url.setText(srv.url + "/v1")  # with /v1, as OpenAI clients are given it
        dialog.key.setText("wrong")
        dialog.connect_button.click()
        qtbot.waitUntil(lambda: bool(dialog.error.text()), timeout=15_000)
        assert "refused the API key (401)" in dialog.error.text() and not w.remote.chats
        dialog.key.setText("sesame")
        with qtbot.waitSignal(w.remote.chat_added, timeout=30_000):
            dialog.connect_button.click()
        assert not dialog.isVisible() and not dialog.error.text() and w.remote.current is not None
        assert send(qtbot, w, "Once upon a time") in ("max_tokens", "eos") and w.remote.current.reply.text
        w.menu_actions["connect"].trigger()  # the same server again: another chat on the link already open
        dialog.url.setText(srv.url)
        with qtbot.waitSignal(w.remote.chat_added, timeout=5000):
            dialog.connect_button.click()
        assert len(w.remote.links) == 1 and len(w.remote.chats) == 2 and not w.chat.bubbles
    finally:
        close_window(w)
        w.close()
        srv.kill()


def test_a_closed_port_is_one_line_in_the_dialog(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        chat = w.chat_id
        w.menu_actions["connect"].trigger()
        dialog = w.remote.dialog
        dialog.url.setText(f"http://127.0.0.1:{free_port()}")
        dialog.connect_button.click()
        qtbot.waitUntil(lambda: bool(dialog.error.text()), timeout=15_000)
        assert "refused the connection" in dialog.error.text() and "\n" not in dialog.error.text()
        assert dialog.isVisible() and dialog.connect_button.isEnabled()
        assert not w.remote.chats and not w.remote.list.isVisible() and w.chat_id == chat  # nothing else changed
        shot(w, "bad_url")
        dialog.grab().save(str(SHOTS / "remote_dialog_error.png"))
        dialog.url.setText("ftp://nowhere")
        dialog.connect_button.click()
        qtbot.waitUntil(lambda: "not a server address" in dialog.error.text(), timeout=5000)
        dialog.reject()
    finally:
        close_window(w)
        w.close()


def test_remote_slots_become_page_map_states():
    """Slots of the remote view → page states (chat active, others cached, evicted); a big pool is drawn up to its
    last held block (rounded up), two engines side by side."""
    from app.remote.panels import MIN_SHOWN, SHOWN_STEP, cache_snapshot, pool_texts
    from engine.remote.client import Metrics
    from engine.remote.view import SLOT_CHAT, SLOT_EVICTED, SLOT_FREE, SLOT_OTHER, PoolSnapshot

    slots = [SLOT_CHAT] * 3 + [SLOT_OTHER, SLOT_EVICTED] + [SLOT_FREE] * 300 + [SLOT_OTHER] + [SLOT_FREE] * 1743
    def pool_of(rank, num, slots, cached, chat, gaps=0):
        return PoolSnapshot(rank=rank, block_size=16, num_blocks=num, slots=tuple(slots), cached_blocks=cached,
                            chat_blocks=chat, stored=cached, removed=0, cleared=0, gaps=gaps, resyncs=0, last_ts=0.0)

    pool = pool_of(0, 2048, slots, 5, 3, gaps=2)
    snap = cache_snapshot([pool], 50)
    assert snap.num_pages == 2 * SHOWN_STEP + SHOWN_STEP == 384 > MIN_SHOWN  # slot 305 held: up to 384
    assert list(snap.page_state[:5]) == [S.PAGE_ACTIVE] * 3 + [S.PAGE_CACHED, S.PAGE_EVICTED]
    assert int(np.count_nonzero(snap.page_state == S.PAGE_ACTIVE)) == 3
    assert list(snap.token_state) == [S.TOKEN_KEPT] * 48 + [S.TOKEN_NOT_CACHED] * 2
    caption, readout = pool_texts([pool], Metrics(kv_usage=0.5, prefix_queries=40, prefix_hits=10), 16, "m @ h:1")
    assert "<b>5</b>/2048 blocks cached" in caption and "this chat <b>3</b>" in caption and "first 384" in caption
    assert "hit rate 25% (10 of 40 tokens)" in readout and "16 cached tokens" in readout
    assert "2 batches missed" in readout and "malformed" not in readout
    _, readout = pool_texts([pool], Metrics(), None, "m @ h:1", malformed=3)
    assert readout.endswith("· 3 malformed events skipped")
    two = cache_snapshot([pool, pool_of(1, 100, (SLOT_OTHER,) * 100, 100, 0)], 0)
    assert two.num_pages == 384 + 100 and two.page_groups == (("engine 0", 384), ("engine 1", 100))


def test_closing_the_window_mid_reply_stops_the_remote_threads(qtbot, data_dir, stories_path, server):
    """Two chats on one server take turns (the second says it waits, and Stop drops it unsent); closing the window
    while a reply streams cancels it and ends the link's threads (qtbot's own close would do it on a failure)."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=300))
    rc = connect(qtbot, w, server.url)
    link = rc.link
    w.chat.input.setPlainText("Tell me a story")
    w.chat.submit()
    qtbot.waitUntil(lambda: rc.chunks > 0, timeout=30_000)
    second = w.remote.new_chat(link)  # a second chat on the same server waits for the first one's reply, says so
    w.chat.input.setPlainText("Once upon a time")
    w.chat.submit()
    assert w.chat.bubbles[-1].waiting == QUEUED and w.chat.stop_button.isEnabled()
    queued = second.generation
    with qtbot.waitSignal(w.remote.reply_finished, timeout=30_000, check_params_cb=lambda g, _r: g == queued) as b:
        w.chat.stop_button.click()  # stopped while it waits: it is never sent
    assert b.args[1] == "cancelled" and not second.reply.token_ids and not second.messages[-1].content
    third = w.remote.new_chat(link)
    w.chat.input.setPlainText("Once upon a time")  # 300 tokens: still streaming when the window closes
    w.chat.submit()
    qtbot.waitUntil(lambda: third.generation and third.chunks > 0, timeout=30_000)
    # while it streams, its blocks are found (prompt ids from the first chunk, tokens as they come) and drawn
    qtbot.waitUntil(lambda: (w.remote.draw(force=True), active_cells(w.page_map)[0] >= 3)[1], timeout=10_000)
    assert third.generation and third.live_prompt
    t0 = time.monotonic()
    close_window(w)
    w.close()  # the Close event: the reply is cancelled, the link's threads and subscribers end
    assert time.monotonic() - t0 < 10
    assert link.closed and not any(t.isRunning() for t in link.threads) and third.cancel.is_set()


def test_a_server_that_comes_back_is_asked_again_with_backoff(qtbot, data_dir, stories_path, server):
    """Killed, the server's /metrics is asked after 1, 2, 4 … s (the page map says so); started again on the same
    ports, the event stream reconnects (ZMQ's own reconnect), the next message is answered and its blocks are drawn."""
    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=30))
    try:
        rc = connect(qtbot, w, server.url)
        view = rc.link.engine.view
        server.kill()
        qtbot.waitUntil(lambda: rc.link.failures >= 1, timeout=10_000)
        assert 0 < rc.link.retry_in <= 1.0  # then 2, 4 … 30 s
        w.remote.draw(force=True)
        assert "not answering" in w.page_map.caption.text() and "asking again in" in w.page_map.readout
        server.start()
        qtbot.waitUntil(lambda: rc.link.failures == 0, timeout=35_000)  # /metrics answered: it is back
        assert send(qtbot, w, "Once upon a time") == "max_tokens" and rc.reply.text
        qtbot.waitUntil(lambda: not rc.link.error, timeout=5000)  # a reply came: /metrics is asked at once
        try:
            qtbot.waitUntil(lambda: view.chat_blocks(rc.ids) > 0, timeout=10_000)
        except Exception:  # what the view holds, to tell a lost batch from an unmatched chain
            subs = rc.link.engine.subscribers
            snap = view.snapshots(rc.ids)
            raise AssertionError(f"no chat blocks: ids {len(rc.ids)} prompt {len(rc.reply.prompt_ids)}; batches "
                                 f"{view.batches}; subs {[(s._expected, s.received, s.dropped) for s in subs]}; "
                                 f"snap {[(x.stored, x.removed, x.cached_blocks, x.gaps, x.resyncs) for x in snap]}")
        w.remote.draw(force=True)
        assert "not answering" not in w.page_map.caption.text()
        assert active_cells(w.page_map)[0] == view.chat_blocks(rc.ids)
    finally:
        close_window(w)
        w.close()


def test_a_remote_chat_and_an_api_conversation_take_turns_on_screen(qtbot, data_dir, stories_path):
    """The window attached to its own API server (Server ▸ Start serving; no KV events: the note says so): the
    remote chat's request is an API conversation there; selecting it puts the API view on screen and the remote
    chat leaves, selecting the remote chat puts it back and the API view leaves."""
    from test_server_menu import start_serving

    from app.server.api_view import READ_ONLY

    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=12))
    w.settings.set("server/port", free_port())
    try:
        url = start_serving(qtbot, w)
        rc = connect(qtbot, w, url)
        assert "publishes no KV events" in w.chat.notice.label.text()
        assert send(qtbot, w, "Once upon a time") in ("max_tokens", "eos") and rc.reply.text
        qtbot.waitUntil(lambda: w.api_list.count() == 1, timeout=10_000)
        w.api_list.setCurrentRow(0)
        qtbot.waitUntil(lambda: w.chat.title.text().startswith("API #"), timeout=10_000)
        assert w.remote.current is None and w.chat.read_only == READ_ONLY and w.controls.mode.isEnabled()
        assert w.remote.list.currentRow() == -1
        w.remote.list.setCurrentRow(0)
        assert w.remote.current is rc and w.api_list.selected == 0 and w.api_view.session_id == 0
        assert not w.chat.read_only and w.chat.send_button.isEnabled() and w.chat.title.text() == rc.label
        assert w.chat.bubbles[-1].text == rc.reply.text
        qtbot.wait(1200)  # two polls of the API list: its conversation does not come back on screen
        assert w.remote.current is rc and w.chat.title.text() == rc.label
    finally:
        close_window(w)
        w.close()


def test_max_new_tokens_is_fitted_to_the_servers_context(qtbot, data_dir, stories_path, shared_server):
    """Max new tokens 4,000 against a 512-token context (what /v1/models reports): the reply gets the tokens that
    fit, and its footer says so — not a 400 and an empty reply. Asked 300 beside a prompt that leaves fewer: the
    server refuses, the request goes again without max_tokens, the same line. Each chunk came in a read of its own
    (the timing is per token)."""
    from app.remote.chat_list import BURST_NOTE

    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=4000))
    try:
        rc = connect(qtbot, w, shared_server.url)
        assert rc.link.engine.client.contexts == {"stories260K": 512}
        assert send(qtbot, w, "Once upon a time") in ("max_tokens", "eos")
        reply, footer = rc.reply, w.chat.bubbles[-1].notes_label.text()
        prompt = len(reply.prompt_ids)
        assert reply.error is None and reply.text and not reply.budget.refused
        assert (f"The server's context holds 512 tokens: Max new tokens 4,000 was lowered to the {512 - prompt:,} "
                f"that fit after the {prompt:,}-token prompt") in footer
        assert len(reply.token_ids) <= 512 - prompt
        assert len(set(reply.token_reads)) > len(reply.token_reads) // 2 and BURST_NOTE not in footer
        assert "tok/s" in w.chat.bubbles[-1].stats_label.text()

        w.remote.new_chat(rc.link)
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=300)
        assert send(qtbot, w, "Once upon a time") in ("max_tokens", "eos")
        assert rc.link.engine.client.contexts and w.remote.current.reply.budget is None  # 300 fit: nothing said
        assert send(qtbot, w, "Tell me more") in ("max_tokens", "eos")
        reply = w.remote.current.reply
        assert reply.error is None and reply.budget.refused and reply.text
        assert "Max new tokens 300 was lowered to the" in w.chat.bubbles[-1].notes_label.text()
    finally:
        close_window(w)


def test_a_reply_that_arrives_in_one_burst_has_no_speed():
    """Chunks buffered on the way arrive in one socket read: n / ~0 s would be a nonsense tok/s, so none is shown.
    A fast server's chunks, each in its own read 0.8 ms apart (stories260K served on its compiled step), are a
    measured 1,250 tok/s, not a burst (a 1 ms rule on their spacing called them one)."""
    from app.remote.chat_list import BURST_NOTE, reply_stats
    from app.remote.panels import timing_text
    from engine.remote.client import Reply

    burst = Reply(token_ids=list(range(30)), token_times=[1.0 + i * 1e-5 for i in range(30)], ttft_s=0.4,
                  token_reads=[1] * 30)
    stats = reply_stats(burst, "eos")
    assert "decode_tokens_per_s" not in stats and stats["notes"] == [BURST_NOTE] and stats["ttft_ms"] == 400.0
    assert "in one burst" in timing_text(burst) and "tok/s" not in timing_text(burst)
    paced = Reply(token_ids=list(range(30)), token_times=[1.0 + i * 5e-3 for i in range(30)], ttft_s=0.4,
                  prompt_ids=[1] * 20, usage={"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 16}})
    stats = reply_stats(paced, "eos")
    assert stats["decode_tokens_per_s"] == 200.0 and "notes" not in stats
    assert (stats["reused_tokens"], stats["recomputed_tokens"], stats["first_divergence"]) == (16, 4, 16)
    assert "200.0 tok/s" in timing_text(paced) and "(20 prompt tokens)" in timing_text(paced)
    fast = Reply(token_ids=list(range(200)), token_times=[1.0 + i * 8e-4 for i in range(200)], ttft_s=0.01,
                 token_reads=list(range(1, 201)))
    stats = reply_stats(fast, "length")
    assert stats["decode_tokens_per_s"] == 1250.0 and "notes" not in stats
    assert "1250.0 tok/s" in timing_text(fast) and "inter-token p50 0.8 ms" in timing_text(fast)


def test_chunks_that_arrive_together_share_the_time_of_the_chunk_before():
    """vLLM's CPU stream delivers runs of chunks in one read: those tokens join the group of the chunk that came
    first (the timing panel averages its gap over them) instead of each claiming a ~0 ms token."""
    from app.panels.timing import TimingPanel
    from app.remote.panels import chunk_events, timing_text
    from engine.remote.client import Reply

    panel = TimingPanel()
    panel.begin_reply(7, "remote")
    arrivals = [1.040, 1.050, 1.060, 1.06001, 1.06002, 1.06003, 1.070]  # sent at 1.0; 3 chunks come with the 3rd
    previous = 1.0
    for i, t in enumerate(arrivals):
        for event in chunk_events(7, i, t, previous, 1, together=i > 0 and t - previous < 1e-3):
            panel.add_token(event)
        previous = t
    cur = panel.current
    assert cur.prefill_ms == pytest.approx(40.0)
    # decode: 10 ms, then 10 ms shared by the chunk and the 3 that came with it (2.5 ms each), then 9.97 ms
    assert cur.ms[:cur.n] == pytest.approx([10.0, 2.5, 2.5, 2.5, 2.5, 9.97], abs=0.02)
    two = chunk_events(7, 3, 1.2, 1.1, 2)  # a chunk of two tokens: its 100 ms shared by both
    assert [(e.step_ms, e.tokens_in_step) for e in two] == [(pytest.approx(100.0), 1), (0.0, 0)]

    buffered = Reply(token_ids=list(range(30)), token_times=[1.0 + (i // 10) * 0.05 + i * 1e-5 for i in range(30)],
                     ttft_s=0.04, token_reads=[i // 10 for i in range(30)])  # three reads of ten chunks
    text = timing_text(buffered)
    assert "27 of 29 arrived together with the one before (buffered on the way)" in text and "p50" not in text
