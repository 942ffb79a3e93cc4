"""Quantized copies: a folder's linears as ``--quantize int8`` / ``nf4`` made them at a first load, kept in the cache
so that the next load of the same files maps them, as a GGUF file of those blocks is mapped.

Why: quantizing at load reads every bf16 weight and writes its blocks. The Llama-3.2-1B shape (2 GB of bf16
linears) took 0.7-1.1 s as Q8_0 and 1.8-3.2 s as NF4 on one thread, where llama.cpp maps a file already quantized
in 0.1-0.6 s. Mapped from the copy, a load reads the headers and the norms, and the blocks are packed from the
copy's pages after the load returns, as a GGUF's are (``BlockLinear.defer_pack``): the same bytes the first load
quantized, bit for bit.

A copy is a safetensors file (``<kind>-<key>.safetensors``: uint8 tensors ``[rows, row_bytes]`` named as the
folder's weights, what each holds in ``__metadata__``) under ``$KVSCOPE_QUANTIZED_CACHE``, else
``$XDG_CACHE_HOME/kvscope/quantized``; ``KVSCOPE_QUANTIZED_CACHE=off`` turns copies off. Its key covers each weight
file's path, size, modification time and header (the tensors' names, types, shapes and offsets), the quantization
and ``VERSION`` (bumped when a quantizer's output changes): a folder edited, replaced, moved or re-downloaded gets a
new copy, two folders never share one; the blocks' types and shapes are checked against the model's (``Copy``). The copies together stay within ``budget()`` (``KVSCOPE_QUANTIZED_CACHE_GIB``,
16 GiB by default: an 8B model's Q8_0 linears are ~7 GiB), the least recently loaded removed first, and a copy is
written only where ``FREE_MARGIN`` of the disk stays free after it. A copy is written beside the load (a 1B
model's Q8_0: ~1 GB, on a thread beside the quantizing) under a temporary name, made durable and renamed on a thread
(``finish``): a crash never leaves a copy with missing bytes under its final name.

A copy that does not hold what its key promises (cut short, another layout, a header that is not JSON) is removed
and the folder quantized again: its structure is checked against the model before anything is mapped, and every
tensor's bytes against the mapping. Its blocks' values are trusted as a GGUF file's are: it is the user's cache,
written by this engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
from pathlib import Path

import torch

from engine.quant import formats
from engine.quant.mapped import Mapping

log = logging.getLogger(__name__)
VERSION = 1
ENV = "KVSCOPE_QUANTIZED_CACHE"
BUDGET_ENV = "KVSCOPE_QUANTIZED_CACHE_GIB"
DEFAULT_BUDGET = 16 << 30
FREE_MARGIN = 2 << 30  # a cache never takes the disk below this (the user's own files come first)
MAX_HEADER = 16 << 20  # a copy's header: ~100 bytes a tensor, a few thousand tensors
SUFFIX = ".safetensors"
STALE_S = 3600  # a temporary file this old is a load that died while writing it: removed


def root() -> Path | None:
    """Where copies are kept; None where ``KVSCOPE_QUANTIZED_CACHE`` is off."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() in ("off", "0", "no", "false"):
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "quantized"


def budget() -> int:
    """The bytes all copies may take together (``KVSCOPE_QUANTIZED_CACHE_GIB``, else 16 GiB)."""
    try:
        return max(0, int(float(os.environ.get(BUDGET_ENV, "")) * (1 << 30)))
    except ValueError:
        return DEFAULT_BUDGET


def key(files: list[Path], kind: str) -> str:
    """What a copy depends on (module doc): the weight files' identity and headers, the quantization and
    ``VERSION``. (Which tensors it holds follows from them and the model's config: ``Copy`` checks them against
    the model's plan.)"""
    h = hashlib.sha256(f"{VERSION}\0{kind}\0".encode())
    for path in files:
        st = path.stat()
        h.update(f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(n, MAX_HEADER)))  # (the folder's header was checked whole before this)
    return h.hexdigest()[:32]


