"""Downloading a hub repo for the models dialog: on its own thread, with progress, cancel and a one-line reason
when it fails."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.ground.format import human_bytes


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


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")  # the Hub's owner/name (no path, no '..')


def local_path(text: str) -> bool:
    """``text`` names a place on this computer (absolute, home, relative from '.', a Windows path, or a file or folder
    that exists), not a hub id (owner/name never starts with any of those)."""
    if not text:
        return False
    if text.startswith(("/", "~", ".")) or "\\" in text or re.match(r"[A-Za-z]:", text):
        return True
    return Path(text).exists()


def folder_problem(folder: str) -> str:
    """Why ``folder`` cannot be loaded as a model folder ("" when it can, as far as its files tell)."""
    path = Path(folder)
    if not path.is_dir():
        return f"{folder}: the folder is gone."
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f" (it holds {ggufs[0]}: Open GGUF file… loads that)" if ggufs else ""
        return (f"{folder} is not a model folder: it has no config.json (a Hugging Face model folder holds config.json, "
                f"the weights and the tokenizer){hint}.")
    return ""


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


class HubDownload:
    """The models dialog's "Download from the Hugging Face Hub" row — a ``Downloader`` on its own ``QThread``,
    progress, cancel and the result as a new line of the list — and the folders opened or typed there (a path in the
    hub id field is opened as one). Mixed into ``ModelsDialog`` (which declares the
    ``_start_download`` signal and owns ``hub_id``, ``download_bar``, the buttons, ``message`` and ``list``)."""

    def download(self) -> None:
        repo_id = self.hub_id.text().strip()
        if not repo_id:
            c = self.choice()
            repo_id = c["source"] if c and not c["folder"] and c["source"] != "demo" else ""
        if local_path(repo_id):  # a folder or a file typed where a hub id goes: opened as one, never sent to the Hub
            self.open_typed_path(repo_id)
            return
        if not HUB_ID.fullmatch(repo_id):
            self.message.setText(f"“{repo_id}” is not a hub id: type owner/name (such as "
                                 "HuggingFaceTB/SmolLM2-135M-Instruct), or a model folder on this computer."
                                 if repo_id else "Type a hub id such as owner/name.")
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

    def add_folder(self, folder: str) -> bool:
        """List the model folder ``folder`` and select it; one without config.json is not a model folder: not
        listed, and the banner says why."""
        problem = folder_problem(folder)
        if problem:
            self.show_problem(problem)
            return False
        self.list.setCurrentItem(self._add(f"Folder: {folder}", folder, folder))
        return True

    def open_typed_path(self, text: str) -> None:
        """A path typed in the hub id field: a model folder or GGUF file is opened as one (listed and selected);
        anything else is said in one line."""
        path = Path(text).expanduser()
        if path.is_dir():
            self.add_folder(str(path))
        elif path.is_file():
            self.open_file(str(path))
        else:
            self.show_problem(f"{text}: no such folder or file on this computer (a hub id is owner/name).")

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
