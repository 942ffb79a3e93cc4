"""The main window end to end on the real engine with stories260K."""

from __future__ import annotations

import json
import time

from app_helpers import GREEDY, close_window, open_window, wait_reply
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication
from table_checks import all_drawn, shoot

from engine.config import SamplingConfig

LONG = SamplingConfig(temperature=0.0, max_new_tokens=60, ignore_eos=True)


def _type_and_send(qtbot, window, text: str) -> None:
    qtbot.keyClicks(window.chat.input, text)
    qtbot.keyClick(window.chat.input, Qt.Key.Key_Return)


def test_send_streams_tokens_and_every_panel_changes(qtbot, data_dir, stories_path):
    # 300 tokens: still streaming when the test looks at the pane, even at hundreds of tokens per second
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=300, ignore_eos=True))
    try:
        assert w.info.name == "stories260K"
        assert "stories260K" in w.status.model.text() and "CPU" in w.status.device.text()
        before = {p.objectName(): p.updates for p in w.panels}
        assert w.model_card.info is not None
        _type_and_send(qtbot, w, "Once upon a time")
        assert w.chat.input.toPlainText() == ""  # Enter sent it
        assert w.generation_id
        qtbot.waitUntil(lambda: w.chat.streaming is not None and len(w.chat.streaming.text) > 5, timeout=30_000)
        assert w.chat.streaming.body.text()  # rendered while streaming
        gen, reason = wait_reply(qtbot, w)
        assert reason == "max_tokens"
        qtbot.wait(300)  # let the round-robin refresh reach every panel
        after = {p.objectName(): p.updates for p in w.panels}
        for name in ("OccupancyPanel", "PageMapPanel", "TimingPanel", "MemoryPanel"):
            assert after[name] > before[name], name
        assert sum(int(v.sum()) for v in w.occupancy.stack.values()) > 0
        assert (w.page_map.grid == 1).any()  # active pages
        assert len(w.timing.curves()["latency"][1]) == 299  # 300 tokens: one prefill + 299 decode
        assert w.memory.n > 0 and w.memory.series()["kv_mib"][-1] > 0
        bubble = w.chat.bubbles[-1]
        msgs = w.history.messages(w.chat_id)
        assert [m.role for m in msgs] == ["user", "assistant"]
        assert msgs[1].content == bubble.text and bubble.text
        assert "decode" in bubble.stats_label.text() and "TTFT" in bubble.stats_label.text()
        assert bubble.cache_label.text().startswith("reused 0 tokens, computed ") and "(new)" in bubble.cache_label.text()
        assert "Context" in w.status.context.text() and "tokens/s" in w.status.speed.text()
        assert len(w.trace) >= 299
    finally:
        close_window(w)


def test_switch_mode_and_page_size_mid_reply(qtbot, data_dir, stories_path):
    # long enough that both switches land mid-reply even at hundreds of tokens per second
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=440, ignore_eos=True))
    try:
        modes = []
        w.engine.worker.snapshot.connect(lambda s: modes.append((s.mode, s.page_size)))
        w.send("The little dog")
        qtbot.waitUntil(lambda: w.conversation.tokens_in_reply >= 3, timeout=30_000)
        w.controls.mode.setCurrentIndex(w.controls.mode.findData("contiguous"))  # as the user does
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        w.controls.mode.setCurrentIndex(w.controls.mode.findData("paged"))
        w.controls.page_size.setValue(8)
        qtbot.waitUntil(lambda: w.cache.applied.mode == "paged" and w.cache.applied.page_size == 8, timeout=10_000)
        assert w.generation_id, "the reply ended before both switches landed"
        gen, reason = wait_reply(qtbot, w)
        assert reason == "max_tokens"
        assert ("paged", 16) in modes and ("contiguous", 0) in modes and modes[-1] == ("paged", 8)
        assert w.chat.bubbles[-1].stats["generated_tokens"] == 440
        assert w.last_stats["mode"] == "paged → contiguous → paged"
        assert "8-token pages" in w.status.cache.text()
        assert json.loads(w.history.chat(w.chat_id).settings)["cache"]["page_size"] == 8  # kept with the chat
        assert w.settings.get("cache/page_size") == 16  # new chats still start from the defaults
    finally:
        close_window(w)


