"""The KV disk tier against a folder someone else wrote into (#29 item 2): whatever sits at a page path — a FIFO,
a link to a 2 GiB file, a 100,000-deep header, a directory, NaN with a valid checksum — is dropped (or skipped)
with a note, never read whole, and its tokens are computed again, identical to a clean run; a directory where a
page goes skips that page and writing goes on; links at page and temporary paths are never written through; the
header parser raises only its own error. Real files, FIFOs, sockets, links and subprocesses (the FIFO and 2 GiB
cases run in a process of their own: a guard timeout, and their own peak RSS); no mocks."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from engine.kv.tier import disk
from engine.kv.tier.page_file import MAGIC, PageFileError, parse
from tests.engine.kv_tamper import CASES, P, chain_paths, chat, prompt_ids, replaced, spawn

IDS = prompt_ids()
IN_A_PROCESS = {"FIFO at a page path", "symlink to a 2 GiB file", "2 GiB file at a page path"}


@pytest.fixture
def fresh(stories_path):
    """Fresh loads of stories260K (no page of an earlier load in memory); their tiers closed afterwards."""
    from engine.model.loader import load_model

    loaded = []

    def load(folder=None, budget=disk.DEFAULT_BUDGET):
        lm = load_model(str(stories_path))
        if folder is not None:
            disk.configure(lm, str(folder), budget)
        loaded.append(lm)
        return lm

    yield load
    for lm in loaded:
        disk.configure(lm, None)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, stories_path):
    """A folder written by a clean run, its reply, and (when a case runs in a process) a clean reader's run."""
    from engine.model.loader import load_model

    folder = tmp_path_factory.mktemp("clean") / "kv"
    lm = load_model(str(stories_path))
    disk.configure(lm, str(folder))
    tokens, _, _ = chat(lm, IDS)
    disk.configure(lm, None)
    raw = chain_paths(folder, IDS)[5].read_bytes()
    return {"folder": folder, "tokens": tokens, "raw": raw, "reader": {}}


