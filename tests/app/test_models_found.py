"""File ▸ Models on the real window (#32): the models already on the computer (an LM Studio folder, an Ollama store
and a folder the user added, laid out in a temp HOME) are listed with their facts, a GGUF's estimate says its
weights are dequantized, every bad file gets its one line in the dialog's banner and nothing is added, and the
chosen GGUF loads into the window and writes its story."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from app_helpers import close_window, open_window, wait_reply

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from gguf_make import write_gguf  # noqa: E402  (tests/engine's writer)


@pytest.fixture(scope="module")
def store(tmp_path_factory, stories_path):
    from transformers import AutoModelForCausalLM

    t = tmp_path_factory.mktemp("home")
    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32)
    lms = t / "home" / ".lmstudio" / "models" / "kvscope" / "stories-GGUF"
    lms.mkdir(parents=True)
    gguf = write_gguf(model, "llama", stories_path / "tokenizer.model", lms / "stories260K-Q8_0.gguf", "Q8_0")
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    ollama = t / "ollama"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / f"sha256-{digest}").write_bytes(data)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "stories" / "260k"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{digest}", "size": len(data)}]}))
    bad = t / "bad"
    bad.mkdir()
    (bad / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (bad / "empty.gguf").write_bytes(b"")
    (bad / "wrong-magic.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    (bad / "hello.gguf").write_text("hello, this is a text file named like a model\n")
    (bad / "image.gguf").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    (bad / "part-00001-of-00002.gguf").write_bytes(data)
    os.mkfifo(bad / "pipe.gguf")
    (bad / "folder.gguf").mkdir()
    os.symlink("loop.gguf", bad / "loop.gguf")
    return {"home": t / "home", "ollama": ollama, "gguf": gguf, "bad": bad}


BAD_LINES = {
    "truncated.gguf": "truncated.gguf is truncated: ",
    "empty.gguf": "empty.gguf is empty (0 bytes)",
    "wrong-magic.gguf": "wrong-magic.gguf is not a GGUF file (a zip / PyTorch file",
    "hello.gguf": 'hello.gguf is not a GGUF file (a text file: it starts with "hell", not the GGUF signature)',
    "image.gguf": "image.gguf is not a GGUF file (it starts with the bytes 89 50 4e 47, not the GGUF signature)",
    "part-00001-of-00002.gguf": "part-00001-of-00002.gguf is one part of a model split in 2 files and 1 is missing",
    "pipe.gguf": "pipe.gguf is a pipe (FIFO), not a GGUF file",
    "folder.gguf": "folder.gguf is a directory, not a GGUF file",
    "loop.gguf": "loop.gguf is a symbolic link loop, not a GGUF file",
}


def _texts(dlg) -> list[str]:
    return [dlg.list.item(i).text() for i in range(dlg.list.count())]


def test_models_dialog_on_the_real_window(qtbot, data_dir, store, monkeypatch):
    from app.models.dialog import ModelsDialog

    monkeypatch.setenv("HOME", str(store["home"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(store["home"] / "no-hf-cache"))
    monkeypatch.setenv("OLLAMA_MODELS", str(store["ollama"]))
    w = open_window(qtbot, data_dir, "demo")
    try:
        w.settings.set("model/folders", [str(store["bad"])])
        dlg = ModelsDialog(w.settings, environment={"cuda": False}, current=w.info, parent=w)
        qtbot.addWidget(dlg)
        dlg.resize(1024, 600)
        dlg.show()
        qtbot.waitUntil(lambda: dlg.scan_label.text().startswith("Found"), timeout=60_000)
        assert dlg.scan_label.text() == "Found 2 models on this computer (8 cannot be opened: select one to see why)."  # folder.gguf is a directory: walked, not listed
        texts = _texts(dlg)
        lm_line = "LM Studio: kvscope/stories-GGUF/stories260K-Q8_0.gguf — llama · Q8_0 · "
        assert any(t.startswith(lm_line) and t.endswith(" on disk · 512 tokens") for t in texts), texts
        assert any(t.startswith("Ollama: stories:260k — llama · Q8_0") for t in texts), texts
        assert texts.index(next(t for t in texts if t.startswith("Suggested"))) > texts.index(
            next(t for t in texts if t.startswith("Ollama")))  # found models come before the suggestions

        # a bad file the scan found: its line in the banner when selected; Load leaves the dialog open
        row = next(i for i, t in enumerate(texts) if t == "Folder: truncated.gguf — cannot be opened")
        dlg.list.setCurrentRow(row)
        assert BAD_LINES["truncated.gguf"] in dlg.message.text()
        dlg.accept_choice()
        assert dlg.spec is None and dlg.isVisible()

        # every bad file opened with Open GGUF file…: one line in the banner, nothing added to the list
        count = dlg.list.count()
        for name, line in BAD_LINES.items():
            assert dlg.open_file(str(store["bad"] / name)) is False
            assert line in dlg.message.text(), (name, dlg.message.text())
            assert "b'" not in dlg.message.text()  # never Python's notation of bytes (it printed b'hell')
        assert dlg.list.count() == count

        # the LM Studio file: its weights as the GGUF loader will hold them, said with the format
        dlg.list.setCurrentRow(next(i for i, t in enumerate(texts) if t.startswith(lm_line)))
        assert dlg.message.text() == ""  # the banner of the bad file is gone
        est = dlg.estimate()
        held = {"mapped": "mapped from the file", "repacked": "repacked from the file"}.get(
            est.weights.held, "dequantized from Q8_0")
        assert f"(Q8_0, {est.weights.bits_per_weight:.2f} bits per weight, {held})" in dlg.estimate_label.text() \
            or f"(F32, 32.00 bits per weight, {held})" in dlg.estimate_label.text()
        assert est.weights.bytes <= 260_032 * 4
        dlg.grab().save(str(data_dir / "models-dialog.png"))
        dlg.accept_choice()
        assert dlg.spec is not None and dlg.spec.source == str(store["gguf"])

        # loaded into the window: the engine's paged cache, the file's tokenizer, its story
        with qtbot.waitSignal(w.model_loaded, timeout=60_000):
            w.load_model(dlg.spec)
        assert w.info.name == "stories260K-Q8_0.gguf" and w.info.has_chat_template
        w.send("Once upon a time")
        wait_reply(qtbot, w)
        reply = w.history.messages(w.chat_id)[-1].content
        assert "Lily" in reply or "little" in reply, reply

        # a bad file loaded through the window: its one line, the model loaded before stays
        with qtbot.waitSignal(w.error_shown, timeout=30_000) as blocker:
            w.load_model(type(dlg.spec)(source=str(store["bad"] / "pipe.gguf")))
        assert BAD_LINES["pipe.gguf"] in blocker.args[0]
        assert w.info.name == "stories260K-Q8_0.gguf"
    finally:
        close_window(w)


def test_models_dialog_state_machine(qtbot, data_dir, store, monkeypatch):
    """Selecting, opening good and bad files, changing the weights and pressing Load in any order: the banner
    says the current model's problem (or the file just refused) and nothing else, a model that cannot be opened
    is never chosen, only good files are added."""
    from hypothesis import settings as hyp_settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

    from app.models.dialog import ModelsDialog
    from app.settings.store import Settings

    monkeypatch.setenv("HOME", str(store["home"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(store["home"] / "no-hf-cache"))
    monkeypatch.setenv("OLLAMA_MODELS", str(store["ollama"]))
    s = Settings.from_data_dir(data_dir)
    s.set("model/folders", [str(store["bad"])])

    class Dialog(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.dlg = ModelsDialog(s, environment={"cuda": False})
            qtbot.addWidget(self.dlg)
            qtbot.waitUntil(lambda: self.dlg.scan_label.text().startswith("Found"), timeout=60_000)
            self.count = self.dlg.list.count()
            self.banner = ""  # the line the banner must hold ("" none)

        def _chosen(self):
            return self.dlg.problem()

        @rule(row=st.integers(0, 30))
        def select(self, row):
            before = self.dlg.list.currentRow()
            self.dlg.list.setCurrentRow(row % self.dlg.list.count())
            if self.dlg.list.currentRow() != before:
                self.banner = self._chosen()

        @rule(name=st.sampled_from(sorted(BAD_LINES)))
        def open_bad(self, name):
            assert self.dlg.open_file(str(store["bad"] / name)) is False
            self.banner = BAD_LINES[name]

        @rule()
        def open_good(self):
            assert self.dlg.open_file(str(store["gguf"])) is True
            self.count += 1
            self.banner = ""

        @rule(weights=st.sampled_from(["none", "bf16", "int8", "nf4"]))
        def weights(self, weights):
            box = self.dlg.quantization
            before = box.currentIndex()
            box.setCurrentIndex(box.findData(weights))
            if box.currentIndex() != before:
                self.banner = self._chosen()

        @rule()
        def load(self):
            problem = self._chosen()
            self.dlg.accept_choice()
            if problem:
                assert self.dlg.spec is None
                self.banner = problem
            else:
                assert self.dlg.spec is not None
                self.dlg.spec = None

        @invariant()
        def banner_says_the_problem(self):
            text = self.dlg.message.text()
            assert (self.banner in text) if self.banner else text == "", (self.banner, text)
            cannot = "cannot be opened" in self.dlg.estimate_label.text()
            assert cannot == bool(self._chosen())
            assert self.dlg.list.count() == self.count

        def teardown(self):
            self.dlg.close()

    run_state_machine_as_test(Dialog, settings=hyp_settings(max_examples=6, stateful_step_count=12, deadline=None))
