"""One KV disk folder shared by several processes (#29 item 2): together they keep one budget (two writers
overshot it ×2.1–2.4 at their peak, each counting only its own files), a temporary file left by a writer killed
with SIGKILL is cleared when the next tier starts, a live writer's in-flight file is never touched (it holds the
folder's lock; a lock held too long stops the writes with a note instead of hanging), and where no lock can be
had the temporary files of live writers count in the budget. Real processes, real SIGKILL; no mocks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from engine.kv.tier import disk, folder as disk_folder
from tests.engine.kv_tamper import P, chain_paths, chat, folder_bytes, prompt_ids, shared

IDS = prompt_ids()
PAGE = 20_800  # bytes of one stories260K page file (16 tokens, float32)


@pytest.fixture
def fresh(stories_path):
    from engine.model.loader import load_model

    loaded = []

    def load(folder, budget=disk.DEFAULT_BUDGET):
        lm = load_model(str(stories_path))
        disk.configure(lm, str(folder), budget)
        loaded.append(lm)
        return lm

    yield load
    for lm in loaded:
        disk.configure(lm, None)


@pytest.fixture
def written(fresh, tmp_path):
    """A folder holding IDS's 13 page files, and the reply they came with."""
    folder = tmp_path / "kv"
    lm = fresh(folder)
    tokens, _, _ = chat(lm, IDS)
    disk.configure(lm, None)
    return folder, tokens


def hold(script: str, *args: str) -> subprocess.Popen:
    """A child that runs ``script`` and prints "ready" once it holds what it holds."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


TMP_WRITER = """
    import os, sys, time
    with open(f"{sys.argv[1]}.tmp{os.getpid()}", "wb") as f:  # as the tier names its temporary files
        f.write(b"x" * int(sys.argv[2]))
    print("ready", flush=True)
    time.sleep(600)
"""


def test_two_processes_sharing_a_folder_keep_one_budget(tmp_path):
    budget = 10 * PAGE  # each writer writes 39 pages (3 chats of 13)
    r = shared(tmp_path / "kv", budget, ((1, 2, 3), (4, 5, 6)))
    assert r["written"] == [39, 39]
    assert r["peak"] <= budget + PAGE  # sampled while both wrote: the files, and one page in flight at most
    assert r["final"] <= budget
    assert not list((tmp_path / "kv").glob("*/*.tmp*"))


def test_a_killed_writers_temporary_file_is_cleared_at_start(fresh, written):
    folder, tokens = written
    pages = folder_bytes(folder)
    child = hold(TMP_WRITER, str(chain_paths(folder, IDS)[3]), str(5 * PAGE))
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert len(list(folder.glob("*/*.tmp*"))) == 1
    lm = fresh(folder, budget=pages)  # room for the pages, not for the leftover as well
    lm.kv_arenas.disk.flush()
    assert not list(folder.glob("*/*.tmp*")) and folder_bytes(folder) == pages
    got, st, _ = chat(lm, IDS)
    assert got == tokens and st.disk_restored_tokens == 12 * P  # no page evicted for the leftover


def test_a_live_writers_file_is_never_touched_and_a_stuck_lock_stops_writes(fresh, written, monkeypatch):
    folder, tokens = written
    page = chain_paths(folder, IDS)[3]
    raw = page.read_bytes()
    page.unlink()
    writer = hold("""
        import fcntl, os, sys
        lock = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT)
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = f"{sys.argv[2]}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(bytes.fromhex(sys.argv[3]))
        print("ready", flush=True)
        sys.stdin.readline()
        os.replace(tmp, sys.argv[2])  # fails if anyone removed the file in flight
    """, str(folder), str(page), raw.hex())
    monkeypatch.setattr(disk_folder, "LOCK_WAIT_S", 0.5)  # the lock's 10 s, shortened for the test
    try:
        lm = fresh(folder)
        lm.kv_arenas.disk.flush()  # its first job waits for the lock, then gives up
        notes = lm.kv_arenas.disk.take_notes()
        assert f"KV disk tier: cannot write to {folder} ({folder}/.lock held by another process for over 0.5 s): " \
               "pages are no longer saved" in notes
        assert len(list(folder.glob("*/*.tmp*"))) == 1  # the writer's file in flight, untouched
        got, st, _ = chat(lm, IDS)  # reading goes on without the lock
        assert got == tokens and st.disk_restored_tokens == 3 * P
    finally:
        writer.stdin.write("go\n")
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    assert page.read_bytes() == raw
    assert chat(fresh(folder), IDS)[1].disk_restored_tokens == 12 * P


def test_without_a_lock_live_writers_files_count_in_the_budget(fresh, written, tmp_path):
    folder, tokens = written
    (folder / ".lock").unlink()
    (folder / ".lock").mkdir()  # no lock file can be opened: the tier counts the folder before every write
    shelf_page = chain_paths(folder, IDS)[3]
    dead = hold(TMP_WRITER, str(chain_paths(folder, IDS)[4]), str(PAGE))
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    live = hold(TMP_WRITER, str(shelf_page), str(3 * PAGE))
    try:
        pages = folder_bytes(folder) - 4 * PAGE  # the 13 page files
        lm = fresh(folder, budget=pages)
        notes = chat(lm, prompt_ids(7))[2]  # 13 new pages: as many old ones go, 3 more for the live writer's file
        lm.kv_arenas.disk.flush()
        notes += lm.kv_arenas.disk.take_notes()
        assert any(n.startswith(f"KV disk tier: no lock on {folder} (") for n in notes), notes
        left = list(folder.glob("*/*.tmp*"))
        assert [p.name.rsplit(".tmp", 1)[1] for p in left] == [str(live.pid)]  # the dead one's cleared
        assert folder_bytes(folder) <= pages  # the live writer's 3 pages in flight counted
        assert lm.kv_arenas.disk.stats()["evicted_files"] == 13 + 3
    finally:
        live.kill()
        live.wait()
    shutil.rmtree(folder / ".lock")
