"""The KV disk tier's notes reach the user on every surface (#29 item 2): a full disk, a read-only folder and a
read-only shelf are said in ``generate``'s warnings (``--json``) and notes (stderr), in the API's reply
(``warnings``, whole and streamed) and on the server's console. The writer thread finds a full disk after the
reply that queued its pages has moved on; these were lost before. Real small and read-only file systems (tmpfs;
where mounting is not allowed, a file-size limit on the child process stands in for a full disk); no mocks."""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import CacheConfig
from engine.kv.tier import disk
from tests.engine.kv_tamper import mount_tmpfs, unmount

ROOT_DIR = Path(__file__).resolve().parents[2]
P = 16
PROMPT = "Once upon a time, there was a little girl named Lily. She liked to play outside in the sun. " * 3
FULL = "16k"  # a page file of stories260K is 20,800 bytes: the first write finds the disk full


@pytest.fixture
def mounts():
    """Mount tmpfs folders for a test (``mount(path, size, read_only)``: "" or why not); unmounted after it."""
    done: list[Path] = []

    def mount(path: Path, size: str = FULL, read_only: bool = False) -> str:
        why = mount_tmpfs(path, size, read_only)
        if not why:
            done.append(path)
        return why

    yield mount
    for path in reversed(done):
        unmount(path)


def generate(folder: Path, *flags: str, limit: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "engine", "generate", "--model", str(ROOT_DIR / "resources/models/stories260K"),
           "--prompt", PROMPT, "--kv-disk", str(folder), "--max-new-tokens", "8", "--ignore-eos", "--page-size",
           str(P), *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR), "KVSCOPE_FAST_STEP": "off"}

    def small_files() -> None:  # a full disk where no file system can be mounted: writes past this fail
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(cmd, cwd=ROOT_DIR, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files if limit else None)


def test_a_full_disk_is_in_generates_warnings_and_notes(mounts, tmp_path):
    folder = tmp_path / "full"
    why = mounts(folder)
    limit = 4096 if why else None  # RLIMIT_FSIZE: "File too large" instead of "No space left on device"
    out = generate(folder, "--json", limit=limit)
    assert out.returncode == 0, out.stderr
    turn = json.loads(out.stdout)
    said = "File too large" if limit else "No space left on device"
    assert f"KV disk tier: cannot write to {folder} ({said}): pages are no longer saved" in turn["warnings"]
    assert len(turn["token_ids"]) == 8
    text = generate(folder, limit=limit)  # streamed text: the note on stderr, after the reply
    assert f"note: KV disk tier: cannot write to {folder} ({said}): pages are no longer saved" in text.stderr
    assert not list(folder.glob("*/*.kvp*"))  # nothing torn left behind


def test_read_only_folders_and_shelves_are_in_generates_warnings(mounts, tmp_path):
    ro = tmp_path / "ro"
    why = mounts(ro, "1m", read_only=True)
    if why and os.geteuid() == 0:
        pytest.skip(f"no read-only folder for root without a mount: {why}")
    if why:
        ro.chmod(0o555)
    turn = json.loads(generate(ro, "--json").stdout)
    assert any(w.startswith(f"KV disk tier: cannot write to {ro} (") and w.endswith("pages are not saved")
               for w in turn["warnings"]), turn["warnings"]
    # the folder takes writes but the model's shelf does not (read-only there): found by the writer, said too
    folder = tmp_path / "kv"
    folder.mkdir()
    probe = generate(folder, "--json")
    shelf = next(p for p in folder.iterdir() if p.is_dir())
    for f in shelf.iterdir():
        f.unlink()
    if mounts(shelf, "1m", read_only=True):
        pytest.skip("no read-only mount for the shelf")
    turn = json.loads(generate(folder, "--json").stdout)
    assert f"KV disk tier: cannot write to {folder} (Read-only file system): pages are no longer saved" in \
        turn["warnings"]
    assert turn["token_ids"] == json.loads(probe.stdout)["token_ids"]


def test_the_api_reply_carries_the_disk_notes_and_the_console_logs_them(mounts, tmp_path, stories_path, caplog):
    import httpx

    from engine.model.loader import load_model
    from engine.server import KVServer, ServerOptions, ServerThread

    full, ro = tmp_path / "full", tmp_path / "ro"
    if mounts(full) or mounts(ro, "1m", read_only=True):
        pytest.skip("no tmpfs here: the API's surface needs an in-process server on a full disk")
    replies = []
    for folder, stream in ((full, False), (ro, True)):
        lm = load_model(str(stories_path))
        disk.configure(lm, str(folder))
        server = KVServer(lm, CacheConfig(page_size=P), ServerOptions())
        thread = ServerThread(server)
        url = thread.start()
        body = {"model": server.model_id, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                "temperature": 0, "stream": stream}
        try:
            with caplog.at_level(logging.WARNING, logger="kvscope.server"):
                for _ in range(2):
                    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
                    assert r.status_code == 200
                    replies.append((folder, stream, r.json() if not stream else last_chunk(r.text)))
                    lm.kv_arenas.disk.flush()
        finally:
            thread.stop()
            disk.configure(lm, None)
    on_full = [r.get("warnings") for f, _, r in replies if f == full]  # said by the reply that found it, once
    assert on_full == [[f"KV disk tier: cannot write to {full} (No space left on device): pages are no longer "
                        "saved"], None]
    on_full = on_full[0]
    first_ro = replies[2][2]  # the read-only folder is known at start: the first reply says so
    assert first_ro["warnings"] == [f"KV disk tier: cannot write to {ro} (read-only): pages are not saved"]
    assert first_ro["choices"][0]["finish_reason"] == "length" and "warnings" not in replies[3][2]
    assert on_full[0] in caplog.text and first_ro["warnings"][0] in caplog.text


def last_chunk(sse: str) -> dict:
    """The chunk with the finish reason of a streamed reply."""
    chunks = [json.loads(line[5:]) for line in sse.splitlines() if line.startswith("data:") and "[DONE]" not in line]
    return next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
