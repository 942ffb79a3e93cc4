"""Choose a model: the built-in stories260K, the random-weight demo, recent models, models in the Hugging Face
cache, a folder, or a hub id to download (with progress and cancel). Shows a memory estimate (weights + KV at
the chosen context) and, on CUDA, whether it fits.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot
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
from app.models.estimate import MemoryEstimate, estimate_demo, estimate_folder
from app.shell.format import human_bytes
from app.shell.glossary import CONTROLS
from app.settings.store import Settings
from engine.model.builtin import BUILTIN_LABEL, BUILTIN_MODEL, DEMO_LABEL, builtin_model_dir, is_builtin
from engine.config import ModelSpec

QUANT_CHOICES = (("none (full precision)", "none"), ("bfloat16 (half the bytes)", "bf16"),
                 ("8-bit (bitsandbytes)", "int8"), ("4-bit NF4 (bitsandbytes)", "nf4"))
DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
CURATED = ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct")
ROLE = Qt.ItemDataRole.UserRole


def scan_hf_cache(cache_dir: str | None = None) -> list[tuple[str, str]]:
    """(repo id, snapshot folder) of model repos in the local HF cache that have a config.json."""
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(cache_dir)
    except Exception:  # noqa: BLE001 - no cache, unreadable cache: nothing to list
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        for rev in revs:
            if (Path(rev.snapshot_path) / "config.json").exists():
                out.append((repo.repo_id, str(rev.snapshot_path)))
                break
    return out


def describe_download_error(exc: BaseException, repo_id: str) -> str:
    """A one-line reason for a failed download."""
    name = exc.__class__.__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if name in ("OfflineModeIsEnabled",) or "offline" in text.lower():
        return f"Offline: cannot download {repo_id} (HF_HUB_OFFLINE is set). Open a local folder or use the demo."
    if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
        return f"{repo_id}: not found on the Hub, or it needs a login ({name})."
    if name in ("ConnectionError", "ConnectTimeout", "ReadTimeout", "LocalEntryNotFoundError", "MaxRetryError") \
            or "connect" in text.lower() or "resolve" in text.lower():
        return f"Offline: cannot reach huggingface.co to download {repo_id}. Open a local folder or use the demo."
    if name == "DownloadCancelled":
        return f"Download of {repo_id} cancelled."
    return f"Download of {repo_id} failed: {name}: {text}"[:300]


class DownloadCancelled(Exception):
    """Raised inside the download's progress callback when the user presses Cancel."""


class Downloader(QObject):
    """Downloads one hub repo (safetensors, configs, tokenizer) on its own thread."""

    progress = Signal(float, str)
    done = Signal(str)  # local folder
    failed = Signal(str)

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = threading.Event()

    @Slot(str)
    def run(self, repo_id: str) -> None:
        try:
            from huggingface_hub import snapshot_download
            from tqdm.auto import tqdm as base_tqdm

            owner = self

            class _Progress(base_tqdm):  # type: ignore[misc, valid-type]
                def __init__(self, *a: Any, **k: Any) -> None:
                    k.pop("name", None)
                    super().__init__(*a, **k)

                def update(self, n: float = 1) -> Any:
                    if owner.cancelled.is_set():
                        raise DownloadCancelled()
                    out = super().update(n)
                    if self.total:
                        owner.progress.emit(min(self.n / self.total, 1.0), f"{human_bytes(self.n)} of {human_bytes(self.total)}")
                    return out

            path = snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja", "*.tiktoken"],
                tqdm_class=_Progress,
            )
            self.done.emit(str(path))
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a message
            self.failed.emit(describe_download_error(exc, repo_id))