def test_stop_regenerate_and_edit_reuse_the_prefix(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=GREEDY)
    try:
        # stop
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=400, ignore_eos=True)
        w.send("A cat sat")
        qtbot.waitUntil(lambda: w.conversation.tokens_in_reply >= 2, timeout=30_000)
        assert w.chat.stop_button.isEnabled()
        qtbot.keyClick(w.chat.input, Qt.Key.Key_Escape)
        gen, reason = wait_reply(qtbot, w)
        assert reason == "cancelled" and not w.chat.stop_button.isEnabled()
        stopped = w.chat.bubbles[-1].stats["generated_tokens"]
        assert 0 < stopped < 400

        # regenerate: the prompt is reused from the cache
        w.sampling_override = GREEDY
        qtbot.mouseClick(w.chat.regen_button, Qt.MouseButton.LeftButton)
        wait_reply(qtbot, w)
        assert [m.role for m in w.history.messages(w.chat_id)] == ["user", "assistant"]
        assert w.last_stats["reused_tokens"] > 0
        first_reply = w.history.messages(w.chat_id)[1].content

        # a second turn, then edit it: everything up to the edit is reused
        w.send("The dog ran")
        wait_reply(qtbot, w)
        second_user = w.history.messages(w.chat_id)[2]
        prompt_before = w.last_stats["prompt_tokens"]
        user_bubble = next(b for b in w.chat.bubbles if b.position == second_user.position)
        user_bubble.begin_edit()
        user_bubble.editor.setPlainText("The bird flew")
        qtbot.mouseClick(user_bubble.save_button, Qt.MouseButton.LeftButton)
        wait_reply(qtbot, w)
        msgs = w.history.messages(w.chat_id)
        assert [m.content for m in msgs[:3]] == [msgs[0].content, first_reply, "The bird flew"] and len(msgs) == 4
        stats = w.last_stats
        assert 0 < stats["reused_tokens"] < prompt_before and stats["first_divergence"] == stats["reused_tokens"]
        line = w.chat.bubbles[-1].cache_label.text()
        again = sum(m["end"] - m["start"] for m in stats["cache"]["misses"] if m["reason"] != "new")
        new = stats["recomputed_tokens"] - again
        split = f"{again} recomputed, {new} new" if new else "recomputed"
        assert again > 0 and line == f"reused {stats['reused_tokens']} tokens, computed {stats['recomputed_tokens']} ({split})"
    finally:
        close_window(w)


