"""A full disk under the KV disk tier is said under the reply whose pages found it full, in the real window (#29
item 2; it came, if at all, under the next reply: notes were taken only when a reply began, and the writer
thread met the full disk after that). Real stories260K on a real 16 KiB tmpfs (a page file is 20,800 bytes);
skipped where nothing can be mounted."""

from __future__ import annotations

import pytest
from app_helpers import close_window, open_window, wait_reply

from tests.engine.kv_tamper import mount_tmpfs, unmount

LONG = ("Once upon a time there was a little girl named Lily who loved to play in the park with her big red ball. "
        "One day she saw a dog and a cat and a bird sitting under a tree, and she asked them to play with her.")


def test_a_full_disk_is_a_note_under_the_reply(qtbot, data_dir, stories_path):
    kv = data_dir / "kv"  # the tier's default folder
    why = mount_tmpfs(kv, "16k")
    if why:
        pytest.skip(f"no tmpfs here: {why}")
    try:
        w = open_window(qtbot, data_dir, str(stories_path))
        try:
            w.send(LONG)
            assert wait_reply(qtbot, w)[1] != "error"
            want = f"KV disk tier: cannot write to {kv.resolve()} (No space left on device): pages are no longer saved"
            shown = w.chat.bubbles[-1].notes_label.text().replace("\u200b", "")  # long paths wrap at break points
            assert want in shown  # under the reply whose pages found it full
            assert not w.disk.state.tier.writable
            w.send("And then?")  # said once: the next reply goes on without it
            assert wait_reply(qtbot, w)[1] != "error"
            assert want not in w.chat.bubbles[-1].notes_label.text().replace("\u200b", "")
        finally:
            close_window(w)
    finally:
        unmount(kv)
