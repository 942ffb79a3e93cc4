"""GGUF files at the byte level, for the hostile-file tests: a file's metadata and tensor table read into plain
lists, edited, and written back — any key set to any type or value (a split count of 10^9, a context length that
is a string, a vocabulary of a million tokens), which the ``gguf`` package's writer will not produce.

The format (GGUF v3, little-endian): magic, version u32, tensor count u64, metadata count u64; each metadata entry
is a key (u64 length + bytes), a value type u32 and the value; each tensor entry a name, its dimension count u32,
its dims u64 each (fastest first), its GGML type u32 and its offset u64 from the aligned start of the data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

# GGUFValueType
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, v, item: int | None = None) -> bytes:
    """The bytes of one metadata value of ``vtype`` (``item``: an array's element type)."""
    if vtype == STR:
        return _str(v)
    if vtype == ARR:
        return struct.pack("<IQ", item, len(v)) + b"".join(value(item, x) for x in v)
    return struct.pack(_FMT[vtype], v)


def strings(items) -> bytes:
    """An array of strings' value bytes, fast for a million of them."""
    items = list(items)
    return struct.pack("<IQ", STR, len(items)) + b"".join(_str(x) for x in items)


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class RawGguf:
    kv: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # key -> (value type, value bytes)
    tensors: list[Tensor] = field(default_factory=list)
    data: bytes = b""
    alignment: int = 32

    def set(self, key: str, vtype: int, v, item: int | None = None) -> "RawGguf":
        self.kv[key] = (vtype, value(vtype, v, item))
        return self

    def set_raw(self, key: str, vtype: int, raw: bytes) -> "RawGguf":
        self.kv[key] = (vtype, raw)
        return self

    def drop(self, *keys: str) -> "RawGguf":
        for k in keys:
            self.kv.pop(k, None)
        return self

    def get(self, key: str):
        """A scalar or string value (None for arrays or a missing key)."""
        if key not in self.kv:
            return None
        vtype, raw = self.kv[key]
        if vtype == STR:
            return raw[8:].decode()
        return struct.unpack(_FMT[vtype], raw)[0] if vtype in _FMT else None

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def write(self, path: Path, pad_data: bool = True) -> Path:
        head = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors), len(self.kv))]
        for key, (vtype, raw) in self.kv.items():
            head += [_str(key), struct.pack("<I", vtype), raw]
        for t in self.tensors:
            head += [_str(t.name), struct.pack("<I", len(t.shape)), struct.pack(f"<{len(t.shape)}Q", *t.shape),
                     struct.pack("<IQ", t.ggml_type, t.offset)]
        out = b"".join(head)
        if pad_data:
            out += b"\0" * (-len(out) % self.alignment)
        path.write_bytes(out + self.data)
        return path


def _skip_value(buf: bytes, i: int, vtype: int) -> int:
    if vtype == STR:
        return i + 8 + struct.unpack_from("<Q", buf, i)[0]
    if vtype == ARR:
        item, n = struct.unpack_from("<IQ", buf, i)
        i += 12
        if item in _FMT:
            return i + n * struct.calcsize(_FMT[item])
        for _ in range(n):
            i = _skip_value(buf, i, item)
        return i
    return i + struct.calcsize(_FMT[vtype])


def read(path: Path) -> RawGguf:
    """A well-formed GGUF file (one the tests wrote) as a ``RawGguf`` to edit."""
    buf = Path(path).read_bytes()
    assert buf[:4] == b"GGUF"
    _, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    i = 24
    g = RawGguf()
    for _ in range(n_kv):
        klen = struct.unpack_from("<Q", buf, i)[0]
        key = buf[i + 8:i + 8 + klen].decode()
        i += 8 + klen
        vtype = struct.unpack_from("<I", buf, i)[0]
        i += 4
        end = _skip_value(buf, i, vtype)
        g.kv[key] = (vtype, buf[i:end])
        i = end
    for _ in range(n_tensors):
        nlen = struct.unpack_from("<Q", buf, i)[0]
        name = buf[i + 8:i + 8 + nlen].decode()
        i += 8 + nlen
        dims = struct.unpack_from("<I", buf, i)[0]
        shape = struct.unpack_from(f"<{dims}Q", buf, i + 4)
        i += 4 + 8 * dims
        gtype, offset = struct.unpack_from("<IQ", buf, i)
        i += 12
        g.tensors.append(Tensor(name, tuple(shape), gtype, offset))
    if "general.alignment" in g.kv:
        g.alignment = g.get("general.alignment")
    i += -i % g.alignment
    g.data = buf[i:]
    return g
