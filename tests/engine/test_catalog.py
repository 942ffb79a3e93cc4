"""Models already on the computer (#32): an HF cache, an LM Studio folder, an Ollama store and a user's folder laid
out in a temp dir (HOME, HF_HUB_CACHE and OLLAMA_MODELS pointed there) are found with the right names, sizes,
architectures and context lengths, from headers only; nothing is written; links out of a folder are not read."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gguf_make import write_gguf  # tests/engine is on sys.path

from engine.model.catalog import Store, scan

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _blob(root: Path, data: bytes) -> Path:
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return blob


def _hf_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """The hub cache's layout: blobs by hash, refs/main, snapshots/<commit>/<file> linking into blobs."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name, data in files.items():
        os.symlink(os.path.relpath(_blob(root, data), snap), snap / name)


def _ollama_tag(store: Path, path: str, model_bytes: bytes | None, digest: str | None = None) -> None:
    digest = digest or hashlib.sha256(model_bytes).hexdigest()
    if model_bytes is not None:
        (store / "blobs").mkdir(parents=True, exist_ok=True)
        (store / "blobs" / f"sha256-{digest}").write_bytes(model_bytes)
    manifest = store / "manifests" / path
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1}]}))


def _tree(root: Path) -> dict[str, tuple[int, float]]:
    out = {}
    for top, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(top, n))
            out[os.path.join(top, n)] = (st.st_size, st.st_mtime)
    return out


@pytest.fixture(scope="module")
def laid_out(tmp_path_factory, stories_path):
    from transformers import AutoModelForCausalLM

    t = tmp_path_factory.mktemp("stores")
    model = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32)
    q8 = write_gguf(model, "llama", stories_path / "tokenizer.model", t / "q8.gguf", "Q8_0").read_bytes()
    f32 = write_gguf(model, "llama", stories_path / "tokenizer.model", t / "f32.gguf", "F32").read_bytes()
    (t / "q8.gguf").unlink()
    (t / "f32.gguf").unlink()
    home, hf, ollama, mine = t / "home", t / "hf-cache", t / "ollama", t / "mine"
    folder_files = {n: (stories_path / n).read_bytes() for n in ("config.json", "model.safetensors", "tokenizer.json")}
    _hf_repo(hf, "karpathy/stories260K", folder_files)
    _hf_repo(hf, "ggml-org/stories-GGUF", {"stories260K-Q8_0.gguf": q8, "README.md": b"# hi"})
    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "stories-GGUF"
    lms.mkdir(parents=True)
    (lms / "stories260K-Q8_0.gguf").write_bytes(q8)
    (lms / "mmproj-stories-f16.gguf").write_bytes(q8)  # a vision projector: not a model
    (lms / "big-00001-of-00002.gguf").write_bytes(q8)  # its second part never arrived
    old = home / ".cache" / "lm-studio" / "models" / "TheBloke" / "stories-GGUF"
    old.mkdir(parents=True)
    (old / "stories260K.F32.gguf").write_bytes(f32)
    _ollama_tag(ollama, "registry.ollama.ai/library/stories/q8_0", q8)
    _ollama_tag(ollama, "registry.ollama.ai/library/stories/latest", q8)  # the same blob under two tags
    _ollama_tag(ollama, "registry.ollama.ai/someone/stories/f32", f32)
    _ollama_tag(ollama, "registry.ollama.ai/library/gone/1b", None, "f" * 64)  # pruned blob
    shutil.copytree(stories_path, mine / "stories-folder")
    (mine / "ggufs").mkdir()
    (mine / "ggufs" / "mine-f32.gguf").write_bytes(f32)
    (mine / "ggufs" / "truncated.gguf").write_bytes(q8[: len(q8) // 2])
    os.symlink("/etc/passwd", mine / "ggufs" / "passwd.gguf")
    os.symlink("/", mine / "root-link")  # a link to a directory is never walked
    os.mkfifo(mine / "ggufs" / "pipe.gguf")
    env = {"HOME": str(home), "HF_HUB_CACHE": str(hf), "OLLAMA_MODELS": str(ollama)}
    before = _tree(t)
    found = scan([mine], env=env).models
    assert _tree(t) == before  # nothing written, not even an access-time-free lock or cache file
    return found, {"q8": len(q8), "f32": len(f32), "folder": sum(map(len, folder_files.values()))}, t


def _by_name(found):
    return {(m.store, m.name): m for m in found}


def test_found_with_names_and_sizes(laid_out):
    found, size, _ = laid_out
    got = {(m.store, m.name): (m.kind, m.size_bytes) for m in found if not m.problem}
    assert got == {
        (Store.HF_CACHE, "karpathy/stories260K"): ("folder", size["folder"]),
        (Store.HF_CACHE, "ggml-org/stories-GGUF/stories260K-Q8_0.gguf"): ("gguf", size["q8"]),
        (Store.LM_STUDIO, "lmstudio-community/stories-GGUF/stories260K-Q8_0.gguf"): ("gguf", size["q8"]),
        (Store.LM_STUDIO, "TheBloke/stories-GGUF/stories260K.F32.gguf"): ("gguf", size["f32"]),
        (Store.OLLAMA, "stories:latest"): ("gguf", size["q8"]),
        (Store.OLLAMA, "stories:q8_0"): ("gguf", size["q8"]),
        (Store.OLLAMA, "someone/stories:f32"): ("gguf", size["f32"]),
        (Store.FOLDER, "stories-folder"): ("folder", sum(p.stat().st_size for p in
                                                         (laid_out[2] / "mine" / "stories-folder").iterdir())),
        (Store.FOLDER, "ggufs/mine-f32.gguf"): ("gguf", size["f32"]),
    }


def test_facts_from_headers(laid_out):
    found = _by_name(laid_out[0])
    m = found[Store.LM_STUDIO, "lmstudio-community/stories-GGUF/stories260K-Q8_0.gguf"]
    assert (m.architecture, m.context_length, m.weights_type, m.quantized) == ("llama", 512, "Q8_0", True)
    assert m.stored_weights_bytes == 260_032 * 4 and m.config["num_hidden_layers"] == 5
    f = found[Store.HF_CACHE, "karpathy/stories260K"]
    assert (f.architecture, f.context_length, f.weights_type) == ("LlamaForCausalLM", 512, "float32")
    assert f.stored_weights_bytes == (laid_out[2] / "mine" / "stories-folder" / "model.safetensors").stat().st_size
    # the Ollama source is the blob itself: what --model opens
    o = found[Store.OLLAMA, "stories:latest"]
    assert Path(o.source).name.startswith("sha256-") and Path(o.source).parent.name == "blobs"


def test_what_cannot_open_says_why(laid_out):
    problems = {m.name: m.problem for m in laid_out[0] if m.problem}
    assert problems["gone:1b"].startswith("gone:1b: its weights (blobs/sha256-ffffffffffff…) are missing from ")
    assert "is one part of a model split in 2 files and 1 is missing" in \
        problems["lmstudio-community/stories-GGUF/big-00001-of-00002.gguf"]
    assert problems["ggufs/truncated.gguf"].startswith("truncated.gguf is truncated: ")
    assert problems["ggufs/pipe.gguf"] == "pipe.gguf is a pipe (FIFO), not a GGUF file"
    assert problems["ggufs/passwd.gguf"].startswith("passwd.gguf links outside ")
    assert problems["ggufs/passwd.gguf"].endswith("(/etc/passwd): not read")
    names = {m.name for m in laid_out[0]}
    assert not any("mmproj" in n or "root-link" in n for n in names)
    mine = [m for m in laid_out[0] if m.store == Store.FOLDER]
    assert [m.name for m in mine].count("ggufs/mine-f32.gguf") == 1


def test_scan_opens_the_ollama_blob_as_a_model(laid_out):
    from engine.model.loader import load_model

    m = _by_name(laid_out[0])[Store.OLLAMA, "someone/stories:f32"]
    lm = load_model(m.source)  # a GGUF without the .gguf suffix: known by its magic
    assert lm.info.architecture == "LlamaForCausalLM" and lm.info.has_chat_template
    assert lm.info.name == "kvscope-test-llama"  # the file's general.name, not "sha256-…"
