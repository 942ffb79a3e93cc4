"""The models already on this computer: the Hugging Face cache, LM Studio's models folder, Ollama's store and the
folders the user added — each with its size, architecture, context length and what the memory estimate needs,
read from headers (``config.json``, a GGUF header), never from the weights.

Read-only and fenced: nothing is written anywhere; a file is read only where its real path (links resolved) lies
inside the root it was found under (a link in a user's folder to ``/etc/shadow`` or ``/dev/zero`` is listed as
such, never opened); directories are walked without following links, at most ``MAX_DEPTH`` deep and
``MAX_ENTRIES`` entries per root; a FIFO or device named ``*.gguf`` is never opened (``gguf_file.check_path``).
Qt-free: the models dialog runs ``scan`` on a worker thread and only renders what it returns.
"""

from __future__ import annotations

import enum
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from engine.errors import EngineError
from engine.model.gguf_file import SPLIT_NAME, SUFFIX, read_gguf

MAX_DEPTH = 4  # below a root: publisher/model/file.gguf is 2
MAX_ENTRIES = 20_000  # directory entries looked at per root
_MAX_JSON = 1 << 20  # config.json / an Ollama manifest: a few KiB; 1 MiB is not one
OLLAMA_MODEL = "application/vnd.ollama.image.model"
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


class Store(enum.Enum):
    """Where a model was found (the app names these)."""

    HF_CACHE = "hf_cache"
    LM_STUDIO = "lm_studio"
    OLLAMA = "ollama"
    FOLDER = "folder"


@dataclass(frozen=True)
class FoundModel:
    """One model on disk. ``source`` is what ``--model`` / ``ModelSpec.source`` takes; ``problem`` is the one line
    that says why it cannot be opened ("" when it can)."""

    store: Store
    name: str
    source: str
    kind: str  # "gguf" | "folder"
    size_bytes: int
    architecture: str = ""
    context_length: int = 0
    weights_type: str = ""  # "Q4_K_M", "F16" for a GGUF; the config's dtype for a folder
    quantized: bool = False  # a GGUF whose weights are dequantized on load
    config: Mapping[str, Any] = field(default_factory=dict)  # config.json's fields the memory estimate reads
    stored_weights_bytes: int = 0  # the weights in config["torch_dtype"] (a GGUF: its parameters as float32)
    problem: str = ""


def default_roots(env: Mapping[str, str] | None = None, home: str | None = None) -> dict[Store, list[Path]]:
    """Where each store keeps its models, from the environment as each tool reads it: ``HF_HUB_CACHE`` (else
    ``HF_HOME``/hub, else ~/.cache/huggingface/hub), ``OLLAMA_MODELS`` (else ~/.ollama/models), LM Studio's
    ~/.lmstudio/models and its older ~/.cache/lm-studio/models."""
    env = os.environ if env is None else env
    h = Path(home or env.get("HOME") or os.path.expanduser("~"))
    hf = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or \
        os.path.join(env.get("HF_HOME") or h / ".cache" / "huggingface", "hub")
    return {Store.HF_CACHE: [Path(hf)],
            Store.LM_STUDIO: [h / ".lmstudio" / "models", h / ".cache" / "lm-studio" / "models"],
            Store.OLLAMA: [Path(env.get("OLLAMA_MODELS") or h / ".ollama" / "models")]}


@dataclass(frozen=True)
class Scan:
    """What ``scan`` found: the models (good and bad, each bad one with its ``problem``) and what the scan itself
    has to say — a walk that stopped at ``MAX_ENTRIES``, a store that could not be read."""

    models: tuple[FoundModel, ...]
    notes: tuple[str, ...] = ()


def scan(folders: Iterable[str | os.PathLike] = (), env: Mapping[str, str] | None = None,
         home: str | None = None) -> Scan:
    """Every model in the stores and in ``folders`` (the user's), in store order then by name; a file found under
    two roots (a user folder that is also LM Studio's) once, under the first. Never raises for what it finds: a
    model that cannot be read is listed with the reason, and the others still are."""
    roots = default_roots(env, home)
    notes: list[str] = []
    found: list[FoundModel] = []
    for root in roots[Store.HF_CACHE]:
        found += _hf_cache(root, notes)
    for root in roots[Store.LM_STUDIO]:
        found += [_gguf(Store.LM_STUDIO, p, root) for p in _ggufs(root, notes)]
    for root in roots[Store.OLLAMA]:
        found += _ollama(root, notes)
    for folder in folders:
        found += _user_folder(Path(os.path.expanduser(str(folder))), notes)
    first: dict[str, Store] = {}
    out = []
    for m in found:  # one blob under two Ollama tags: both names; one file in two roots: the first root's
        key = os.path.realpath(m.source)
        if first.setdefault(key, m.store) == m.store:
            out.append(m)
    return Scan(tuple(out), tuple(dict.fromkeys(notes)))