def test_history_survives_a_restart(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    w.chat.system_prompt.setText("You tell short stories.")
    w.chat.system_prompt.textEdited.emit("You tell short stories.")
    w.send("Tell me about a frog")
    wait_reply(qtbot, w)
    text = w.chat.bubbles[-1].text
    chat_id = w.chat_id
    # the system prompt is saved once typing pauses (a debounce timer): wait for it, not for a clock
    qtbot.waitUntil(lambda: w.history.chat(chat_id).system_prompt == "You tell short stories.", timeout=5000)
    close_window(w)
    w.close()

    w2 = open_window(qtbot, data_dir, str(stories_path))
    try:
        assert w2.chat_id == chat_id
        assert [b.role for b in w2.chat.bubbles] == ["user", "assistant"]
        assert w2.chat.bubbles[1].text == text and w2.chat.bubbles[1].cache_label.text().startswith("reused")
        assert w2.chat.system_prompt.text() == "You tell short stories."
        assert w2.chat_list.count() == 1 and w2.chat_list.item(0).text() == "Tell me about a frog"
        assert w2.settings.get("model/last") == str(stories_path)
    finally:
        close_window(w2)


def test_new_chat_and_switching(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.send("First chat")
        wait_reply(qtbot, w)
        first = w.chat_id
        w.new_chat()
        assert w.chat_id != first and w.chat.bubbles == [] and w.chat_list.count() == 2
        w.send("Second chat")
        wait_reply(qtbot, w)
        w.open_chat(first)
        assert [b.text for b in w.chat.bubbles][0] == "First chat"
        w.send("Back to the first chat")
        wait_reply(qtbot, w)
        assert w.last_stats["reused_tokens"] > 0  # its own session kept its cache while chat 2 ran
    finally:
        close_window(w)


def test_close_during_a_reply_joins_the_worker_fast(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=400, ignore_eos=True))
    w.send("Once")
    qtbot.waitUntil(lambda: w.chat.streaming is not None and bool(w.chat.streaming.text.strip()), timeout=30_000)
    t = time.perf_counter()
    w.close()
    assert time.perf_counter() - t < 2.0
    assert not w.engine.thread.isRunning()
    assert w.history.messages(w.chat_id)[-1].content  # what streamed so far was saved
    w.history.close()


def test_export_trace_and_panels(qtbot, data_dir, stories_path, tmp_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        w.send("Export me")
        wait_reply(qtbot, w)
        w.trace.write_json(tmp_path / "t.json")
        w.trace.write_csv(tmp_path / "t.csv")
        data = json.loads((tmp_path / "t.json").read_text())
        assert len(data["snapshots"]) == len(w.trace) > 0
        assert isinstance(data["snapshots"][0]["page_state"], list)
        rows = (tmp_path / "t.csv").read_text().splitlines()
        assert rows[0].startswith("generation_id,step") and len(rows) == len(w.trace) + 1
        paths = w.export_panels(tmp_path / "png")
        assert len(paths) == 6 and all(p.stat().st_size > 1000 for p in paths)  # the "Why recomputed?" readout too
        md = w.export_chat_markdown(tmp_path / "chat.md").read_text(encoding="utf-8")
        reply = w.history.messages(w.chat_id)[1].content
        assert md.startswith("# ") and "model stories260K" in md
        assert "## You\n\nExport me\n" in md and f"## Model\n\n{reply.rstrip()}\n" in md
        assert "> prefill" in md and "reused 0 tokens, computed " in md
    finally:
        close_window(w)


def test_context_field_warns_as_the_context_fills(qtbot, data_dir, stories_path):
    from app.ground.status_bar import CONTEXT_FILLING, CONTEXT_FULL

    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        field = w.status.context
        w.status.show_context(100, 512, w.cache.applied.overflow)
        # the default (#31 item 1): the chat goes on, the oldest dropped
        assert field.text() == "Context: 100 of 512 tokens" and "the oldest whole messages are dropped" in field.toolTip()
        assert field.level == "" and CONTEXT_FILLING not in field.styleSheet()
        w.status.show_context(400, 512, w.cache.applied.overflow)
        assert field.level == "filling" and CONTEXT_FILLING in field.styleSheet() and "78%" in field.toolTip()
        w.controls.overflow.setCurrentIndex(w.controls.overflow.findData("truncate_middle"))
        qtbot.waitUntil(lambda: w.cache.applied.overflow == "truncate_middle", timeout=10_000)
        w.status.show_context(470, 512, w.cache.applied.overflow)
        assert field.level == "full" and CONTEXT_FULL in field.styleSheet() and "first message" in field.toolTip()
    finally:
        close_window(w)


def test_layout_is_restored(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    w.docks["memory"].hide()
    close_window(w)
    w.close()
    w2 = open_window(qtbot, data_dir, str(stories_path))
    try:
        assert not w2.docks["memory"].isVisible() and w2.docks["timing"].isVisible()
    finally:
        close_window(w2)


def test_sampling_form_round_trip(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path), sampling=None)
    try:
        f = w.sampling
        f.temperature.setValue(0.0)
        f.top_k.setValue(5)
        f.seed.setValue(42)
        f.max_new_tokens.setValue(16)
        s = f.sampling()
        assert (s.temperature, s.top_k, s.seed, s.max_new_tokens) == (0.0, 5, 42, 16)
        assert w.settings.get("sampling/seed") == 42
        w.send("Seeded")
        wait_reply(qtbot, w)
        assert w.last_stats["generated_tokens"] <= 16
    finally:
        close_window(w)


def test_a_killed_app_reopens_with_its_history(qtbot, data_dir, stories_path):
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    from conftest import REPO

    code = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(REPO)!r})
        import app
        from PySide6.QtWidgets import QApplication
        qa = QApplication([])
        from app.history.store import HistoryStore
        from app.shell.window import MainWindow
        from app.selftest.run import wait_until
        from app.settings.store import Settings
        from engine.config import SamplingConfig
        d = {str(data_dir)!r}
        w = MainWindow(Settings.from_data_dir(d), HistoryStore.in_data_dir(d), model="demo")
        w.show(); w.start()
        wait_until(lambda: w.info is not None, 120)
        # the demo's 2,048-token context: a reply far longer than the time to the kill, however fast
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=1900, ignore_eos=True)
        w.send("Before the crash")
        wait_until(lambda: w.conversation.tokens_in_reply >= 20, 60)
        wait_until(lambda: False, 0.6)  # at least two batch flushes
        print(len(w.chat.streaming.text), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    streamed = int(proc.stdout.split()[-1])
    w = open_window(qtbot, data_dir, "demo")
    try:
        assert [b.role for b in w.chat.bubbles] == ["user", "assistant"]
        assert w.chat.bubbles[0].text == "Before the crash"
        assert 0 < len(w.chat.bubbles[1].text) <= streamed
        w.send("And after")  # the chat continues
        wait_reply(qtbot, w)
        assert len(w.history.messages(w.chat_id)) == 4
    finally:
        close_window(w)


def _mnemonics_unique(actions, where: str) -> None:
    keys = [a.text().split("&", 1)[1][:1].lower() for a in actions if "&" in a.text().replace("&&", "")]
    assert len(keys) == len(set(keys)), f"{where}: {sorted(a.text() for a in actions)}"


def test_recent_models_menu(qtbot, data_dir, stories_path):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        _mnemonics_unique(w.menuBar().actions(), "the menu bar")  # Alt+<letter> opens one menu, never two
        for menu in (a.menu() for a in w.menuBar().actions()):
            _mnemonics_unique(menu.actions(), menu.title())
        recent = w.menu_actions["recent"]
        w.models.fill_recent_menu(recent)
        texts = [a.text() for a in recent.actions()]
        assert texts[1].startswith("demo") and str(stories_path) in texts
        with qtbot.waitSignal(w.model_loaded, timeout=120_000) as blocker:
            recent.actions()[1].trigger()
        assert blocker.args[0].is_demo and "demo" in w.status.model.text()
        w.send("hi demo")
        assert wait_reply(qtbot, w)[1] in ("max_tokens", "eos")
    finally:
        close_window(w)


def test_pin_a_message_keeps_it_under_the_priority_policy(qtbot, data_dir, stories_path):
    """Pin → stored with the message, passed to the engine, and kept when the priority policy evicts."""
    from engine.model.chat import message_spans
    from engine.config import CacheConfig

    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(max_new_tokens=30, ignore_eos=True))
    try:
        w.send("Tell me a story.")
        wait_reply(qtbot, w)
        w.send("Remember: the dog is named Max.")
        wait_reply(qtbot, w)
        pinned = w.chat.bubbles[2]
        assert pinned.role == "user" and not pinned.pinned
        pinned.pin_button.click()
        assert pinned.pinned and pinned.pin_button.text() == "Pinned"
        msgs = w.history.messages(w.chat_id)
        assert msgs[2].stats.get("pinned") is True and not msgs[0].stats.get("pinned")
        em = w.conversation.engine_messages()
        assert em[2] == {"role": "user", "content": "Remember: the dog is named Max.", "pinned": True}
        with qtbot.waitSignal(w.engine.worker.applied, timeout=30_000):
            w.apply_cache_config(CacheConfig(mode="paged", page_size=4, policy="priority",
                                             policy_params={"budget": 60, "recent": 8}))
        w.send("And then?")
        wait_reply(qtbot, w)
        session = w.engine.worker._pool.get(w.chat_id)  # read after the reply: the worker is idle
        em = w.conversation.engine_messages()
        spans = message_spans(session.tokenizer, em)
        kept = set(session.index.layer_log[0].tolist())
        assert session.evicted_total > 0
        assert set(range(*spans[2])) <= kept  # the pinned message
        assert not set(range(*spans[1])) <= kept  # the first reply (not pinned) lost tokens
        close_window(w)
        w = open_window(qtbot, data_dir, str(stories_path), sampling=LONG)
        assert w.chat.bubbles[2].pinned  # the pin survives a restart
    finally:
        close_window(w)