class Copy(Mapping):
    """A copy mapped, its entries those of ``plan`` (name -> (ggml type, rows, inputs)): ``entries[name] =
    (ggml type, (rows, inputs), start, nbytes)``, ``blocks(name)`` the rows as the kernels read them. ValueError
    where the file is not the copy ``plan`` and ``key_`` describe."""

    def __init__(self, path: Path, plan: dict[str, tuple[int, int, int]], key_: str) -> None:
        super().__init__(path)
        self.path = path
        if self.size < 8:
            raise ValueError("cut short")
        (n,) = struct.unpack_from("<Q", self.map, 0)
        if n > min(self.size - 8, MAX_HEADER):
            raise ValueError(f"a header of {n} bytes in a {self.size}-byte file")
        try:
            header = json.loads(bytes(self.map[8:8 + n]))
            meta = json.loads(header.pop("__metadata__")["kvscope"])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise ValueError("its header is not a copy's") from None
        if meta != {"version": VERSION, "key": key_} or set(header) != set(plan):
            raise ValueError("it holds another copy")
        for name, (t, rows, n_in) in plan.items():
            e = header[name]
            start, end = e["data_offsets"]
            nbytes = rows * formats.row_bytes(t, n_in)
            if (e["dtype"], e["shape"]) != ("U8", [rows, formats.row_bytes(t, n_in)]) or end - start != nbytes \
                    or not self.inside(8 + n + start, nbytes):
                raise ValueError(f"tensor {name!r} is not {rows} rows of {formats.name(t)}")
            self.entries[name] = (t, (rows, n_in), 8 + n + start, nbytes)


def _layout(plan: dict[str, tuple[int, int, int]], key_: str) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """A copy's header (padded so the data starts on a page: a copy's pages are its tensors' own), each tensor's
    (offset in the data, bytes), and the file's size."""
    header: dict = {"__metadata__": {"kvscope": json.dumps({"version": VERSION, "key": key_})}}
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, (t, rows, n_in) in plan.items():
        rb = formats.row_bytes(t, n_in)
        header[name] = {"dtype": "U8", "shape": [rows, rb], "data_offsets": [pos, pos + rows * rb]}
        offsets[name] = (pos, rows * rb)
        pos += rows * rb
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 4096)
    return blob, offsets, 8 + len(blob) + pos


