"""Settings ▸ Quantized copies on the real window and engine: a small random llama folder loaded with 8-bit weights
keeps its copy in the engine's default folder, the page shows it (its size, the budget in force), a folder and a
budget chosen there persist and apply to the next real ``--quantize int8`` load (which keeps its copy there, and the
load after it maps it), off keeps none, and Clear removes the copies — only them — and the shown size drops to 0."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from app_helpers import close_window, open_window
from PySide6.QtWidgets import QMessageBox
from test_kv_disk_app import answer_boxes

from app.ground.format import human_bytes
from app.link.copies import BUDGET_ENV, ENV, CopiesConfig, copies_from_settings, engine_default
from app.settings.store import Settings
from engine.config import ModelSpec
from engine.model import q8_load, quant_copies
from engine.quant import kernel

pytestmark = pytest.mark.skipif(kernel.library() is None or not q8_load.available("cpu"),
                                reason="no GGUF block kernels on this machine")
# tests/engine/test_fit.py's shape: 2 layers of 128, 14 linears (~1 MB of bfloat16)
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, stories_path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("copies-app") / "llama"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SHAPE), dtype=torch.bfloat16) \
            .save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(stories_path / name, path / name)
    return path


@pytest.fixture
def started(tmp_path, monkeypatch) -> Path:
    """The environment KV Scope starts in: copies in a folder of this test's (restored after it)."""
    where = tmp_path / "env-copies"
    monkeypatch.setenv(ENV, str(where))
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    return where


def load(qtbot, w, folder: Path):
    with qtbot.waitSignal(w.model_loaded, timeout=120_000) as loaded:
        w.load_model(ModelSpec(source=str(folder), quantization="int8", device="cpu"))
    quant_copies.wait()  # the copy renamed to its final name
    return loaded.args[0]


def open_page(qtbot, w):
    w.menu_actions["quant_copies"].trigger()
    dialog = w.settings_dialog
    assert dialog.tabs.currentWidget() is dialog.copies and dialog.tabs.tabText(dialog.tabs.currentIndex()) == \
        "Quantized copies"
    return dialog


def shown(qtbot, page, text: str) -> None:
    qtbot.waitUntil(lambda: page.size.text().startswith(text), timeout=30_000)


def test_the_setting_persists_applies_to_the_next_load_and_clear_empties_it(qtbot, data_dir, folder, started,
                                                                            tmp_path):
    settings = Settings.from_data_dir(data_dir)
    settings.set("model/quantization", "int8")  # the models dialog's "8-bit" weights choice
    settings.sync()
    w = open_window(qtbot, data_dir, str(folder))
    try:
        assert os.environ[ENV] == str(started) and BUDGET_ENV not in os.environ  # defaults: the environment's
        assert w.info.weights_held == "quantized" and f"kept in {started}" in w.info.weights_kernel
        quant_copies.wait()
        (first,) = started.glob("int8-*.safetensors")
        dialog = open_page(qtbot, w)
        page = dialog.copies
        assert page.enabled.isChecked() and page.budget.value() == 16.0 and page.folder.text() == ""
        assert page.folder.placeholderText() == str(started)  # the folder in force, shown
        shown(qtbot, page, f"{human_bytes(first.stat().st_size)} in 1 copy · budget 16.0 GiB")

        chosen = tmp_path / "chosen"
        page.folder.setText(str(chosen))
        page.budget.setValue(2.0)
        dialog.accept()
        assert copies_from_settings(Settings.from_data_dir(data_dir)) == CopiesConfig(True, str(chosen), 2.0)
        info = load(qtbot, w, folder)  # kept in the chosen folder
        (copy,) = chosen.glob("int8-*.safetensors")
        assert info.weights_held == "quantized" and f"kept in {copy} for the next load" in info.weights_kernel
        info = load(qtbot, w, folder)  # and mapped from it by the next load
        assert info.weights_held == "copied" and f"blocks mapped from {copy}" in info.weights_kernel
        dialog = open_page(qtbot, w)
        assert dialog.copies.folder.text() == str(chosen) and dialog.copies.budget.value() == 2.0
        shown(qtbot, page, f"{human_bytes(copy.stat().st_size)} in 1 copy · budget 2.0 GiB")  # the budget in force

        page.enabled.setChecked(False)
        dialog.apply()
        qtbot.waitUntil(lambda: page.size.text().endswith(" · off: loads neither keep nor use copies"), timeout=30_000)
        copy.unlink()
        info = load(qtbot, w, folder)
        assert "no copy kept" in info.weights_kernel and not list(chosen.glob("*.safetensors"))
        page.enabled.setChecked(True)
        dialog.apply()
        load(qtbot, w, folder)
        (copy,) = chosen.glob("int8-*.safetensors")
        own = chosen / "notes.txt"
        own.write_text("mine")

        # Clear…: a confirmation naming what goes, then no copy and a size of 0 (the user's file stays)
        open_page(qtbot, w)
        size = human_bytes(copy.stat().st_size)
        shown(qtbot, page, f"{size} in 1 copy")
        poll, seen = answer_boxes(QMessageBox.StandardButton.Yes)
        try:
            page.clear_button.click()
        finally:
            poll.stop()
        assert seen and seen[0].startswith(f"Delete 1 quantized copy ({size})?\nIn {chosen}\n")
        shown(qtbot, page, "0 B · budget 2.0 GiB")
        assert not copy.exists() and own.read_text() == "mine" and not page.clear_button.isEnabled()
        assert list(started.glob("int8-*.safetensors")) == [first]  # another folder's copies are not this Clear's
    finally:
        close_window(w)
    assert os.environ[ENV] == str(started) and BUDGET_ENV not in os.environ  # the environment as it started
    # a new window on the same data folder starts under the saved setting
    w = open_window(qtbot, data_dir, str(folder))
    try:
        assert os.environ[ENV] == str(chosen) and os.environ[BUDGET_ENV] == "2"
        assert f"kept in {chosen}" in w.info.weights_kernel
    finally:
        close_window(w)


def test_the_default_folder_is_the_engines(monkeypatch, tmp_path):
    """The page's default (repeated in the app: the engine's module imports torch) is where the engine keeps them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for value in (None, "off", str(tmp_path / "mine")):
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        engine = quant_copies.root() or Path(tmp_path / "xdg" / "kvscope" / "quantized")  # off: where it was
        assert engine_default({ENV: value}) == str(engine)