def test_compare_cache_settings_while_chatting(qtbot, data_dir, stories_path, stories):
    """Tools ▸ Compare runs next to the chat: a message sent while it runs is answered at once (one step of
    each per worker turn), correctly, and the comparison's rows are still right."""
    from app.compare.dialog import COLUMNS
    from engine.config import CacheConfig
    from engine.core.session import ChatSession

    w = open_window(qtbot, data_dir, str(stories_path), sampling=SamplingConfig(max_new_tokens=30, ignore_eos=True))
    try:
        assert w.open_compare() is None  # nothing sent yet: a message says so
        w.send("Tell me about a cat")
        wait_reply(qtbot, w)
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=120, ignore_eos=True)
        dlg = w.open_compare()
        qtbot.addWidget(dlg)
        assert not dlg.isModal() and dlg.windowModality() == Qt.WindowModality.NonModal
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True)
        w.send("And a dog?")  # while the comparison runs
        assert dlg.running and w.open_compare() is dlg  # one comparison at a time: the running one is raised
        gen, reason = wait_reply(qtbot, w)
        # the reply did not wait for the comparison: 6 settings x 120 tokens are still running
        assert reason == "max_tokens" and dlg.running and len(dlg.rows) < 6
        assert w.last_stats["generated_tokens"] == 20 and w.last_stats["reused_tokens"] > 0
        # cache settings apply, and Stop stops, while it runs
        w.apply_cache_config(CacheConfig(mode="contiguous"))
        qtbot.waitUntil(lambda: w.cache.applied.mode == "contiguous", timeout=10_000)
        w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=300, ignore_eos=True)  # context 512
        w.send("And a bird?")
        qtbot.waitUntil(lambda: w.conversation.tokens_in_reply >= 2, timeout=30_000)
        w.stop()
        gen, reason = wait_reply(qtbot, w)
        assert reason == "cancelled" and w.last_stats["generated_tokens"] < 300 and dlg.running
        # the second reply is the one a session that never saw a comparison gives (greedy, two turns)
        ref = ChatSession(stories, CacheConfig())
        msgs = w.conversation.engine_messages()
        for turn, n in ((msgs[:1], 30), (msgs[:3], 20)):
            ref.start(turn, SamplingConfig(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            result = ref.step()
            while not result.done:
                result = ref.step()
        ref.close()
        assert msgs[3]["content"] == result.text

        qtbot.waitUntil(lambda: dlg.finished_reason == "done", timeout=120_000)
        assert dlg.table.rowCount() == 6 and dlg.table.columnCount() == len(COLUMNS)
        cells = [[dlg.table.item(r, c).text() for c in range(len(COLUMNS))] for r in range(6)]
        assert [row[0] for row in cells] == ["paged (reference)", "paged, speculative (prompt lookup)", "contiguous",
                                             "paged, KV int8", "paged, KV int4", "cache off"]
        assert all(cells[r][4] == "all 120 (identical)" for r in (0, 1, 2, 5))  # lossless settings
        spec = dlg.rows[1]
        assert cells[1][2].endswith(f"({spec['tokens_per_forward']:.1f} per forward)") and "per forward" not in cells[0][2]
        assert len({r["prompt_tokens"] for r in dlg.rows}) == 1  # every row answered the first message only
        assert "Done: 6 settings" in dlg.status.text() and dlg.progress.value() == dlg.progress.maximum()
        assert dlg.markdown().count("\n") == 8 and "| paged (reference) |" in dlg.markdown()
        for width, height in ((900, 520), (700, 480)):  # the default size, and narrower: no column clips (#49)
            dlg.resize(width, height)
            QApplication.processEvents()
            all_drawn(dlg.table)
            shoot(dlg, f"compare-replies-{width}.png")
        dlg.close()
        assert w.open_compare() is not dlg  # a finished comparison makes way for a new one
    finally:
        close_window(w)