class Writer:
    """A copy being written: ``put`` each tensor's rows as they are made, then ``finish`` (durable and renamed on a
    thread) or ``abort``. Made by ``open_writer`` only where the budget and the disk have room for it.

    The bytes go to the file on the writer's own thread, beside the quantizing (a 1B model's Q8_0 copy, ~1 GB, took
    ~1.0 s of a ~1.0 s load written on the load thread). At most ``QUEUED`` tensors wait (then the load waits: a
    slow disk slows it, never grows its memory); they are the model's own rows until packed: no bytes added."""

    QUEUED = 4

    def __init__(self, path: Path, plan: dict[str, tuple[int, int, int]], key_: str) -> None:
        self.path, self.tmp = path, path.with_name(f"{path.name}.{os.getpid()}.tmp")
        blob, self.offsets, self.total = _layout(plan, key_)
        self.data_at = 8 + len(blob)
        self.fd = os.open(self.tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        self.written: set[str] = set()
        self.failed: BaseException | None = None  # the first error of the disk (the copy is then dropped)
        self._queue, self._thread = queue.Queue(maxsize=self.QUEUED), None
        try:
            self._write(struct.pack("<Q", len(blob)) + blob, 0)
        except OSError:
            self.abort()
            raise
        # a daemon: a process that dies mid-load leaves a temporary file, removed as stale by a later load
        self._thread = threading.Thread(target=self._drain, name="kvscope-quantized-copy-write", daemon=True)
        self._thread.start()

    def _write(self, data, at: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(self.fd, view, at)
            view, at = view[n:], at + n

    def _drain(self) -> None:
        """The writer's thread: each queued tensor's bytes at their offset, until ``_stop``'s None."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, rows, at = item
            if self.failed is None:
                try:
                    self._write(rows.numpy(), at)
                    self.written.add(name)
                except Exception as e:  # noqa: BLE001 (any error drops the copy, never the load)
                    self.failed = e

    def _stop(self) -> None:  # the writes queued waited for, the writer's thread ended
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def put(self, name: str, rows: torch.Tensor) -> None:
        """Queue a tensor's rows ([rows, row_bytes] uint8, as the plan says) for the writer's thread; an error of
        the disk drops the copy (the load goes on without it)."""
        if self.fd < 0 or self.failed is not None:
            return
        start, nbytes = self.offsets[name]
        if rows.numel() != nbytes or rows.dtype != torch.uint8:
            raise ValueError(f"{name}: {rows.numel()} bytes, the copy's plan says {nbytes}")
        self._queue.put((name, rows.contiguous(), self.data_at + start))

    def finish(self) -> threading.Thread | None:
        """Made durable (fsync) and renamed to its final name on a thread of its own (a 1 GB copy's flush waits for
        the disk, not the load); None where the copy was dropped or not every tensor was written."""
        self._stop()
        if self.failed is not None or self.fd < 0 or self.written != set(self.offsets):
            if self.failed is not None:
                log.warning("the quantized copy of this folder is not kept: %s", self.failed)
            self.abort()
            return None
        fd, self.fd = self.fd, -1

        def durable() -> None:
            try:
                os.fsync(fd)
                os.close(fd)
                os.replace(self.tmp, self.path)
            except OSError as e:
                log.warning("the quantized copy of this folder is not kept: %s", e.strerror or e)
                _unlink(self.tmp)

        # not a daemon: a process that exits at once still finishes its copy (Python joins it at exit)
        t = threading.Thread(target=durable, name="kvscope-quantized-copy", daemon=False)
        t.start()
        _WRITING.append(t)
        return t

    def abort(self) -> None:
        self._stop()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unlink(self.tmp)


_WRITING: list[threading.Thread] = []


def wait() -> None:
    """Wait until the copies being made durable are in place (what a test, or a second load, then finds)."""
    while _WRITING:
        _WRITING.pop().join()


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def path_of(files: list[Path], kind: str) -> Path | None:
    """Where the copy of these files quantized as ``kind`` lies, or would; None where copies are off."""
    where = root()
    return where / f"{kind}-{key(files, kind)}{SUFFIX}" if where is not None else None


def find(files: list[Path], kind: str, plan: dict[str, tuple[int, int, int]]) -> tuple[Copy | None, str]:
    """The copy of these files' ``plan`` (mapped, checked) and its key; (None, key) where there is none, copies are
    off, or the copy found does not hold what it should (removed, said in the log)."""
    where = root()
    key_ = key(files, kind)
    if where is None:
        return None, key_
    path = where / f"{kind}-{key_}{SUFFIX}"
    if not path.is_file():
        return None, key_
    try:
        copy = Copy(path, plan, key_)
    except (OSError, ValueError) as e:
        log.warning("a quantized copy that does not hold what it should is removed (%s): %s", path.name, e)
        _unlink(path)
        return None, key_
    try:
        os.utime(path)  # the least recently loaded copies go first (``_make_room``)
    except OSError:
        pass
    return copy, key_


def open_writer(kind: str, key_: str, plan: dict[str, tuple[int, int, int]]) -> Writer | None:
    """A writer of the copy, where copies are on and the budget and the disk have room (older copies removed, the
    least recently loaded first); else None, said in the log."""
    where = root()
    if where is None or not plan:
        return None
    need = _layout(plan, key_)[2]
    try:
        where.mkdir(parents=True, exist_ok=True)
        if not _make_room(where, need):
            return None
        return Writer(where / f"{kind}-{key_}{SUFFIX}", plan, key_)
    except OSError as e:
        log.warning("no quantized copy of this folder is kept in %s: %s", where, e.strerror or e)
        return None


def _make_room(where: Path, need: int) -> bool:
    """Remove the least recently loaded copies until ``need`` more bytes fit the budget; False (nothing removed)
    where it never can, or the disk would keep less than ``FREE_MARGIN`` free."""
    cap = budget()
    copies, now = [], time.time()
    for p in where.iterdir():
        if not _ours(p.name):  # a user's own files in the folder are never counted or removed
            continue
        try:
            st = p.stat()
        except OSError:
            continue
        if p.name.endswith(".tmp") and now - st.st_mtime > STALE_S:
            _unlink(p)  # a load that died while writing its copy
        elif p.name.endswith(SUFFIX):
            copies.append((st.st_mtime, st.st_size, p))
    held = sum(size for _, size, _ in copies)
    free = shutil.disk_usage(where).free
    if need > cap or free + _evictable(copies, held + need - cap) - need < FREE_MARGIN:
        log.info("no quantized copy kept: %d MiB wanted, %d MiB of budget, %d MiB free on the disk",
                 need >> 20, cap >> 20, free >> 20)
        return False
    for _, size, p in sorted(copies):
        if held + need <= cap:
            break
        _unlink(p)
        held -= size
    return True


def _evictable(copies: list, over: int) -> int:
    """The bytes the oldest copies give back to bring ``over`` bytes under the budget (0 where nothing is over)."""
    freed = 0
    for _, size, _ in sorted(copies):
        if freed >= over:
            break
        freed += size
    return freed


KINDS = ("int8", "nf4")  # the ``--quantize`` kinds a copy is made of: a copy's name starts with one of them


def _ours(name: str) -> bool:
    """A copy's name (``<kind>-<key>.safetensors``) or one being written (``….safetensors.<pid>.tmp``): nothing
    else a user keeps in the folder is counted or removed."""
    return name.startswith(tuple(k + "-" for k in KINDS)) and (name.endswith(SUFFIX) or
                                                               (name.endswith(".tmp") and SUFFIX + "." in name))


def _stale(name: str, mtime: float, now: float) -> bool:
    """A temporary file no load is writing: older than ``STALE_S``, or its writer's process is gone."""
    if now - mtime > STALE_S:
        return True
    try:
        pid = int(name.rsplit(".", 2)[-2])
    except ValueError:
        return True
    if pid == os.getpid() or os.name == "nt":  # (Windows' kill(pid, 0) is a Ctrl+C: the age alone says there)
        return False  # this process writes it now (``Writer``)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # another user's live process
    return False


def held(where: Path | None = None) -> tuple[int, int]:
    """(copies, bytes) in ``where`` (else ``root()``; (0, 0) where copies are off or the folder is missing): the
    bytes count the temporary files of copies being written too, as they take the disk."""
    where = root() if where is None else Path(where)
    count = nbytes = 0
    if where is None or not where.is_dir():
        return 0, 0
    for entry in os.scandir(where):
        if _ours(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                nbytes += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
            count += entry.name.endswith(SUFFIX)
    return count, nbytes


def clear(where: Path | None = None) -> int:
    """Remove the copies in ``where`` (else ``root()``) and the temporary files no load is writing; nothing else
    there. The copies being made durable are waited for first (else one would appear after the clear). A copy the
    loaded model maps goes from the folder at once, its disk space when the model goes. Returns the bytes freed;
    a file that cannot be removed is left (said in the log)."""
    wait()
    where = root() if where is None else Path(where)
    if where is None or not where.is_dir():
        return 0
    freed, now = 0, time.time()
    for entry in os.scandir(where):
        if not (_ours(entry.name) and entry.is_file(follow_symlinks=False)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if entry.name.endswith(".tmp") and not _stale(entry.name, st.st_mtime, now):
                continue
            os.unlink(entry.path)
            freed += st.st_size
        except OSError as e:
            log.warning("a quantized copy could not be removed (%s): %s", entry.name, e.strerror or e)
    return freed