# -- fences -------------------------------------------------------------------------------------------------------
def inside(path: Path, root: Path) -> bool:
    """True when ``path``'s real location (every link resolved) is ``root``'s or below it."""
    try:
        real, base = os.path.realpath(path), os.path.realpath(root)
    except (OSError, ValueError):
        return False
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _walk(root: Path, notes: list[str]) -> Iterable[tuple[Path, list[str], list[str]]]:
    """``os.walk`` without following links, pruned at ``MAX_DEPTH`` and ``MAX_ENTRIES`` (said in ``notes``, with
    where it stopped); hidden folders skipped."""
    seen = 0
    base = len(root.parts)
    for top, dirs, files in os.walk(root, followlinks=False):
        here = Path(top)
        seen += len(dirs) + len(files)
        if seen > MAX_ENTRIES:
            notes.append(f"Stopped looking in {root} after {MAX_ENTRIES:,} files and folders (at {here}): models "
                         "further in are not listed; add their folder itself")
            return
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if len(here.parts) - base < MAX_DEPTH else []
        yield here, dirs, sorted(files)


def _read_json(path: Path, root: Path) -> Any:
    """A small JSON file read only if it is a regular file inside ``root``; None otherwise or when unreadable."""
    if not inside(path, root):
        return None
    try:
        if not path.is_file() or path.stat().st_size > _MAX_JSON:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None


# -- GGUF files ---------------------------------------------------------------------------------------------------
def _ggufs(root: Path, notes: list[str]) -> list[Path]:
    """The model GGUFs under ``root``: ``*.gguf`` but vision projectors (``mmproj-*``) and the later parts of a
    split model (its first part stands for it)."""
    out = []
    if not root.is_dir():
        return out
    for here, _, files in _walk(root, notes):
        for f in files:
            m = SPLIT_NAME.match(f)
            if f.lower().endswith(SUFFIX) and not f.lower().startswith("mmproj") and (not m or m.group("no") == "00001"):
                out.append(here / f)
    return out


def _gguf(store: Store, path: Path, root: Path, name: str | None = None) -> FoundModel:
    """One GGUF file as found: its header facts, or the one line that says why it cannot be opened."""
    display = name or (str(path.relative_to(root)) if path.is_relative_to(root) else str(path))
    if not inside(path, root):
        return FoundModel(store, display, str(path), "gguf", 0,
                          problem=f"{path.name} links outside {root} ({os.path.realpath(path)}): not read")
    try:
        info = read_gguf(path)
    except EngineError as e:
        return FoundModel(store, display, str(path), "gguf", _size(path), problem=str(e))
    except Exception as e:  # noqa: BLE001 - one file the reader did not expect: listed with why, the scan goes on
        return FoundModel(store, display, str(path), "gguf", _size(path), problem=_unexpected(path, e))
    problem = _gguf_problem(info)
    return FoundModel(store, display, str(path), "gguf", info.size_bytes, info.architecture, info.context_length,
                      info.weights_type, info.quantized, {} if problem else info.config(), info.n_params * 4, problem)


def _gguf_problem(info) -> str:
    """Why a readable GGUF cannot be opened: an architecture transformers cannot read, or a header whose sizes
    do not describe its tensors (``engine.model.gguf_checks``); "" when it can."""
    from engine.model.gguf_checks import check_model
    from engine.model.gguf_load import check_architecture

    try:
        check_architecture(info)
        check_model(info)
    except EngineError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        return _unexpected(Path(info.path), e)
    return ""


def _unexpected(path: Path, e: BaseException) -> str:
    return f"{path.name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def _whole(v: Any) -> int:
    return v if type(v) is int and v > 0 else 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


# -- Hugging Face folders -----------------------------------------------------------------------------------------
def _folder(store: Store, folder: Path, root: Path, name: str) -> FoundModel | None:
    """A folder with a ``config.json`` (a Hugging Face model): its shape from that file, its weights' bytes; a
    folder that cannot be read is listed with why."""
    try:
        return _folder_facts(store, folder, root, name)
    except Exception as e:  # noqa: BLE001 - one folder the scan did not expect: listed with why, the scan goes on
        return FoundModel(store, name, str(folder), "folder", 0, problem=_unexpected(folder, e))


