"""The KV disk tier: full pages of the prefix cache kept in files, so a chat reopened after a restart (or a prompt
seen by an earlier process) takes its pages from disk instead of prefilling them again.

Layout: ``<folder>/<shelf>/<name>.kvp``, ``shelf`` naming the model and cache setting
(``engine.kv.tier.fingerprint.shelf_fingerprint``: weights, config, dtype, page size, K/V precision) and ``name`` the
page's prefix-cache name (``engine.kv.paged.prefix``: a hash chain over every token from the start, tenant salt
included). A file is a magic line, a little-endian uint32 header length, a JSON header (name, shelf, K and V
shapes and dtype, payload bytes, an HMAC of name, shelf and payload under the folder's key ``<folder>/.key``),
then K ``[layers, heads, P, dim]`` and V as stored (``engine.kv.tier.page_file``).

Integrity: a file is written to a temporary name and renamed (a torn write never has the page's name); what is
at a page path is opened without following links or blocking, and read only if it is a regular file of the
page's exact size (``engine.kv.tier.page_file.read_page``); a file whose magic, header, size, checksum, name, shelf,
shapes, dtype or finite values do not match is dropped and its tokens are computed again, with a note. A
directory or other non-file where a page goes is removed if it can be (else that page is skipped, with a note)
and the other pages are written. A folder that cannot be written (read-only, full) stops the writes with a
note; reading goes on. Notes reach the reply that is running (``take_notes``: at its start and its end).

Threads: the engine thread copies new full pages to host memory (a gather per layer, one device-to-host copy) and
queues them (``save``); a writer thread hashes and writes them, each after evicting the least recently used
files that would leave the folder past the byte budget (a read touches its file's mtime, so LRU order survives
a restart), under the folder's lock so processes sharing the folder share the budget
(``engine.kv.tier.folder``). Reads happen on the engine thread, at a prompt's start (``restore``): they replace
the prefill of those tokens, and never wait for the lock.

The tier covers what the prefix cache covers: paged stores at the model's own K/V precision, no eviction policy
(``SeqCache.prefix_store`` / ``prefix_groups``) — on hybrid and sliding-window models each sliding group's pages on
a shelf of their own and the recurrent states at named page boundaries as state files
(``engine.kv.tier.disk_states``). Turn it on per loaded model with ``configure``.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections import OrderedDict
from functools import partial

import torch

from engine.kv.tier.folder import PAGE_ERRNOS, FolderLock, clear_path, disk_full, folder_key, put, scan
from engine.kv.tier.disk_states import StateFiles
from engine.kv.tier.install import install
from engine.kv.tier.report import METRICS, NOTE, gauges  # noqa: F401 - the tier's readouts, imported from here
from engine.kv.tier.fingerprint import model_fingerprint, shelf_fingerprint
from engine.kv.tier.page_file import SUFFIX, PageFileError, encode, page_size, parse, read_page, remove

DEFAULT_BUDGET = 4 << 30  # bytes on disk: ~45 chats of 2,000 tokens of a 135M model in float32 (92 MB each)
MAX_PENDING = 256 << 20  # bytes queued for the writer; pages past it are skipped (counted), never waited for
# prefill rate for the note's "re-reading them would take ~N s": ~240 GFLOP/s on a 2-core CPU (engine.core.sequence's
# prefill chunks), ~20 TFLOP/s on a consumer GPU
FLOPS = {"cpu": 2.4e11}
GPU_FLOPS = 2e13


class DiskTier(StateFiles):
    """The page files of one loaded model under ``folder``, at most ``budget`` bytes. Engine-thread methods:
    ``save``, ``restore``, ``take_notes``; the writer thread owns the writes and the evictions."""

    def __init__(self, folder: str, model_fp: str, budget: int = DEFAULT_BUDGET, flops_per_token: float = 0.0,
                 device_type: str = "cpu") -> None:
        self.folder, self.model_fp, self.budget = os.path.abspath(folder), model_fp, budget
        self.flops_per_token, self.rate = flops_per_token, FLOPS.get(device_type, GPU_FLOPS)
        self.counts = dict.fromkeys(("hit_tokens", "miss_tokens", "bytes_read", "bytes_written", "pages_written",
                                     "skipped_pages", "dropped_files", "evicted_files", "missing_files",
                                     "state_files_written", "state_files_read"), 0)
        self._notes: list[str] = []
        self._lock = threading.Lock()  # guards _files, _bytes, _pending, counts, _notes
        self._files: OrderedDict[str, int] = OrderedDict()  # path -> bytes, least recently used first
        self._bytes = self._pending = self._tmp_bytes = 0  # _tmp_bytes: other writers' files in flight
        self.max_pending = MAX_PENDING
        self._shelves: dict[tuple, str] = {}  # arena settings (or ("states", ...)) -> its shelf's folder
        self._sizes: dict[tuple[str, int], int] = {}  # (shelf, name length) -> bytes of a page file
        self._blocked: set[str] = set()  # page paths held by what cannot be removed: not read nor written again
        self._dropped_meanwhile: set[str] | None = None  # paths the engine dropped while the writer listed the folder
        self.writable, self._closed = True, False
        self._lockfile = FolderLock(self.folder)
        self._queue: queue.Queue = queue.Queue()
        self._scan()
        self._queue.put((self._start, 0))
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # -- facts -------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of page files this tier knows of (its size readout)."""
        return self._bytes

    def stats(self) -> dict:
        with self._lock:
            return {**self.counts, "bytes_on_disk": self._bytes, "files": len(self._files), "writable": self.writable}

    def shelf(self, arena) -> str:
        """The folder of ``arena``'s pages."""
        s = arena.shape
        key = (arena.page_size, arena.kinds["k"], arena.kinds["v"], s.num_layers, s.of("k"), s.of("v"), s.dtype)
        if key not in self._shelves:
            self._shelves[key] = os.path.join(self.folder, shelf_fingerprint(self.model_fp, arena))
        return self._shelves[key]

    def note(self, text: str) -> None:
        with self._lock:
            if text not in self._notes:
                self._notes.append(text)

    def take_notes(self, tokens: int = 0, ms: float = 0.0) -> list[str]:
        """Notes for the user (files dropped, writes stopped), with what the last restore did when ``tokens``."""
        with self._lock:
            notes, self._notes = self._notes, []
        if tokens:
            est = tokens * self.flops_per_token / self.rate
            took = f"{est:.1f} s" if est >= 0.1 else f"{est * 1e3:.0f} ms"
            again = f" (re-reading them would take ~{took})" if est >= 1e-3 else ""  # "~0 ms" says nothing
            notes.insert(0, f"restored {tokens:,} tokens from disk in {ms:.0f} ms{again}")
        return notes

    # -- writing (engine thread: copy and queue; writer thread: the files) -------------------------------
    def save(self, arena, pages: list[int], names: list[bytes]) -> int:
        """Queue full, named pages of ``arena`` for writing (not already on disk). Returns the pages queued."""
        if not self.writable or self._closed or arena.quantized or not pages:
            return 0
        folder = self.shelf(arena)
        todo = [(p, n) for p, n in zip(pages, names)
                if self._path(folder, n) not in self._files and self._path(folder, n) not in self._blocked]
        full = disk_full(folder, self.folder, arena.page_bytes) if todo else ""
        if full:  # said with the reply that is running (its end takes the notes), not only after the writer's try
            self._stop(OSError(0, full))
            return 0
        with self._lock:  # as many as the queue has room for, in chain order: a chain is read from its start
            fit = max(0, (self.max_pending - self._pending) // arena.page_bytes)
            self.counts["skipped_pages"] += max(0, len(todo) - fit)
            todo = todo[:fit]
            size = len(todo) * arena.page_bytes
            self._pending += size
        if not todo:
            return 0
        P = arena.page_size
        idx = torch.tensor([p for p, _ in todo], device=arena.shape.device)
        slots = (idx[:, None] * P + torch.arange(P, device=idx.device)).reshape(-1)  # [n * P]
        k, v = (torch.stack([t.index_select(1, slots) for t in arena.roles[r].layers]).to("cpu") for r in "kv")
        names = [n for _, n in todo]
        self._queue.put((partial(self._write_pages, folder, names, k, v, P), size))  # k, v: [L, H, n * P, D] copies
        return len(todo)

    def _path(self, folder: str, name: bytes) -> str:
        return os.path.join(folder, name.hex() + SUFFIX)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, size = item  # a bound method of the writer's and the bytes it holds in the queue
            try:
                job()
            except Exception as e:  # noqa: BLE001 - a writer that dies would leave flush() waiting forever
                self.writable = False
                self.note(f"{NOTE}writing failed ({type(e).__name__}: {e}): pages are no longer saved")
            finally:
                with self._lock:
                    self._pending -= size
                self._queue.task_done()
        self._queue.task_done()

    def _start(self) -> None:
        """Under the lock: the folder counted again, dead writers' temporary files out, the budget kept."""
        if not self.writable:
            return
        why = self._lockfile.open()
        if why:
            self.note(f"{NOTE}no lock on {self.folder} ({why}): the budget is kept by counting the folder "
                      "before each write")
        try:
            with self._lockfile.held():
                self._recount()
                self._room(0)
        except OSError as e:
            self._stop(e)

    def _write_pages(self, folder: str, names: list[bytes], k: torch.Tensor, v: torch.Tensor, P: int) -> None:
        for i, name in enumerate(names):
            if self.writable:
                head, kb, vb = encode(name, os.path.basename(folder), k[:, :, i * P:(i + 1) * P],
                                      v[:, :, i * P:(i + 1) * P], self._key)
                self._write(self._path(folder, name), (head, kb, vb))

    def _write(self, path: str, parts: tuple) -> None:
        """One file, made room for (LRU files out), written to a temporary name and renamed, under the lock.
        What is in the way at its path skips that file, with a note; any other ``OSError`` stops all writes,
        with a note."""
        n = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        folder = os.path.dirname(path)
        try:
            with self._lockfile.held() as others:
                if others:  # another process wrote or evicted since: count the folder again
                    self._recount()
                if path in self._files or not self._room(n):
                    return
                os.makedirs(folder, exist_ok=True)
                why = clear_path(path)
                if why:
                    return self._skip(path, why)
                self._lockfile.dirty = True
                try:
                    put(path, parts)
                except OSError as e:
                    if e.errno not in PAGE_ERRNOS:
                        raise
                    return self._skip(path, e.strerror or str(e))
        except OSError as e:  # the disk full or read-only, the lock stuck: no write would succeed
            return self._stop(e)
        with self._lock:
            self._bytes += n - self._files.pop(path, 0)
            self._files[path] = n
            self.counts["bytes_written"] += n
            self.counts["pages_written" if path.endswith(SUFFIX) else "state_files_written"] += 1

    def _skip(self, path: str, why: str) -> None:
        self._blocked.add(path)
        with self._lock:
            self.counts["skipped_pages"] += 1
        self.note(f"{NOTE}{path} is {why}, not a page file: that page is not saved (the others are)")

    def _stop(self, e: OSError) -> None:
        self.writable = False
        self.note(f"{NOTE}cannot write to {self.folder} ({e.strerror or e}): pages are no longer saved")

    def _room(self, n: int) -> bool:
        """Least recently used files out until ``n`` more bytes fit in the budget (the lock held). False when
        one page is larger than the whole budget."""
        if n > self.budget:
            with self._lock:
                self.counts["skipped_pages"] += 1
            return False
        while True:
            with self._lock:
                if self._bytes + self._tmp_bytes + n <= self.budget or not self._files:
                    return True
                path, size = self._files.popitem(last=False)
                self._bytes -= size
                self.counts["evicted_files"] += 1
            self._lockfile.dirty = True
            remove(path)

    def _recount(self) -> None:
        """The folder as it is now (every process's files), oldest first; stale temporary files removed."""
        with self._lock:
            self._dropped_meanwhile = set()
        found, tmp_bytes, _ = scan(self.folder, self._lockfile.works, clear_tmp=True)
        files = OrderedDict((path, size) for _, path, size in found)
        with self._lock:  # a file the engine thread dropped after the listing saw it is gone (else never rewritten)
            for path in self._dropped_meanwhile:
                files.pop(path, None)
            self._dropped_meanwhile = None
            self._files, self._bytes, self._tmp_bytes = files, sum(files.values()), tmp_bytes

    def flush(self) -> None:
        """Wait until every queued page is written (or skipped)."""
        if not self._closed:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._lockfile.close()
        atexit.unregister(self.close)

    # -- reading (engine thread) -------------------------------------------------------------------------
    def restore(self, arena, chain: list[bytes], start: int, held: list[int]) -> tuple[int, float]:
        """Pages ``chain[start:]`` read from disk, up to the first missing or damaged one (dropped, with a note),
        written into free pages of ``arena`` and put in its prefix cache (cached, nobody holding them) where
        ``cached_run`` finds them. ``held``: the cached pages before them, kept from being taken for these. All or
        nothing: no page changes if room or the copy fails. Returns (tokens restored, milliseconds)."""
        if arena.quantized or start >= len(chain):
            return 0, 0.0
        t0, pool, P = time.perf_counter(), arena.pool, arena.page_size
        for p in held:
            pool.take(p)
        try:
            room = pool.num_free + max(0, arena.cap_pages() - pool.num_pages)
            want = chain[start:start + room]
            read = self._read_run(arena, want)
            with self._lock:
                self.counts["miss_tokens"] += (len(want) - len(read)) * P
            pages, why = install(arena, read, want) if read else ([], "")
            if why:
                self.note(f"{NOTE}{why}")
        finally:
            for p in held:
                pool.decref(p)
        with self._lock:
            self.counts["hit_tokens"] += len(pages) * P
            self.counts["bytes_read"] += len(pages) * arena.page_bytes
        return len(pages) * P, (time.perf_counter() - t0) * 1000.0

    def get(self, arena, name: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V ``[L, H, P, D]`` of the page named ``name`` on ``arena``'s shelf, or None (missing, or damaged:
        then dropped, with a note)."""
        return self._read(self.shelf(arena), name, arena)

    def _read_run(self, arena, names: list[bytes]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        folder, out = self.shelf(arena), []
        for i, name in enumerate(names):
            kv = self._read(folder, name, arena)
            if kv is None:
                later = names[i + 1] if i + 1 < len(names) else None
                if later is not None and self._path(folder, later) in self._files:  # a gap in a chain on disk:
                    with self._lock:  # this page was written once and is missing now
                        self.counts["missing_files"] += 1
                break
            out.append(kv)
        return out

    def _read(self, folder: str, name: bytes, arena) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One page file's K and V ``[L, H, P, D]``, or None (missing; damaged or no file: dropped with a note)."""
        path, shelf = self._path(folder, name), os.path.basename(folder)
        if path in self._blocked or self._key is None:
            return None
        key = (shelf, len(name))
        if key not in self._sizes:
            self._sizes[key] = page_size(name, shelf, arena)
        try:
            buf = read_page(path, self._sizes[key])
            if buf is None:
                return None
            kv = parse(buf, name, shelf, arena, self._key)
        except PageFileError as e:
            return self._drop(path, str(e))
        with self._lock:
            self._bytes += len(buf) - self._files.pop(path, 0)
            self._files[path] = len(buf)  # most recently used last
        return kv

    def _drop(self, path: str, why: str) -> None:
        gone = remove(path)  # a link goes, not what it points to; a directory only if it is empty
        with self._lock:
            self._bytes -= self._files.pop(path, 0)
            self.counts["dropped_files"] += 1
            if self._dropped_meanwhile is not None:
                self._dropped_meanwhile.add(path)
        if gone:
            what = "a page file" if path.endswith(SUFFIX) else "a state file"
            self.note(f"{NOTE}dropped {what} ({why}); its tokens are computed again")
        else:
            self._blocked.add(path)
            self.note(f"{NOTE}skipped {path} ({why}; it cannot be removed); its tokens are computed again")
        return None

    # -- the folder at start -----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Know the files already there, least recently used first (a listing: the lock is the writer's, taken
        by its first job, ``_start``)."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            if not os.access(self.folder, os.W_OK):
                raise PermissionError(13, "read-only")
        except OSError as e:
            self.writable = False
            self.note(f"{NOTE}cannot write to {self.folder} ({e.strerror or e}): pages are not saved")
        self._key, why = folder_key(self.folder) if os.path.isdir(self.folder) else (None, "")
        if why and self.writable:  # (a folder that cannot be written has said so: no key can be made there)
            self.writable = False
            self.note(f"{NOTE}no key for the page files ({why}): pages are neither read nor saved")
        found, self._tmp_bytes, _ = scan(self.folder, locked=False, clear_tmp=False)
        for _, path, size in found:
            self._files[path] = size
            self._bytes += size


