"""Choose a model: the built-in stories260K, the random-weight demo, recent models, the models found on this computer
(the Hugging Face cache, LM Studio, Ollama and the user's models folders: ``app.models.found``, scanned off the GUI
thread), a folder or GGUF file, or a hub id to download (with progress and cancel). Shows the engine's memory
verdict before loading (``engine.model.fit``: the weights as they will be held, the KV cache at the chosen context and
a token's bytes at every precision, the longest context that fits in the free RAM or GPU memory); a model that cannot
be opened, or will not fit, says why in the dialog's banner, in one line.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QThread, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.settings.cache_settings import spec_for
from app.models.download import Downloader, HubDownload, folder_problem
from app.models.estimate import available, verdict, verdict_demo, weights
from app.models.found import item_text, item_tip, start_scan
from app.ground.format import fit_html, wont_fit_words
from app.ground.glossary import CONTROLS
from app.settings.store import Settings
from engine.model.builtin import BUILTIN_LABEL, BUILTIN_MODEL, DEMO_LABEL, builtin_model_dir, is_builtin
from engine.config import ModelSpec
from engine.errors import EngineError
from engine.model.gguf_file import looks_like_gguf

QUANT_CHOICES = (("none (full precision)", "none"), ("bfloat16 (half the bytes)", "bf16"),
                 ("8-bit (bitsandbytes)", "int8"), ("4-bit NF4 (bitsandbytes)", "nf4"))
DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
CURATED = ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct")
ROLE = Qt.ItemDataRole.UserRole


class ModelsDialog(HubDownload, QDialog):
    """Pick a model and how to load it. After ``exec()`` returns true, ``spec`` is the choice."""

    _start_download = Signal(str)
    draft_chosen = Signal(str)  # a local model to draft for speculative decoding (the Speculation tab's choice)

    def __init__(self, settings: Settings, environment: dict | None = None, current: Any = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(720, 560)
        self.settings = settings
        self.environment = dict(environment or {})
        self.spec: ModelSpec | None = None
        self._thread: QThread | None = None
        self._downloader: Downloader | None = None
        self._build_list()
        self._build_download()
        self._build_options(settings)
        self._lay_out()
        self.populate(current)

    def _build_list(self) -> None:
        """The models on this computer, Open folder… and Use as draft model."""
        self.list = QListWidget()
        self.list.setObjectName("modelList")
        self.list.currentItemChanged.connect(lambda *_: self._update_estimate())
        self.list.itemDoubleClicked.connect(lambda *_: self.accept_choice())
        self.open_button = QPushButton("Open folder…")
        self.open_button.clicked.connect(self._open_folder)
        self.open_file_button = QPushButton("Open GGUF file…")
        self.open_file_button.clicked.connect(self._open_file)
        self.add_folder_button = QPushButton("Add models folder…")
        self.add_folder_button.setToolTip("A folder of models to list here from now on (its GGUF files and model "
                                          "folders); nothing in it is written")
        self.add_folder_button.clicked.connect(self._add_models_folder)
        self.scan_label = QLabel("")
        self.scan_label.setObjectName("scanState")
        self.scan_label.setWordWrap(True)  # a walk that stopped says where, in a line of its own
        self.draft_button = QPushButton("Use as draft model")
        self.draft_button.setToolTip(CONTROLS["draft_path"].tip + "\nSpeculative decoding uses it from then on "
                                     "(the Speculation tab).")
        self.draft_button.clicked.connect(self.choose_draft)

    def _build_download(self) -> None:
        """A hub id to download, its progress and the dialog's message line."""
        self.hub_id = QLineEdit()
        self.hub_id.setPlaceholderText("hub id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
        self.download_button = QPushButton("Download")
        self.download_button.clicked.connect(self.download)
        self.cancel_download_button = QPushButton("Cancel download")
        self.cancel_download_button.setEnabled(False)
        self.cancel_download_button.clicked.connect(self.cancel_download)
        self.download_bar = QProgressBar()
        self.download_bar.setVisible(False)
        self.message = QLabel("")
        self.message.setObjectName("dialogMessage")
        self.message.setWordWrap(True)

    def _build_options(self, settings: Settings) -> None:
        """How to load it (weights, device) and the context its memory estimate is for; Load and Cancel."""
        self.quantization = QComboBox()
        for label, value in QUANT_CHOICES:
            self.quantization.addItem(label, value)
        self.quantization.setCurrentIndex(max(self.quantization.findData(settings.get("model/quantization")), 0))
        self.device = QComboBox()
        for d in DEVICE_CHOICES:
            self.device.addItem(d, d)
        self.device.setCurrentIndex(max(self.device.findData(settings.get("model/device")), 0))
        self.context = QSpinBox()
        self.context.setRange(128, 1_048_576)
        self.context.setSingleStep(1024)
        self.context.setValue(settings.get("model/context"))
        self.context.setSuffix(" tokens")
        for w in (self.quantization, self.device):
            w.currentIndexChanged.connect(self._update_estimate)
        self.context.valueChanged.connect(self._update_estimate)
        self.estimate_label = QLabel("")
        self.estimate_label.setObjectName("estimate")
        self.estimate_label.setWordWrap(True)

        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.load_button = buttons.addButton("Load", QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.accepted.connect(self.accept_choice)
        buttons.rejected.connect(self.reject)
        self.buttons = buttons

    def _lay_out(self) -> None:
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("<b>Models on this computer</b>"))
        layout.addWidget(self.list, 1)
        layout.addWidget(self.scan_label)
        row = QHBoxLayout()
        row.addWidget(self.open_button)
        row.addWidget(self.open_file_button)
        row.addWidget(self.add_folder_button)
        row.addStretch(1)
        row.addWidget(self.draft_button)
        layout.addLayout(row)
        layout.addWidget(QLabel("<b>Download from the Hugging Face Hub</b>"))
        drow = QHBoxLayout()
        drow.addWidget(self.hub_id, 1)
        drow.addWidget(self.download_button)
        drow.addWidget(self.cancel_download_button)
        layout.addLayout(drow)
        layout.addWidget(self.download_bar)
        form = QFormLayout()
        form.addRow("weights", self.quantization)
        form.addRow("device", self.device)
        form.addRow("context for the estimate", self.context)
        layout.addLayout(form)
        layout.addWidget(self.estimate_label)
        layout.addWidget(self.message)
        layout.addWidget(self.buttons)

    # -- the list -------------------------------------------------------------------------------------------
    def _add(self, text: str, source: str, folder: str | None, tip: str = "", found: Any = None,
             gguf: str | None = None, row: int | None = None) -> QListWidgetItem:
        """One line: ``source`` is what loads; ``folder`` a local model folder, ``gguf`` a local GGUF file, ``found``
        the catalog's ``FoundModel`` (its facts and any problem)."""
        item = QListWidgetItem(text)
        item.setData(ROLE, {"source": source, "folder": folder, "found": found, "gguf": gguf})
        item.setToolTip(tip or source)
        if found is not None and found.problem:
            item.setForeground(self.palette().placeholderText())
        self.list.insertItem(self.list.count() if row is None else row, item)
        return item

    def populate(self, current: Any = None) -> None:
        self.list.clear()
        first = self._add(f"{BUILTIN_LABEL} — real text, no download", BUILTIN_MODEL, str(builtin_model_dir()),
                          "Karpathy's stories260K (MIT), shipped with KV Scope: 260K parameters, 512-token context")
        self._add(f"{DEMO_LABEL} — gibberish text, real cache, no download", "demo", None,
                  "a seeded random-weight Llama made in code, for shapes no shipped model has")
        self._seen = {"demo", BUILTIN_MODEL}
        for source in self.settings.get("model/recent"):
            if source in self._seen:
                continue
            self._seen.add(source)
            gguf = source if looks_like_gguf(source) else None
            folder = source if not gguf and Path(source).is_dir() else None
            self._add(f"Recent: {source}", source, folder, gguf=gguf)
        self._suggested = [self._add(f"Suggested (download): {r}", r, None) for r in CURATED if r not in self._seen]
        self.list.setCurrentItem(first)
        self.rescan()

    def rescan(self) -> None:
        """Look for models on this computer again (off the GUI thread); their lines come before the suggestions."""
        self.scan_label.setText("Looking for models on this computer (Hugging Face cache, LM Studio, Ollama, your "
                                "folders)…")
        start_scan(list(self.settings.get("model/folders")), self._on_scanned)

    def _on_scanned(self, result: object) -> None:
        if isinstance(result, str):
            self.scan_label.setText(result)
            return
        found, notes = result.models, result.notes  # engine.model.catalog.Scan
        for i in reversed(range(self.list.count())):  # a rescan replaces what the last one found
            c = self.list.item(i).data(ROLE)
            if c.get("found") is not None:
                self.list.takeItem(i)
        row = self.list.row(self._suggested[0]) if self._suggested else self.list.count()
        for m in found:
            if m.source in self._seen:
                continue
            folder = m.source if m.kind == "folder" else None
            self._add(item_text(m), m.source, folder, item_tip(m), found=m,
                      gguf=m.source if m.kind == "gguf" else None, row=row)
            row += 1
        usable = sum(1 for m in found if not m.problem)
        self.scan_label.setText(f"Found {usable} model{'s' if usable != 1 else ''} on this computer"
                                + (f" ({len(found) - usable} cannot be opened: select one to see why)."
                                   if len(found) > usable else ".") + "".join(f"\n{n}." for n in notes))

    def choice(self) -> dict | None:
        item = self.list.currentItem()
        return item.data(ROLE) if item is not None else None

    def choose_draft(self) -> None:
        """The selected local model drafts for speculative decoding (the worker checks its tokenizer)."""
        c = self.choice()
        if c is None or not (c["folder"] or c["gguf"] or is_builtin(c["source"])):
            self.message.setText("A draft model must be on this computer: the built-in model, a folder or the cache.")
            return
        source = c["source"] if is_builtin(c["source"]) else (c["folder"] or c["gguf"])
        self.draft_chosen.emit(source)
        self.message.setText(f"Draft model for speculative decoding: {source} (the Speculation tab says if it fits).")

    def _open_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a model folder")
        if folder:
            self.add_folder(folder)

    def _open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF file", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.open_file(path)

    def open_file(self, path: str) -> bool:
        """Add the GGUF file at ``path`` and select it; a file that cannot be opened is not added and the banner
        says why, in one line."""
        from engine.model.gguf_checks import check_model
        from engine.model.gguf_file import read_gguf
        from engine.model.gguf_load import check_architecture

        try:
            info = read_gguf(path)
            check_architecture(info)
            check_model(info)
        except EngineError as e:
            self.show_problem(str(e))
            return False
        item = self._add(f"File: {path} — {info.architecture} · {info.weights_type}", path, None, path, gguf=path)
        self.list.setCurrentItem(item)
        return True

    def _add_models_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a folder of models")
        if folder:
            self.add_models_folder(folder)

    def add_models_folder(self, folder: str) -> None:
        """List the models in ``folder`` from now on (saved in the settings) and look again."""
        folders = [f for f in self.settings.get("model/folders") if f != folder] + [folder]
        self.settings.set("model/folders", folders)
        self.rescan()

    def show_problem(self, line: str) -> None:
        """The dialog's banner: why the chosen (or just opened) model cannot be opened, until the choice changes."""
        self.message.setText(f"<span style='color:#ff8080'>{html.escape(line, quote=False)}</span>")
        self._problem_shown = True

    def problem(self) -> str:
        """Why the selected model cannot be opened, or will not fit ("" when it can, as far as its files and the
        free memory tell before loading)."""
        return self._file_problem() or self._fit_problem()

    def _file_problem(self) -> str:
        c = self.choice()
        if c is None:
            return ""
        if c["found"] is not None and c["found"].problem:
            return c["found"].problem
        if c["folder"] and not is_builtin(c["source"]):  # a recent folder may have changed since
            return folder_problem(c["folder"])
        if c["gguf"]:
            try:
                self._verdict(c)
            except EngineError as e:
                return str(e)
        return ""

    def _fit_problem(self) -> str:
        est = self.estimate()
        return wont_fit_words(est) if est is not None and not est.fits else ""

    # -- estimate -------------------------------------------------------------------------------------------
    def _device(self) -> str:
        device = self.device.currentData()
        return "cuda" if device == "auto" and self.environment.get("cuda") else ("cpu" if device == "auto" else device)

    def _verdict(self, c: dict):
        """The engine's verdict for choice ``c`` (``EngineError`` for files it cannot read; None: not on disk)."""
        dev = self._device()
        free = available(dev, self.environment)
        if c["source"] == "demo":
            return verdict_demo(dev, free)
        path = c["found"].source if c["found"] is not None else (c["gguf"] or c["folder"])
        if not path:
            return None
        key = (path, self.quantization.currentData(), dev)
        if getattr(self, "_planned", (None, None))[0] != key:  # headers read once per choice, not per context step
            self._planned = (key, weights(path, self.quantization.currentData(), dev))
        return verdict(path, self.quantization.currentData(), dev, free, self._planned[1])

    def estimate(self):
        """The memory verdict of the chosen model (``engine.model.fit.Fit``), None when there is none to give."""
        c = self.choice()
        if c is None:
            return None
        try:
            return self._verdict(c)
        except EngineError:
            return None

    def _update_estimate(self) -> None:
        cannot = self._file_problem()
        problem = cannot or self._fit_problem()
        if problem:
            self.show_problem(problem)
        elif getattr(self, "_problem_shown", False):  # a problem said before: gone with the choice
            self.message.setText("")
            self._problem_shown = False
        est = None if cannot else self.estimate()
        if est is None:
            self.estimate_label.setText("Estimate: not available until the model's files are on this computer."
                                        if not cannot else "Estimate: not available (this model cannot be opened).")
            return
        self.estimate_label.setText(fit_html(est, self.context.value()))

    def done(self, result: int) -> None:  # noqa: D401 - Qt override
        if self._downloader is not None:
            self._downloader.cancelled.set()
        if self._thread is not None:
            self._thread.quit()
            self._thread.wait(2000)
        super().done(result)

    # -- accept ---------------------------------------------------------------------------------------------
    def accept_choice(self) -> None:
        c = self.choice()
        if c is None:
            return
        problem = self.problem()  # "can I?" first: a bad file is said here, the dialog stays open
        if problem:
            self.show_problem(problem)
            return
        # the built-in model by name, so the settings do not keep this installation's path
        source = c["source"] if is_builtin(c["source"]) else (c["folder"] or c["gguf"] or c["source"])
        try:
            if source == "demo":
                self.spec = ModelSpec(source="demo", device=self.device.currentData())
            else:
                self.spec = spec_for(source, self.quantization.currentData(), self.device.currentData())
        except ValueError as exc:
            self.message.setText(str(exc))
            return
        self.settings.set("model/context", self.context.value())
        self.accept()
