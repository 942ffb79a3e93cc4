"""Bad input never kills the window: a missing or corrupt model folder, a remote-code model, a raising
engine and a failed download each show a message and leave the app usable."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from app_helpers import SessionFake, close_window, open_window, wait_reply

from app.link.worker import EngineBackend
from engine.config import ModelSpec


def _copy(src, dst, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture
def bad_folders(tmp_path, stories_path):
    corrupt = _copy(stories_path, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x07" * 4096)
    remote = _copy(stories_path, tmp_path / "remote")
    cfg = json.loads((stories_path / "config.json").read_text())
    cfg.update(auto_map={"AutoModelForCausalLM": "modeling_custom.MyModel"})
    (remote / "config.json").write_text(json.dumps(cfg))
    return {"missing": (tmp_path / "nope", "not found"), "corrupt": (corrupt, "corrupt"),
            "remote": (remote, "remote code")}


@pytest.mark.parametrize("case", ["missing", "corrupt", "remote"])
def test_bad_model_shows_a_message_and_keeps_the_loaded_one(qtbot, data_dir, stories_path, bad_folders, case):
    w = open_window(qtbot, data_dir, str(stories_path))
    try:
        folder, words = bad_folders[case]
        with qtbot.waitSignal(w.error_shown, timeout=60_000) as blocker:
            w.load_model(ModelSpec(source=str(folder)))
        assert words in blocker.args[0]
        # not part of the chat (nothing saved): the message area above the transcript, not a bubble
        assert w.chat.bubbles == [] and words in w.chat.notice.text
        qtbot.waitUntil(lambda: w.chat.notice.isVisibleTo(w), timeout=2_000)
        assert w.info.name == "stories260K" and w.chat.send_button.isEnabled()
        w.new_chat()  # a failed load stays said until dismissed, in a new chat too (it was gone after ~6 s)
        assert w.chat.notice.isVisibleTo(w) and words in w.chat.notice.text
        w.chat.notice.close_button.click()
        assert not w.chat.notice.isVisibleTo(w) and w.chat.notice.text == ""
        w.send("Still here?")
        gen, reason = wait_reply(qtbot, w)
        assert reason in ("max_tokens", "eos")
    finally:
        close_window(w)


def _first_launch(qtbot, data_dir, model: str):
    """A window at first launch on ``model``, after the first model that did load; (window, errors shown)."""
    from app.history.store import HistoryStore
    from app.shell.window import MainWindow
    from app.settings.store import Settings

    errors = []
    w = MainWindow(Settings.from_data_dir(data_dir), HistoryStore.in_data_dir(data_dir), model=model)
    qtbot.addWidget(w)
    w.error_shown.connect(errors.append)
    w.show()
    with qtbot.waitSignal(w.model_loaded, timeout=120_000):
        w.start()
    return w, errors


def test_bad_model_at_first_launch_falls_back_to_the_built_in_model(qtbot, data_dir, bad_folders):
    w, errors = _first_launch(qtbot, data_dir, str(bad_folders["corrupt"][0]))
    try:
        assert not w.info.is_demo and w.info.name == "stories260K"
        assert errors and "corrupt" in errors[0] and "Opening stories260K (built-in, tiny stories) instead" in errors[0]
        assert "corrupt" in w.chat.notice.text and "stories260K" in w.chat.notice.text
        assert w.chat.bubbles == [] and w.chat.notice.isVisibleTo(w)
    finally:
        close_window(w)


def test_a_broken_built_in_model_falls_back_to_the_demo(qtbot, data_dir, bad_folders, tmp_path, monkeypatch):
    """A bundle whose shipped model is damaged (resources/ under sys._MEIPASS, as PyInstaller lays it out):
    the demo, which needs no files, still opens."""
    bundle = tmp_path / "bundle" / "resources" / "models"
    bundle.mkdir(parents=True)
    shutil.copytree(bad_folders["corrupt"][0], bundle / "stories260K")
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path / "bundle"), raising=False)
    w, errors = _first_launch(qtbot, data_dir, "stories260K")
    try:
        assert w.info.is_demo
        assert errors and "corrupt" in errors[0] and "Opening demo (random weights) instead" in errors[0]
    finally:
        close_window(w)


class _Raising(SessionFake):
    def start(self, messages, sampling, generation_id):
        pass

    def step(self):
        raise MemoryError()

    def cancel(self):
        pass

    def apply(self, cfg):
        raise ValueError("page size: 999 is outside 1..256")

    def snapshot(self):
        return None


def test_raising_engine_becomes_a_message_and_the_window_keeps_working(qtbot, data_dir):
    from app_helpers import make_info

    backend = EngineBackend(load=lambda spec, progress, cancel: type("L", (), {"info": make_info()})(),
                            make_session=lambda loaded, cache: _Raising())
    w = open_window(qtbot, data_dir, "demo", backend=backend)
    try:
        # a config the engine rejects is reported above the chat and the controls go back to what is applied
        before = w.controls.config()
        with qtbot.waitSignal(w.error_shown, timeout=10_000) as blocker:
            w.controls.mode.setCurrentIndex(w.controls.mode.findData("contiguous"))
        assert blocker.args[0] == "Cache settings not applied: page size: 999 is outside 1..256"
        assert w.chat.notice.text == blocker.args[0] and w.chat.bubbles == []
        assert w.controls.config() == before
        before_text = blocker.args[0]
        with qtbot.waitSignal(w.error_shown, timeout=10_000) as blocker:
            w.send("hello")
        assert "out of memory" in blocker.args[0]
        qtbot.waitUntil(lambda: not w.generation_id, timeout=5_000)
        assert w.chat.send_button.isEnabled() and not w.chat.stop_button.isEnabled()
        # the reply stays, saying an error stopped it and why (saved with the chat); the refused setting is still
        # said above the chat (until dismissed), and the reply's own failure is not added there
        assert [b.role for b in w.chat.bubbles] == ["user", "assistant"]
        reply = w.chat.bubbles[1]
        assert reply.error_label.text() == "Error: out of memory" and "stopped by an error" in reply.stats_label.text()
        assert "no text" in reply.body.text() and w.chat.notice.problems == [before_text]
        msgs = w.history.messages(w.chat_id)
        assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].stats["error"] == "out of memory"
        with qtbot.waitSignal(w.error_shown, timeout=10_000):
            w.send("again")  # still responsive
        assert len(w.history.messages(w.chat_id)) == 4
    finally:
        close_window(w)


def test_failed_download_shows_a_message(qtbot, data_dir, monkeypatch):
    from app.models.dialog import ModelsDialog
    from app.settings.store import Settings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    dlg = ModelsDialog(Settings.from_data_dir(data_dir))
    qtbot.addWidget(dlg)
    dlg.hub_id.setText("someone/some-model")
    dlg.download()
    qtbot.waitUntil(lambda: dlg.download_button.isEnabled(), timeout=30_000)
    assert "Offline" in dlg.message.text() or "cannot" in dlg.message.text()
    assert not dlg.cancel_download_button.isEnabled()
    # still usable: choose the built-in model and accept
    dlg.list.setCurrentRow(0)
    dlg.accept_choice()
    assert dlg.spec is not None and dlg.spec.source == "stories260K"


def test_a_path_in_the_hub_id_field_opens_as_a_path_and_a_folder_without_config_is_not_listed(
        qtbot, data_dir, stories_path, tmp_path):
    """#31: a path typed where a hub id goes was sent to the Hub (a raw HFValidationError); a folder without
    config.json was listed as loadable. A model folder typed there is opened as one; anything else says why in one
    line and lists nothing."""
    from app.models.dialog import ModelsDialog
    from app.settings.store import Settings

    dlg = ModelsDialog(Settings.from_data_dir(data_dir))
    qtbot.addWidget(dlg)
    rows = dlg.list.count()
    dlg.hub_id.setText(str(stories_path))
    dlg.download()
    assert dlg.list.currentItem().text() == f"Folder: {stories_path}" and dlg.list.count() == rows + 1
    assert dlg.download_button.isEnabled() and not dlg.download_bar.isVisible()  # nothing went to the Hub
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "notes.txt").write_text("hello")
    for typed, words in ((str(empty), "is not a model folder: it has no config.json"),
                         (str(tmp_path / "nowhere"), "no such folder or file on this computer"),
                         ("~/no/such/model", "no such folder or file on this computer"),
                         ("not a hub id", "is not a hub id: type owner/name")):
        dlg.hub_id.setText(typed)
        dlg.download()
        assert words in dlg.message.text() and "HFValidationError" not in dlg.message.text(), typed
        assert dlg.list.count() == rows + 1  # listed: nothing
    dlg.add_folder(str(empty))  # Open folder… on it: the same line, not listed
    assert "has no config.json" in dlg.message.text() and dlg.list.count() == rows + 1


def test_download_cancel(qtbot, data_dir, monkeypatch):
    """Cancel raises inside the progress callback; simulated with a slow fake hub call."""
    import time

    import huggingface_hub

    from app.models.dialog import ModelsDialog
    from app.settings.store import Settings

    def fake_snapshot_download(repo_id, allow_patterns=None, tqdm_class=None, **kw):
        bar = tqdm_class(total=100)
        for _ in range(200):
            time.sleep(0.02)
            bar.update(1)
        return "/nowhere"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    dlg = ModelsDialog(Settings.from_data_dir(data_dir))
    qtbot.addWidget(dlg)
    dlg.hub_id.setText("someone/slow-model")
    dlg.download()
    qtbot.waitUntil(lambda: dlg.download_bar.value() > 0, timeout=10_000)
    dlg.cancel_download()
    qtbot.waitUntil(lambda: dlg.download_button.isEnabled(), timeout=10_000)
    assert "cancelled" in dlg.message.text()


def test_models_dialog_lists_the_built_in_models_and_estimates(qtbot, data_dir, stories_path):
    from app.models.dialog import ModelsDialog
    from app.settings.store import Settings

    s = Settings.from_data_dir(data_dir)
    s.add_recent_model(str(stories_path))
    dlg = ModelsDialog(s, environment={"cuda": True, "device_total_bytes": 512 << 10})
    qtbot.addWidget(dlg)
    assert dlg.list.item(0).text().startswith("stories260K (built-in, tiny stories)")
    assert dlg.list.currentRow() == 0  # chosen unless the user picks another
    assert dlg.list.item(1).text().startswith("demo (random weights)")
    assert "Recent" in dlg.list.item(2).text()
    dlg.device.setCurrentIndex(dlg.device.findData("cuda"))
    dlg.context.setValue(512)
    built_in = dlg.estimate()  # the shipped folder: estimated like any folder
    assert "will not fit" in dlg.message.text()  # 512 KiB of "GPU memory": said in the banner, Load refused
    dlg.accept_choice()
    assert dlg.spec is None
    dlg.environment["device_total_bytes"] = 8 << 30  # Load asks again: it fits in 8 GiB
    dlg.accept_choice()
    assert dlg.spec.source == "stories260K"  # by name: the settings never keep this installation's path
    dlg.list.setCurrentRow(2)
    est = dlg.estimate()
    # stories260K: K and V x 5 layers x 4 KV heads x head dim 8; the float32 checkpoint runs in float16 on CUDA
    assert est.cost("auto").bytes_per_token == 2 * 5 * 4 * 8 * 2 and est.context == 512
    assert "Fits in " in dlg.estimate_label.text() and "its whole context (512 tokens)" in dlg.estimate_label.text()
    # int8 at pages of 16: per-channel keys (16 >= 2 x 8) 8 + 2 B, per-token values 8 + 2 B per head and token
    assert est.cost("int8").bytes_per_token == 5 * 4 * (10 + 10)
    assert "KV cache per token: float16 640 B, int8 400 B, int4 " in dlg.estimate_label.text()
    dlg.quantization.setCurrentIndex(dlg.quantization.findData("int8"))
    dlg.accept_choice()
    assert dlg.spec.source == str(stories_path) and dlg.spec.quantization == "int8" and dlg.spec.device == "cuda"
    assert built_in.cost("auto") == est.cost("auto") or built_in.available != est.available
    assert built_in.weights == est.weights


def test_hf_cache_scan_lists_model_snapshots(tmp_path):
    from engine.model.catalog import Store, scan

    repo = tmp_path / "hub" / "models--someone--tiny-llm"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "blobs").mkdir()
    blob = repo / "blobs" / "cafe"
    blob.write_text("{}")
    (snap / "config.json").symlink_to(blob)
    (tmp_path / "hub" / "models--other--no-config" / "snapshots" / "1").mkdir(parents=True)
    found = scan(env={"HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "hub")}).models
    assert [(m.store, m.name, m.source) for m in found] == [(Store.HF_CACHE, "someone/tiny-llm", str(snap))]
    assert found[0].problem == "no .safetensors weights in someone/tiny-llm"
    assert scan(env={"HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "missing")}).models == ()


def test_cancel_a_slow_load_keeps_the_model_loaded_before(qtbot, data_dir):
    """File ▸ Models picks a big model; the user presses Cancel in the status bar while its weights load:
    the load stops, the message says so, and the chat goes on with the model loaded before."""
    import threading

    from app_helpers import make_info

    from engine.config import ModelSpec
    from engine.errors import LoadCancelled

    started = threading.Event()

    def load(spec, progress, cancel):
        if spec.source == "demo":
            return type("L", (), {"info": make_info(name="first")})()
        started.set()
        progress("loading big: tensor 1 of 500", 0.2)
        if not cancel.wait(30):
            raise AssertionError("the cancel never reached the worker")
        raise LoadCancelled("loading big was cancelled")

    backend = EngineBackend(load=load, make_session=lambda loaded, cache: _Raising())
    w = open_window(qtbot, data_dir, "demo", backend=backend)
    try:
        w.load_model(ModelSpec(source="/models/big"))
        qtbot.waitUntil(started.is_set, timeout=5_000)
        qtbot.waitUntil(lambda: w.status.progress.value() == 20, timeout=5_000)
        assert w.status.cancel.isVisible() and w.status.progress.isVisible()
        with qtbot.waitSignal(w.error_shown, timeout=10_000) as blocker:
            w.status.cancel.click()
        assert blocker.args[0] == "Loading /models/big was cancelled." == w.chat.notice.text
        assert w.info.name == "first" and not w.status.cancel.isVisible() and not w.models.loading
        assert w.chat.send_button.isEnabled()
    finally:
        close_window(w)


def test_bfloat16_weights_choice_halves_the_estimate_and_loads_in_bf16(qtbot, data_dir, stories_path):
    """The "bfloat16" weights choice on the CPU: weights and KV at 2 bytes in the estimate, a spec the loader runs in
    bfloat16, and the choice saved and read back from the settings."""
    from app.settings.cache_settings import model_spec, weights_choice
    from app.models.dialog import ModelsDialog
    from app.settings.store import Settings
    from engine.model.loader import load_model

    s = Settings.from_data_dir(data_dir)
    s.add_recent_model(str(stories_path))
    dlg = ModelsDialog(s, environment={"cuda": False})
    qtbot.addWidget(dlg)
    dlg.list.setCurrentRow(2)  # after the two built-in models
    dlg.device.setCurrentIndex(dlg.device.findData("cpu"))
    full = dlg.estimate()
    dlg.quantization.setCurrentIndex(dlg.quantization.findData("bf16"))
    half = dlg.estimate()
    assert full.cost("auto").bytes_per_token == 2 * 5 * 4 * 8 * 4
    assert half.cost("auto").bytes_per_token == full.cost("auto").bytes_per_token // 2
    assert half.weights.bytes == full.weights.bytes // 2
    dlg.accept_choice()
    assert (dlg.spec.dtype, dlg.spec.quantization, dlg.spec.device) == ("bfloat16", "none", "cpu")
    s.set("model/quantization", weights_choice(dlg.spec))
    s.set("model/device", dlg.spec.device)
    assert model_spec(s, str(stories_path)) == dlg.spec
    lm = load_model(dlg.spec)
    assert lm.info.dtype == lm.info.kv_dtype == "bfloat16"
    assert lm.info.weights_bytes == half.weights.bytes