def copy_of(clean, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(clean["folder"], tmp_path / "kv")
    return tmp_path / "kv"


@pytest.mark.parametrize("case", list(CASES))
def test_whatever_is_at_a_page_path_is_dropped_unread_and_recomputed(fresh, clean, tmp_path, case):
    tamper, words, page_again = CASES[case]
    folder = copy_of(clean, tmp_path)
    page = chain_paths(folder, IDS)[5]
    (tmp_path / "scratch").mkdir()
    tamper(page, clean["raw"], tmp_path / "scratch")
    if case in IN_A_PROCESS:  # may block or read 2 GiB if broken: its own process, a guard timeout
        got = spawn(folder, timeout=120)
        tokens, restored, notes = got["chats"][0]["tokens"], got["chats"][0]["restored"], got["chats"][0]["notes"]
        if not clean["reader"]:
            clean["reader"] = spawn(copy_of(clean, tmp_path / "c"))
        # a 2 GiB read is 2,048 MiB more; the process is ~360 MiB of torch and model either way
        assert got["rss_mib"] < 1.2 * clean["reader"]["rss_mib"]
        assert got["stats"]["dropped_files"] == 1
    else:
        lm = fresh(folder)
        tokens, st, notes = chat(lm, IDS)
        restored = st.disk_restored_tokens
        lm.kv_arenas.disk.flush()
        assert lm.kv_arenas.disk.stats()["dropped_files"] == 1
    assert tokens == clean["tokens"] and restored == 5 * P  # pages 0-4 from disk, the rest computed again
    said = [n for n in notes if n.startswith("KV disk tier: ")]
    assert len(said) == 1 and words in said[0] and "its tokens are computed again" in said[0], notes
    assert replaced(page) == page_again  # removed, and the recomputed page written in its place
    if case == "symlink to a 2 GiB file":
        assert (tmp_path / "scratch" / "big.bin").stat().st_size == 2 << 30  # the link went, not its target
    if page_again:
        assert chat(fresh(folder), IDS)[1].disk_restored_tokens == 12 * P


def test_pages_signed_elsewhere_or_renamed_in_their_header_are_not_trusted(fresh, clean, tmp_path):
    """Another page's valid file with its header's name rewritten to this page's (with SHA-256 alone, anyone
    could recompute the checksum and have a prompt read another's K/V), and a page copied from another folder
    (its own key): each is a checksum mismatch, dropped and computed again."""
    mine = copy_of(clean, tmp_path)
    other = tmp_path / "other"
    lm = fresh(other)
    chat(lm, IDS)
    disk.configure(lm, None)
    assert (other / ".key").read_bytes() != (mine / ".key").read_bytes() and (mine / ".key").stat().st_mode & 0o077 == 0
    pages = chain_paths(mine, IDS)
    raw6 = pages[6].read_bytes()
    pages[5].write_bytes(raw6.replace(pages[6].stem.encode(), pages[5].stem.encode()))  # same length: hex names
    pages[8].write_bytes(chain_paths(other, IDS)[8].read_bytes())  # the same page, signed by another folder
    for n_restored, fix in ((5, lambda: pages[5].write_bytes(clean["raw"])), (8, None)):
        tokens, st, notes = chat(fresh(mine), IDS)
        assert tokens == clean["tokens"] and st.disk_restored_tokens == n_restored * P
        assert [n for n in notes if "dropped" in n] == [
            "KV disk tier: dropped a page file (checksum mismatch: altered, or written under another folder's key); "
            "its tokens are computed again"]
        if fix is not None:
            fix()


def test_the_header_parser_raises_only_its_own_error(stories):
    arena = stories.kv_arenas.get(P, None, "auto", "auto")
    name, shelf = b"\x01" * 32, "s" * 32

    def page(header: bytes, payload: bytes = b"\0" * 64) -> bytearray:
        return bytearray(MAGIC + struct.pack("<I", len(header)) + header + payload)

    deep = b"[" * 100_000 + b"]" * 100_000
    cases = {"damaged header (its length)": [page(deep), bytearray(MAGIC + b"\xff\xff\xff\xff{}")],
             "damaged header (nested too deep)": [page(b"[" * 2000 + b"]" * 2000),
                                                  page(b'{"k": [[[[1]]]]}')],
             "damaged header": [page(b"\xff\xfe{"), page(b"{nope"), page(b'{"a": 1')],
             "truncated or extended": [page(b"[1, 2]"), page(b'"text"'), page(json.dumps({"bytes": 3}).encode()),
                                       page(b'{"bytes": ' + b"9" * 4000 + b"}")],  # 4,000 digits: parsed, no match
             "not a page file": [bytearray(b"KVSCOPE"), bytearray()]}
    for why, bufs in cases.items():
        for buf in bufs:
            with pytest.raises(PageFileError) as e:
                parse(buf, name, shelf, arena, b"k" * 32)
            assert str(e.value) == why


def test_a_directory_where_a_page_goes_is_removed_or_skipped_and_writing_goes_on(fresh, tmp_path):
    folder = tmp_path / "kv"
    lm = fresh(folder)
    paths = chain_paths_for(lm, folder)
    paths[3].parent.mkdir(parents=True)
    paths[3].mkdir()  # empty: removed, the page written
    paths[5].mkdir()
    (paths[5] / "keep").write_text("someone's")  # not empty: that page skipped
    want, _, notes = chat(lm, IDS)
    lm.kv_arenas.disk.flush()
    notes += lm.kv_arenas.disk.take_notes()
    tier = lm.kv_arenas.disk
    assert tier.writable and tier.stats()["pages_written"] == 12  # 13 full pages, one skipped
    assert replaced(paths[3]) and (paths[5] / "keep").read_text() == "someone's"
    assert any(f"{paths[5]} is a directory that cannot be removed, not a page file: that page is not saved "
               "(the others are)" in n for n in notes), notes
    got, st, _ = chat(fresh(folder), IDS)
    assert got == want and st.disk_restored_tokens == 5 * P  # up to the skipped page


def test_links_at_page_and_temporary_paths_are_never_written_through(fresh, tmp_path):
    folder = tmp_path / "kv"
    lm = fresh(folder)
    paths = chain_paths_for(lm, folder)
    paths[2].parent.mkdir(parents=True)
    victims = [tmp_path / "victim-page", tmp_path / "victim-tmp"]
    for v in victims:
        v.write_text("keep me")
    paths[2].symlink_to(victims[0])  # the rename replaces the link itself
    Path(f"{paths[4]}.tmp{os.getpid()}").symlink_to(victims[1])  # the writer's temporary name, guessed
    want, _, _ = chat(lm, IDS)
    lm.kv_arenas.disk.flush()
    assert [v.read_text() for v in victims] == ["keep me", "keep me"]
    assert replaced(paths[2]) and replaced(paths[4]) and not list(folder.glob("*/*.tmp*"))
    got, st, _ = chat(fresh(folder), IDS)
    assert got == want and st.disk_restored_tokens == 12 * P


def chain_paths_for(lm, folder: Path) -> list[Path]:
    """Where ``IDS``'s 13 pages go on ``lm``'s shelf (before any is written)."""
    from engine.kv.paged.prefix import ROOT, extend_chain

    shelf = Path(lm.kv_arenas.disk.shelf(lm.kv_arenas.get(P, None, "auto", "auto")))
    assert shelf.parent == folder
    return [shelf / (h.hex() + disk.SUFFIX) for h in extend_chain([], IDS, P, 13, ROOT)]


@pytest.mark.parametrize("bad", ["fifo", "short"])
def test_a_key_that_is_not_a_key_file_turns_the_tier_off_with_a_note(fresh, clean, tmp_path, bad):
    folder = copy_of(clean, tmp_path)
    key = folder / ".key"
    key.unlink()
    if bad == "fifo":
        os.mkfifo(key)
        got = spawn(folder, timeout=120)  # a blocking open would hang: its own process, a guard timeout
        tokens, restored, notes = got["chats"][0]["tokens"], got["chats"][0]["restored"], got["chats"][0]["notes"]
        why = f"{key} is a pipe (FIFO), not a key file"
    else:
        key.write_bytes(b"1234")
        tokens, st, notes = chat(fresh(folder), IDS)
        restored, why = st.disk_restored_tokens, f"{key} has 4 bytes, not a key's 32"
    assert tokens == clean["tokens"] and restored == 0  # nothing read that no key vouches for
    assert f"KV disk tier: no key for the page files ({why}): pages are neither read nor saved" in notes, notes
    assert len(chain_paths(folder, IDS)) == 12 and all(p.is_file() for p in chain_paths(folder, IDS))
