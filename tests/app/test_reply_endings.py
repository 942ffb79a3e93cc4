"""How a reply ends when the app does not end it normally (#20 item 17), in the real window.

- kill -9 mid-reply: the restarted app marks the reply stopped and its caption keeps the real token count
  (it said "0 tokens": the count was saved only when a reply finished). The count is now saved with each
  batch of streamed text, in the same statement.
- SIGTERM mid-reply: the app quits as it does from its menu (``app.main.run_window``), the reply saved as
  stopped (before: the process died at once, no "stopped" line).
- a model with NaN weights: the reply ends with an error that says so (before: token 0, over and over).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from app_helpers import close_window, open_window, wait_reply
from conftest import REPO

from engine.config import SamplingConfig

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    import app
    from PySide6.QtWidgets import QApplication
    qa = QApplication([])
    from app.history.store import HistoryStore
    from app.main import run_window
    from app.shell.window import MainWindow
    from app.selftest.run import wait_until
    from app.settings.store import Settings
    from engine.config import SamplingConfig
    d = {data_dir!r}
    history = HistoryStore.in_data_dir(d)
    w = MainWindow(Settings.from_data_dir(d), history, model="demo")
    w.show(); w.start()
    wait_until(lambda: w.info is not None, 120)
    # the demo's 2,048-token context: a reply far longer than the time to the signal, however fast
    w.sampling_override = SamplingConfig(temperature=0.0, max_new_tokens=1900, ignore_eos=True)
    w.send("Before the end")
    wait_until(lambda: w.conversation.tokens_in_reply >= 20 and w.conversation.running.pending, 60)
""")


def _child(data_dir, tail: str) -> subprocess.Popen:
    code = CHILD.format(repo=str(REPO), data_dir=str(data_dir)) + textwrap.dedent(tail)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))


def _saved_reply(data_dir):
    from app.history.store import HistoryStore

    store = HistoryStore.in_data_dir(data_dir)
    try:
        (chat,) = store.chats()
        return store.messages(chat.id)[-1]
    finally:
        store.close()


def test_a_killed_reply_keeps_its_token_count(qtbot, data_dir):
    proc = _child(data_dir, """
        w.conversation.flush()  # what the 250 ms timer does: text and count saved together
        print(w.conversation.tokens_in_reply, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err
    tokens = int(out.split()[-1])
    assert tokens >= 20
    w = open_window(qtbot, data_dir, "demo")
    try:
        reply = w.chat.bubbles[1]
        caption = reply.stats_label.text()
        assert f"{tokens} tokens" in caption, caption
        assert "stopped: the app closed before this reply finished" in caption
        saved = w.history.messages(w.chat_id)[1].stats
        assert saved["generated_tokens"] == tokens and saved["stop_reason"] == "interrupted"
        assert "streamed_tokens" not in saved
    finally:
        close_window(w)


def test_sigterm_quits_like_the_menu_and_marks_the_reply(data_dir):
    proc = _child(data_dir, """
        from PySide6.QtCore import QTimer
        # said from inside the event loop, once run_window has installed its handlers (said before it, a
        # loaded machine let the parent's SIGTERM land first: the default action, -15)
        QTimer.singleShot(0, lambda: print("streaming", w.conversation.tokens_in_reply, flush=True))
        code = run_window(qa, w, history)
        print("exit", code, flush=True)
        os._exit(code)
    """)
    try:
        line = proc.stdout.readline()  # the reply is streaming: the parent sends the signal, as a system would
        assert line.startswith("streaming"), proc.stderr.read() if proc.poll() is not None else line
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out.split() == ["exit", "0"], err  # before: -15, killed mid-reply
    reply = _saved_reply(data_dir)
    assert reply.role == "assistant" and reply.content
    assert reply.stats["stop_reason"] == "interrupted" and reply.stats["stop_detail"] == "the app was closed"
    assert reply.stats["generated_tokens"] >= int(line.split()[1])


@pytest.fixture
def nan_model(tmp_path, stories_path):
    import torch
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "nan-model"
    dst.mkdir()
    for f in stories_path.iterdir():
        shutil.copy(f, dst / f.name)
        (dst / f.name).chmod(0o644)
    sd = load_file(dst / "model.safetensors")
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("nan"))
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_nan_model_says_so_and_the_chat_goes_on(qtbot, data_dir, nan_model):
    w = open_window(qtbot, data_dir, str(nan_model),
                    sampling=SamplingConfig(temperature=0.0, max_new_tokens=20, ignore_eos=True))
    try:
        for n, text in enumerate(("Once upon a time", "Again")):
            w.send(text)
            assert wait_reply(qtbot, w)[1] == "error"
            reply = w.chat.bubbles[2 * n + 1]
            assert reply.text == ""  # no token 0 ("<unk>") streamed
            assert reply.error_label.text().startswith("Error: the model's output is not a number (NaN in its logits)")
            assert w.last_stats["generated_tokens"] == 0 and w.last_stats["stop_reason"] == "error"
            assert w.chat.send_button.isEnabled() and not w.generation_id
    finally:
        close_window(w)