class ModelsDialog(QDialog):
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
        row = QHBoxLayout()
        row.addWidget(self.open_button)
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
    def _add(self, text: str, source: str, folder: str | None, tip: str = "") -> QListWidgetItem:
        item = QListWidgetItem(text)
        item.setData(ROLE, {"source": source, "folder": folder})
        item.setToolTip(tip or source)
        self.list.addItem(item)
        return item

    def populate(self, current: Any = None) -> None:
        self.list.clear()
        first = self._add(f"{BUILTIN_LABEL} — real text, no download", BUILTIN_MODEL, str(builtin_model_dir()),
                          "Karpathy's stories260K (MIT), shipped with KV Scope: 260K parameters, 512-token context")
        self._add(f"{DEMO_LABEL} — gibberish text, real cache, no download", "demo", None,
                  "a seeded random-weight Llama made in code, for shapes no shipped model has")
        seen = {"demo", BUILTIN_MODEL}
        for source in self.settings.get("model/recent"):
            if source in seen:
                continue
            seen.add(source)
            folder = source if Path(source).is_dir() else None
            self._add(f"Recent: {source}", source, folder)
        cached = scan_hf_cache()
        for repo_id, folder in cached:
            if repo_id in seen:
                continue
            seen.add(repo_id)
            self._add(f"HF cache: {repo_id}", repo_id, folder, folder)
        for repo_id in CURATED:
            if repo_id not in seen:
                self._add(f"Suggested (download): {repo_id}", repo_id, None)
        self.list.setCurrentItem(first)

    def choice(self) -> dict | None:
        item = self.list.currentItem()
        return item.data(ROLE) if item is not None else None

    def choose_draft(self) -> None:
        """The selected local model drafts for speculative decoding (the worker checks its tokenizer)."""
        c = self.choice()
        if c is None or not (c["folder"] or is_builtin(c["source"])):
            self.message.setText("A draft model must be on this computer: the built-in model, a folder or the cache.")
            return
        source = c["source"] if is_builtin(c["source"]) else c["folder"]
        self.draft_chosen.emit(source)
        self.message.setText(f"Draft model for speculative decoding: {source} (the Speculation tab says if it fits).")

    def _open_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a model folder")
        if folder:
            self.add_folder(folder)

    def add_folder(self, folder: str) -> None:
        item = self._add(f"Folder: {folder}", folder, folder)
        self.list.setCurrentItem(item)

    # -- estimate -------------------------------------------------------------------------------------------
    def estimate(self) -> MemoryEstimate | None:
        c = self.choice()
        if c is None:
            return None
        device = self.device.currentData()
        dev = "cuda" if device == "auto" and self.environment.get("cuda") else ("cpu" if device == "auto" else device)
        if c["source"] == "demo":
            return estimate_demo(self.context.value(), dev)
        if c["folder"]:
            try:
                return estimate_folder(c["folder"], self.context.value(), self.quantization.currentData(), dev)
            except (OSError, ValueError):
                return None
        return None

    def _update_estimate(self) -> None:
        est = self.estimate()
        if est is None:
            self.estimate_label.setText("Estimate: not available until the model's files are on this computer.")
            return
        text = (f"Estimate: weights <b>{human_bytes(est.weights_bytes)}</b> + KV cache <b>{human_bytes(est.kv_bytes)}</b> "
                f"at {est.context} tokens ({human_bytes(est.kv_bytes_per_token)}/token) = "
                f"<b>{human_bytes(est.total_bytes)}</b>")
        if est.layers and est.kv_heads and est.head_dim:
            text += (f"<br>KV cache as int8 pages {human_bytes(est.kv_bytes_as('int8'))}, as int4 "
                     f"{human_bytes(est.kv_bytes_as('int4'))} "
                     "(Cache policy ▸ Key precision / Value precision, pages of 16)")
        if est.max_context and self.context.value() > est.max_context:
            text += f"<br>The model's context is {est.max_context} tokens; the estimate uses that."
        total = int(self.environment.get("device_total_bytes") or 0)
        on_cuda = self.device.currentData() == "cuda" or (self.device.currentData() == "auto" and self.environment.get("cuda"))
        if on_cuda and total:
            if est.fits(total):
                text += f"<br><span style='color:#43c59e'>Fits in {human_bytes(total)} of GPU memory.</span>"
            else:
                text += (f"<br><span style='color:#ff8080'>Will not fit in {human_bytes(total)} of GPU memory: "
                         "try 8-bit/4-bit weights, a shorter context, or the CPU.</span>")
        elif on_cuda:
            text += "<br>GPU memory is known once the engine has started."
        self.estimate_label.setText(text)

    # -- download -------------------------------------------------------------------------------------------
    def download(self) -> None:
        repo_id = self.hub_id.text().strip()
        if not repo_id:
            c = self.choice()
            repo_id = c["source"] if c and not c["folder"] and c["source"] != "demo" else ""
        if not repo_id or "/" not in repo_id:
            self.message.setText("Type a hub id such as owner/name.")
            return
        self._thread = QThread()
        self._downloader = Downloader()
        self._downloader.moveToThread(self._thread)
        self._start_download.connect(self._downloader.run)
        self._downloader.progress.connect(self._on_download_progress)
        self._downloader.done.connect(self._on_downloaded)
        self._downloader.failed.connect(self._on_download_failed)
        self._thread.start()
        self.download_bar.setVisible(True)
        self.download_bar.setRange(0, 0)
        self.download_button.setEnabled(False)
        self.cancel_download_button.setEnabled(True)
        self.message.setText(f"Downloading {repo_id}…")
        self._repo = repo_id
        self._start_download.emit(repo_id)

    def cancel_download(self) -> None:
        if self._downloader is not None:
            self._downloader.cancelled.set()
            self.message.setText("Cancelling…")

    def _on_download_progress(self, fraction: float, text: str) -> None:
        self.download_bar.setRange(0, 1000)
        self.download_bar.setValue(int(fraction * 1000))
        self.message.setText(f"Downloading {self._repo}: {text}")

    def _on_downloaded(self, folder: str) -> None:
        self._end_download()
        self.message.setText(f"Downloaded {self._repo}.")
        item = self._add(f"HF cache: {self._repo}", self._repo, folder, folder)
        self.list.setCurrentItem(item)

    def _on_download_failed(self, message: str) -> None:
        self._end_download()
        self.message.setText(f"<span style='color:#ff8080'>{message}</span>")

    def _end_download(self) -> None:
        self.download_bar.setVisible(False)
        self.download_button.setEnabled(True)
        self.cancel_download_button.setEnabled(False)
        if self._thread is not None:
            self._thread.quit()
            self._thread.wait(5000)
            self._thread = None
        self._start_download.disconnect()

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
        # the built-in model by name, so the settings do not keep this installation's path
        source = c["source"] if is_builtin(c["source"]) else (c["folder"] or c["source"])
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
