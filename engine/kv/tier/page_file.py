"""The page file of the KV disk tier (``engine.kv.tier.disk``): a magic line, a little-endian uint32 header length, a
JSON header (the page's name, its shelf, dtype, K and V shapes, payload bytes, an HMAC-SHA256 of the page's
name, shelf and payload under the folder's key; padded with spaces so the payload starts on a 64-byte
boundary), then K ``[layers, heads, P, dim]`` and V as stored.

The key (``engine.kv.tier.folder.folder_key``: 32 random bytes in ``<folder>/.key``, mode 0600) makes a file
trusted only in the folder that wrote it, under the name it was written for: a plain SHA-256 of the payload let
anyone rewrite a header — another page's K/V under this page's name, a file copied from another shelf or
machine — and recompute the checksum. HMAC costs what SHA-256 did (two more 64-byte blocks a file); files of
the earlier format (``KVSCOPE-PAGE-1``) are dropped once and recomputed.

A page path holds whatever anyone put there, so reading trusts nothing: ``read_page`` opens with ``O_NOFOLLOW``
(a symbolic link is refused, not followed to a 2 GiB file) and ``O_NONBLOCK`` (opening a FIFO with no writer
would block the engine thread forever), then ``fstat``s the open file — a regular file of exactly the size
this page has (``page_size``: known from the arena's shape and dtype) or it is never read. ``parse`` checks every
field against what the reader expects, with the header's length and nesting bounded before ``json`` sees it
(``json`` recurses once per level: 100,000 levels were a ``RecursionError``), and the values finite. Every
failure is a ``PageFileError`` naming what does not match: the tier drops the file and computes its tokens
again.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import math
import os
import stat
import struct

import torch

from engine.inputs import json_depth

MAGIC = b"KVSCOPE-PAGE-2\n"
ALIGN = 64
SUFFIX = ".kvp"
MAX_HEADER = 4096  # bytes: a header is ~330 (two 64-hex digests, two 4-int shapes); a longer one is not ours
MAX_DEPTH = 2  # a header is one object holding lists of ints
OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
              | getattr(os, "O_CLOEXEC", 0))


class PageFileError(ValueError):
    """A page file that cannot be used; the message says why (for the user's note)."""


def _header(name_hex: str, shelf: str, dtype: str, k: list[int], v: list[int], nbytes: int, digest: str) -> bytes:
    header = json.dumps({"name": name_hex, "shelf": shelf, "dtype": dtype, "k": k, "v": v, "bytes": nbytes,
                         "hmac": digest}).encode()
    header += b" " * (-(len(MAGIC) + 4 + len(header)) % ALIGN)  # the payload starts aligned for any dtype
    return MAGIC + struct.pack("<I", len(header)) + header


def mac(key: bytes, name: bytes, shelf: str, *payload) -> str:
    """HMAC-SHA256 (hex) of a page's name, shelf and payload parts under the folder's ``key``."""
    h = hmac.new(key, name + b"\0" + shelf.encode() + b"\0", hashlib.sha256)
    for part in payload:
        h.update(part)
    return h.hexdigest()


def encode(name: bytes, shelf: str, k: torch.Tensor, v: torch.Tensor, key: bytes):
    """(magic + length + header bytes, K bytes, V bytes) of a page file; K and V are host tensors."""
    kb, vb = (t.contiguous().view(torch.uint8).numpy() for t in (k, v))
    head = _header(name.hex(), shelf, dtype_name(k.dtype), list(k.shape), list(v.shape), kb.nbytes + vb.nbytes,
                   mac(key, name, shelf, kb, vb))
    return head, kb, vb


def _expected(name: bytes, shelf: str, arena) -> dict:
    s, P = arena.shape, arena.page_size
    (hk, dk), (hv, dv) = s.of("k"), s.of("v")
    kn, vn = (s.num_layers * heads * P * dim * s.elem_bytes for heads, dim in ((hk, dk), (hv, dv)))
    return {"name": name.hex(), "shelf": shelf, "dtype": dtype_name(s.dtype), "k": [s.num_layers, hk, P, dk],
            "v": [s.num_layers, hv, P, dv], "bytes": kn + vn, "kn": kn}


def page_size(name: bytes, shelf: str, arena) -> int:
    """Bytes of the file of page ``name`` on ``arena``'s shelf: header (its length fixed by the arena's shapes;
    a digest is always 64 hex digits) and payload."""
    w = _expected(name, shelf, arena)
    return len(_header(w["name"], shelf, w["dtype"], w["k"], w["v"], w["bytes"], "0" * 64)) + w["bytes"]


def read_page(path: str, size: int, at_most: bool = False) -> bytearray | None:
    """The ``size`` bytes of the page file at ``path`` (its mtime touched: the LRU order), or None if there is
    none. ``PageFileError`` — nothing read — for a symbolic link, a FIFO, a directory, a device, or a regular
    file of another size (``at_most``: of more than ``size`` bytes; the file's own size is read)."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW's answer for a link (Linux; BSD)
            raise PageFileError("a symbolic link, not a page file") from None
        raise PageFileError(f"unreadable: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PageFileError(f"{kind(st.st_mode)}, not a page file")
        if at_most and st.st_size <= size:
            size = st.st_size
        elif st.st_size != size:
            how = "truncated" if st.st_size < size else "too large"
            raise PageFileError(f"{how}: {st.st_size:,} bytes where a page file has {'at most ' * at_most}{size:,}")
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise PageFileError("truncated while read")
            got += n
        _touch(fd)
        return buf
    except OSError as e:
        raise PageFileError(f"unreadable: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_header(buf: bytearray, magic: bytes = MAGIC, max_header: int = MAX_HEADER, max_depth: int = MAX_DEPTH,
                what: str = "a page file") -> tuple[dict, int]:
    """(the JSON header, where the payload starts) of a tier file's bytes, the header's length and nesting bounded
    before ``json`` sees it and the payload exactly the header's ``bytes``; ``PageFileError`` saying what is wrong."""
    m = len(magic)
    if bytes(buf[:m]) != magic or len(buf) < m + 4:
        raise PageFileError(f"not {what}")
    (hlen,) = struct.unpack("<I", buf[m:m + 4])
    if hlen > max_header or m + 4 + hlen > len(buf):
        raise PageFileError("damaged header (its length)")
    text = bytes(buf[m + 4:m + 4 + hlen]).decode("utf-8", errors="replace")
    if json_depth(text) > max_depth:
        raise PageFileError("damaged header (nested too deep)")
    try:
        h = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; an int of 5,000 digits too
        raise PageFileError("damaged header") from None
    off = m + 4 + hlen
    if not isinstance(h, dict) or len(buf) - off != h.get("bytes"):
        raise PageFileError("truncated or extended")
    return h, off


def parse(buf: bytearray, name: bytes, shelf: str, arena, key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a page file's bytes; ``PageFileError`` (and nothing else) saying what does not match."""
    h, off = read_header(buf)
    want = _expected(name, shelf, arena)
    kn = want.pop("kn")
    for field, value in want.items():
        if h.get(field) != value:
            raise PageFileError(f"{field} does not match")
    if not isinstance(h.get("hmac"), str) or not hmac.compare_digest(mac(key, name, shelf, memoryview(buf)[off:]),
                                                                      h["hmac"]):
        raise PageFileError("checksum mismatch: altered, or written under another folder's key")
    dtype = arena.shape.dtype
    raw = torch.frombuffer(buf, dtype=torch.uint8, offset=off)
    k = raw[:kn].view(dtype).reshape(want["k"])
    v = raw[kn:].view(dtype).reshape(want["v"])
    # K/V the model computed are finite (a NaN model fails its own logits check). A sum is finite only if every
    # value is (NaN and inf carry through; float32 sums of K/V never reach 3e38): ~0.01 ms for 736 KB where
    # isfinite().all() took 0.75 ms, as long as the HMAC
    if dtype.is_floating_point and not all(math.isfinite(float(t.sum(dtype=torch.float32))) for t in (k, v)):
        raise PageFileError("values not finite (NaN or inf)")
    return k, v


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kind(mode: int) -> str:
    """What a non-file at a page path is, for the note."""
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe (FIFO)"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "not a regular file"


def remove(path: str) -> bool:
    """Remove what is at ``path`` (a file, link, FIFO: unlinked; a directory: only if empty). True when nothing
    is there any more."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _touch(fd: int) -> None:
    try:
        os.utime(fd)  # the open file, not whatever its name points to by now
    except OSError:
        pass