def configure(lm, folder: str | None, budget: int = DEFAULT_BUDGET) -> DiskTier | None:
    """Turn ``lm``'s disk tier on at ``folder`` (None: off; the old tier writes what it queued, then stops)."""
    reg = lm.kv_arenas
    old, reg.disk = getattr(reg, "disk", None), None
    if old is not None:
        old.close()
    if folder is None:
        return None
    from engine.quant.modules import parameter_count
    params = parameter_count(lm.model)
    tier = DiskTier(folder, model_fingerprint(lm), budget, 2.0 * params, lm.device.type)
    reg.disk = tier
    atexit.register(tier.close)  # a normal exit writes what is queued; a kill loses at most the file being written
    return tier


def configure_flag(lm, a) -> DiskTier | None:
    """``--kv-disk DIR|off`` and ``--kv-disk-budget GIB`` of parsed arguments ``a``: the tier at DIR, or none."""
    value, gib = getattr(a, "kv_disk", "off"), getattr(a, "kv_disk_budget", None)
    if gib is not None and not gib > 0:
        raise ValueError(f"--kv-disk-budget {gib}: give more than 0 GiB")
    budget = int(gib * (1 << 30)) if gib is not None else DEFAULT_BUDGET
    return configure(lm, None if value in (None, "", "off") else value, budget)
