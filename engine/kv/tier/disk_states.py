"""The KV disk tier's state files (``engine.kv.tier.state_file``): a hybrid model's recurrent / convolution states at
the page boundaries the prefix cache names, written beside its pages so a restarted app goes on from a shared
prefix of LFM2, Falcon-H1 or Qwen3-Next as it does on a Llama. A mixin of ``DiskTier``: the same folder, budget,
lock, key, writer thread and notes; a state file is one more file of the LRU.

Sizes: LFM2-350M's states are 0.1 MiB a boundary (10 conv layers), Falcon-H1-0.5B's ~1.5 MiB, a Qwen3-Next-80B's
~36 MiB; they are written where the prefix cache keeps them in memory (every 256 tokens of a prefill and the last
whole page before a prompt's last token), so a 2,000-token chat of LFM2-350M adds ~1 MiB of state files to its
~48 MiB of pages.
"""

from __future__ import annotations

import os
from functools import partial

from engine.kv.tier.page_file import PageFileError, read_page
from engine.kv.tier.state_file import SUFFIX, encode_states, parse_states, states_shelf

MAX_STATE_FILE = 1 << 30  # bytes: larger than any model's states at one boundary (an 80B hybrid's: ~36 MiB)


class StateFiles:
    """Mixin of ``DiskTier``. Engine-thread methods: ``has_states``, ``save_states``, ``get_states``."""

    def _states_path(self, page_size: int, states, name: bytes) -> str:
        key = ("states", page_size, tuple(states.layer_ids))
        if key not in self._shelves:
            self._shelves[key] = os.path.join(self.folder, states_shelf(self.model_fp, page_size, states.layer_ids))
        return os.path.join(self._shelves[key], name.hex() + SUFFIX)

    def has_states(self, page_size: int, states, name: bytes) -> bool:
        """Is there a state file for the boundary ``name`` (a lookup in what the tier knows: no file opened)?"""
        path = self._states_path(page_size, states, name)
        with self._lock:
            return path in self._files and path not in self._blocked

    def save_states(self, page_size: int, states, name: bytes, saved: dict, nbytes: int) -> bool:
        """Queue the snapshot ``saved`` (``StateLayers.snapshot``, ``nbytes``) of ``states`` at the boundary ``name``
        for writing, copied to the host now. False when it is not written (on disk already, no room in the queue,
        the folder not writable)."""
        path = self._states_path(page_size, states, name)
        if not self.writable or self._closed or path in self._files or path in self._blocked:
            return False
        with self._lock:
            if self._pending + nbytes > self.max_pending:
                self.counts["skipped_pages"] += 1
                return False
            self._pending += nbytes
        host = {i: {**e, **{f: {k: None if t is None else t.to("cpu", copy=True) for k, t in e[f].items()}
                            for f in ("conv_states", "recurrent_states")}} for i, e in saved.items()}
        self._queue.put((partial(self._write_states, path, name, host), nbytes))
        return True

    def _write_states(self, path: str, name: bytes, saved: dict) -> None:
        if self.writable:
            self._write(path, encode_states(name, os.path.basename(os.path.dirname(path)), saved, self._key))

    def get_states(self, page_size: int, states, name: bytes, device) -> dict | None:
        """The snapshot kept on disk for the boundary ``name`` of ``states``' layers, its tensors on the host (the
        layers' place ``device``), or None: no file, or a damaged one (dropped, with a note)."""
        path = self._states_path(page_size, states, name)
        if path in self._blocked or self._key is None:
            return None
        try:
            buf = read_page(path, MAX_STATE_FILE, at_most=True)
            if buf is None:
                return None
            saved = parse_states(buf, name, os.path.basename(os.path.dirname(path)), states.layers, self._key,
                                 device)
        except PageFileError as e:
            return self._drop(path, str(e))
        with self._lock:
            self._bytes += len(buf) - self._files.pop(path, 0)
            self._files[path] = len(buf)  # most recently used last
            self.counts["state_files_read"] += 1
        return saved