def _folder_facts(store: Store, folder: Path, root: Path, name: str) -> FoundModel | None:
    from engine.model.model_files import config_problem

    cfg = _read_json(folder / "config.json", root)
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    weights = [p for p in folder.glob("*.safetensors") if inside(p, root)]
    stored = sum(_size(p) for p in weights)
    total = sum(_size(p) for p in folder.iterdir() if inside(p, root)) if folder.is_dir() else 0
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else cfg.get("model_type") or ""
    bad = config_problem(cfg)
    problem = f"{name}: config.json's {bad}" if bad else "" if weights else f"no .safetensors weights in {name}"
    dtype = text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or ""
    return FoundModel(store, name, str(folder), "folder", total, str(arch)[:100],
                      _whole(text.get("max_position_embeddings")), str(dtype)[:20], False,
                      {} if bad else cfg, stored, problem)


def _hf_cache(root: Path, notes: list[str]) -> list[FoundModel]:
    """Model repos in a Hugging Face hub cache (``huggingface_hub.scan_cache_dir``): the newest revision of each,
    as a folder model when it has a config.json, and each GGUF file in it."""
    if not root.is_dir():
        return []
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(root)
    except Exception as e:  # noqa: BLE001 - a cache it cannot read: said, nothing listed from it
        notes.append(f"The Hugging Face cache in {root} cannot be read ({type(e).__name__}): its models are not listed")
        return []
    out: list[FoundModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        snap = Path(rev.snapshot_path)
        m = _folder(Store.HF_CACHE, snap, root, repo.repo_id)
        if m is not None:
            out.append(m)
        out += [_gguf(Store.HF_CACHE, p, root, f"{repo.repo_id}/{p.relative_to(snap)}")
                for p in _ggufs_in_snapshot(snap, notes)]
    return out


def _ggufs_in_snapshot(snap: Path, notes: list[str]) -> list[Path]:
    """A snapshot's GGUF files: links into the cache's blobs, so listed by name, not walked by real path."""
    out = []
    for here, _, files in _walk(snap, notes):
        out += [here / f for f in files if f.lower().endswith(SUFFIX) and not f.lower().startswith("mmproj")
                and (not SPLIT_NAME.match(f) or SPLIT_NAME.match(f).group("no") == "00001")]
    return out


# -- Ollama -------------------------------------------------------------------------------------------------------
def _ollama(root: Path, notes: list[str]) -> list[FoundModel]:
    """Each model tag in an Ollama store: ``manifests/<host>/<namespace>/<name>/<tag>`` (JSON) names its weights'
    blob by digest (the layer of mediaType ``application/vnd.ollama.image.model``) in ``blobs/sha256-<hex>``."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return []
    out = []
    for here, _, files in _walk(manifests, notes):
        rel = here.relative_to(manifests).parts
        if len(rel) != 3:  # host / namespace / name
            continue
        host, namespace, model = rel
        for tag in files:
            name = f"{model}:{tag}" if (host, namespace) == ("registry.ollama.ai", "library") else \
                f"{namespace}/{model}:{tag}" if host == "registry.ollama.ai" else f"{host}/{namespace}/{model}:{tag}"
            found = _ollama_tag(root, here / tag, name)
            if found is not None:
                out.append(found)
    return out


def _ollama_tag(root: Path, manifest: Path, name: str) -> FoundModel | None:
    data = _read_json(manifest, root)
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        return None
    layer = next((x for x in data["layers"] if isinstance(x, dict) and x.get("mediaType") == OLLAMA_MODEL), None)
    if layer is None:
        return None  # an embedding-only or adapter manifest: no model weights to open
    m = _DIGEST.match(str(layer.get("digest") or ""))
    if m is None:
        return FoundModel(Store.OLLAMA, name, str(manifest), "gguf", 0,
                          problem=f"{name}: its manifest names no sha256 digest for the model's weights")
    blob = root / "blobs" / f"sha256-{m.group(1)}"
    if not os.path.lexists(blob):
        return FoundModel(Store.OLLAMA, name, str(blob), "gguf", 0,
                          problem=f"{name}: its weights (blobs/sha256-{m.group(1)[:12]}…) are missing from {root}")
    return _gguf(Store.OLLAMA, blob, root, name)


# -- the user's folders -------------------------------------------------------------------------------------------
def _user_folder(root: Path, notes: list[str]) -> list[FoundModel]:
    """A folder the user added: itself or any folder below with a config.json, and every GGUF file below it."""
    if not root.is_dir():
        return []
    out: list[FoundModel] = []
    for here, dirs, files in _walk(root, notes):
        if "config.json" in files:
            m = _folder(Store.FOLDER, here, root, str(here.relative_to(root)) if here != root else root.name)
            if m is not None:
                out.append(m)
                dirs[:] = []  # a model folder's subfolders are its own (onnx/, original/), not other models
    out += [_gguf(Store.FOLDER, p, root) for p in _ggufs(root, notes)]
    return out
