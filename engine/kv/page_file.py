"""The page file of the KV disk tier (``engine.kv.disk``): a magic line, a little-endian uint32 header length, a
JSON header (the page's name, its shelf, dtype, K and V shapes, payload bytes, SHA-256 of the payload; padded
with spaces so the payload starts on a 64-byte boundary), then K ``[layers, heads, P, dim]`` and V as stored.
``parse`` checks every field against what the reader expects: a file that is torn, truncated, altered, renamed or
from another setting is a ``ValueError`` naming what does not match.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

MAGIC = b"KVSCOPE-PAGE-1\n"
ALIGN = 64
SUFFIX = ".kvp"


def encode(name: bytes, shelf: str, k: torch.Tensor, v: torch.Tensor):
    """(magic + length + header bytes, K bytes, V bytes) of a page file; K and V are host tensors."""
    kb, vb = (t.contiguous().view(torch.uint8).numpy() for t in (k, v))
    digest = hashlib.sha256(kb)
    digest.update(vb)
    header = json.dumps({"name": name.hex(), "shelf": shelf, "dtype": dtype_name(k.dtype), "k": list(k.shape),
                         "v": list(v.shape), "bytes": kb.nbytes + vb.nbytes, "sha256": digest.hexdigest()}).encode()
    header += b" " * (-(len(MAGIC) + 4 + len(header)) % ALIGN)  # the payload starts aligned for any dtype
    return MAGIC + struct.pack("<I", len(header)) + header, kb, vb


def parse(buf: bytearray, name: bytes, shelf: str, arena) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a page file's bytes; ``ValueError`` saying what does not match."""
    m = len(MAGIC)
    if bytes(buf[:m]) != MAGIC or len(buf) < m + 4:
        raise ValueError("not a page file")
    (hlen,) = struct.unpack("<I", buf[m:m + 4])
    try:
        h = json.loads(bytes(buf[m + 4:m + 4 + hlen]))
    except ValueError:
        raise ValueError("damaged header") from None
    off = m + 4 + hlen
    if not isinstance(h, dict) or len(buf) - off != h.get("bytes"):
        raise ValueError("truncated or extended")
    if hashlib.sha256(memoryview(buf)[off:]).hexdigest() != h.get("sha256"):
        raise ValueError("checksum mismatch")
    s, P = arena.shape, arena.page_size
    (hk, dk), (hv, dv) = s.of("k"), s.of("v")
    kn, vn = (s.num_layers * heads * P * dim * s.elem_bytes for heads, dim in ((hk, dk), (hv, dv)))
    want = {"name": name.hex(), "shelf": shelf, "dtype": dtype_name(s.dtype), "k": [s.num_layers, hk, P, dk],
            "v": [s.num_layers, hv, P, dv], "bytes": kn + vn}
    for key, value in want.items():
        if h.get(key) != value:
            raise ValueError(f"{key} does not match")
    raw = torch.frombuffer(buf, dtype=torch.uint8, offset=off)
    k = raw[:kn].view(s.dtype).reshape(want["k"])
    v = raw[kn:].view(s.dtype).reshape(want["v"])
    return k, v


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass
