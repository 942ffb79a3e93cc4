"""GGUF files (llama.cpp's format: LM Studio, Ollama, Jan, KoboldCpp): what one holds, from its header only, and
every reason one cannot be opened, as one line — before transformers reads a byte of it.

The header is read here with the ``gguf`` package's definitions of the format (``GGUF_MAGIC``, ``GGUFValueType``,
``GGMLQuantizationType``, ``GGML_QUANT_SIZES``) but not its ``GGUFReader``: that one memory-maps the whole file and
builds a Python object per array element (a 150,000-token vocabulary with its merges: 19 s here, against ~0.1 s
skipping them), and a truncated file or an unknown tensor type comes out of it as a numpy ``reshape`` or
``ValueError`` that names neither the file nor the fix. Nothing here imports torch or transformers: the model
catalog (``engine.model.catalog``) reads every GGUF on the machine with it, off the GUI thread.

Safety: a path is looked at with ``stat`` before it is opened (a FIFO would block ``open`` forever, a directory, a
device or a link loop is named), opened non-blocking and checked again with ``fstat``; every count and length in
the header is bounded by the bytes left in the file before anything is allocated for it.
"""

from __future__ import annotations

import array
import errno
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from engine.errors import ModelFormatError, ModelNotFoundError

SUFFIX = ".gguf"
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_U64 = struct.Struct("<Q")  # a string's length
_MAX_KEY = 65_536  # bytes of a metadata key (llama.cpp's longest are ~60)
_MAX_STRING = 64 << 20  # a chat template is tens of KiB; 64 MiB is a broken length, not text
_KEEP = 4_096  # arrays of at most this many numbers are kept (per-layer lists); longer ones (a vocabulary) counted
_MAX_DEPTH = 2  # arrays of arrays: the format allows them, nothing in use nests deeper
_MAX_DIMS = 4  # GGML_MAX_DIMS
_NATIVE = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")  # stored as plain numbers, no blocks
_FIX = "re-download it"
MAX_SPLIT = 65_535  # llama.cpp's gguf-split writes split.count as a uint16


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    type_name: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF file holds, from its header: enough to list it, estimate its memory and refuse it early."""

    path: str
    name: str  # general.name, else the file's name without .gguf
    architecture: str  # general.architecture as llama.cpp spells it ("llama", "qwen2", "qwen2moe", ...)
    size_bytes: int  # on disk, every part of a split file together
    n_params: int
    type_counts: tuple[tuple[str, int], ...]  # tensors per GGML type, most first: (("Q8_0", 36), ("F32", 11))
    metadata: dict[str, Any]  # scalars, strings and short arrays; a long array as {"count": n, "type": t,
    # "at": the file offset of its first element} (no "at": an array of arrays; ``string_starts``: where its
    # strings start and end)
    tensors: tuple[TensorEntry, ...]
    split_count: int = 1

    def get(self, key: str, default: Any = None) -> Any:
        """``{architecture}.key`` from the metadata (``context_length``, ``attention.head_count``, ...)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def weights_type(self) -> str:
        """The type the weights are stored in, as llama.cpp names the file ("Q4_K_M", "Q8_0", "F16"): its
        ``general.file_type``, else the block type (or, with none, the plain type) holding the most bytes."""
        import gguf

        ftype = self.metadata.get("general.file_type")
        if isinstance(ftype, int) and ftype in gguf.LlamaFileType._value2member_map_:
            return gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        by_bytes: dict[str, int] = {}
        for t in self.tensors:
            by_bytes[t.type_name] = by_bytes.get(t.type_name, 0) + t.nbytes
        blocks = {k: v for k, v in by_bytes.items() if k not in _NATIVE} or by_bytes
        return max(blocks, key=blocks.__getitem__) if blocks else "F32"

    @property
    def quantized(self) -> bool:
        """True when some weights are stored in blocks (Q8_0, Q4_K, ...) that loading dequantizes."""
        return any(name not in _NATIVE for name, _ in self.type_counts)

    @property
    def context_length(self) -> int:
        return _whole(self.get("context_length"))

    @property
    def has_chat_template(self) -> bool:
        return isinstance(self.metadata.get("tokenizer.chat_template"), str)

    def config(self) -> dict[str, Any]:
        """The model's shape as ``config.json`` spells it (what the memory estimate reads); float32 weights. A value
        of the wrong type reads as 0 here: ``engine.model.gguf_checks`` is what refuses it."""
        heads = _whole(self.get("attention.head_count"))
        kv_heads = _whole(self.get("attention.head_count_kv")) or heads
        hidden = _whole(self.get("embedding_length"))
        head_dim = _whole(self.get("attention.key_length")) or (hidden // heads if heads else 0)
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab = _whole(self.get("vocab_size")) or (tokens.get("count", 0) if isinstance(tokens, dict) else 0)
        cfg = {"model_type": self.architecture, "num_hidden_layers": _whole(self.get("block_count")),
               "num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_size": hidden,
               "head_dim": head_dim, "max_position_embeddings": self.context_length, "vocab_size": int(vocab or 0),
               "torch_dtype": "float32", "tie_word_embeddings": not any(t.name == "output.weight" for t in self.tensors)}
        window = _whole(self.get("attention.sliding_window"))
        if window:
            cfg["sliding_window"] = window
        return cfg


def _whole(value: Any) -> int:
    """A count from the header (a per-layer list's largest entry: LFM2's head counts); 0 unless a whole number."""
    if isinstance(value, list):
        value = max((v for v in value if isinstance(v, int) and not isinstance(v, bool)), default=0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def looks_like_gguf(path: str | os.PathLike) -> bool:
    """A path to treat as a GGUF file: named ``*.gguf`` (whatever it turns out to be: a bad one is refused by
    ``read_gguf`` in one line), or a regular file that starts with the GGUF magic (Ollama's blobs have no suffix).
    Never opens anything but a regular file."""
    if str(path).lower().endswith(SUFFIX):
        return True
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    for test, words in ((stat.S_ISREG, None), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a pipe (FIFO)"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return words
    return "not a regular file"


def check_path(path: Path) -> int:
    """The size of ``path`` if it is a regular file (or a link to one) with bytes in it; else ``ModelFormatError``
    (``ModelNotFoundError`` when nothing is there), without opening it."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ModelFormatError(f"{path.name} is a symbolic link loop, not a GGUF file") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(path):
                raise ModelFormatError(f"{path.name} is a broken link (it points to {os.readlink(path)})") from None
            raise ModelNotFoundError(f"model file not found: {path}") from None
        raise ModelFormatError(f"cannot read {path}: {e.strerror or e}") from None
    kind = _kind(st.st_mode)
    if kind:
        raise ModelFormatError(f"{path.name} is {kind}, not a GGUF file")
    if st.st_size == 0:
        raise ModelFormatError(f"{path.name} is empty (0 bytes): not a GGUF file ({_FIX})")
    return st.st_size


def _open(path: Path) -> BinaryIO:
    """Open a regular file without blocking (a FIFO swapped in after ``check_path`` cannot hang it) and check,
    on the open descriptor, that it is still one."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise ModelFormatError(f"cannot open {path}: {e.strerror or e}") from None
    kind = _kind(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        raise ModelFormatError(f"{path.name} is {kind}, not a GGUF file")
    return os.fdopen(fd, "rb", buffering=1 << 16)


class _Header:
    """Reads a GGUF header from ``f`` (``size`` bytes), every length bounded by what is left of the file."""

    _SCALARS: dict[int, str] = {}

    def __init__(self, f: BinaryIO, size: int, name: str) -> None:
        import gguf

        self.f, self.size, self.name, self.gguf = f, size, name, gguf
        self.starts: dict[int, tuple[array.array, int]] = {}  # a string array's first offset -> (starts, end)
        if not _Header._SCALARS:
            v = gguf.GGUFValueType
            _Header._SCALARS.update({v.UINT8: "<B", v.INT8: "<b", v.UINT16: "<H", v.INT16: "<h", v.UINT32: "<I",
                                     v.INT32: "<i", v.FLOAT32: "<f", v.BOOL: "<?", v.UINT64: "<Q", v.INT64: "<q",
                                     v.FLOAT64: "<d"})

    def truncated(self) -> ModelFormatError:
        return ModelFormatError(f"{self.name} is truncated: its header stops at byte {self.size} ({_FIX})")

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise self.truncated()
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def count(self, what: str, each: int = 1) -> int:
        n = self.u64()
        if n * each > self.size - self.f.tell():
            raise ModelFormatError(f"{self.name} is corrupt or truncated: {what} of {n:,} in a {self.size:,}-byte "
                                   f"file ({_FIX})")
        return n

    def string(self, limit: int = _MAX_STRING) -> str:
        n = self.count("a string", 1)
        if n > limit:
            raise ModelFormatError(f"{self.name} is corrupt: a string of {n:,} bytes in its header ({_FIX})")
        return self.take(n).decode("utf-8", errors="replace")

    def vtype(self) -> int:
        t = self.u32()
        if t not in self.gguf.GGUFValueType._value2member_map_:
            raise ModelFormatError(f"{self.name} is corrupt: unknown metadata value type {t} ({_FIX})")
        return t

    def value(self, t: int, depth: int = 0) -> Any:
        v = self.gguf.GGUFValueType
        if t == v.STRING:
            return self.string()
        if t != v.ARRAY:
            fmt = self._SCALARS[t]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        item = self.vtype()
        if depth >= _MAX_DEPTH and item == v.ARRAY:
            raise ModelFormatError(f"{self.name} is corrupt: metadata arrays nested deeper than {_MAX_DEPTH} ({_FIX})")
        width = struct.calcsize(self._SCALARS[item]) if item in self._SCALARS else 8
        n = self.count("an array", width)
        if item in self._SCALARS and n <= _KEEP:
            return [self.value(item, depth + 1) for _ in range(n)]
        at = self.f.tell()  # (where its first element lies: ``gguf_fields`` reads the vocabulary from there)
        if item in self._SCALARS:  # a long array of numbers (token scores, types): skipped, counted
            self.f.seek(n * width, os.SEEK_CUR)
            return {"count": n, "type": v(item).name, "at": at}
        if item == v.STRING:
            self.skip_strings(n)  # tokens, merges: read past, none kept
        for _ in range(n if item == v.ARRAY else 0):
            self.value(item, depth + 1)
        if self.f.tell() > self.size:
            raise self.truncated()
        return {"count": n, "type": v(item).name, **({"at": at} if item == v.STRING else {})}

    def skip_strings(self, n: int) -> None:
        """Walk past ``n`` length-prefixed strings, reading the file a MiB at a time (a read and a seek per string
        took ~0.4 s of Llama-3's 408,451 tokens and merges); each length bounded by what is left of the file. Where
        each string starts is kept (``starts``, by the array's first offset): the vocabulary's reader and the
        tensor table take them instead of walking the strings again (~0.1 s a walk of Llama-3's)."""
        at, buf, off = self.f.tell(), b"", 0  # at: the file offset of buf[0]
        first, starts = at, array.array("q")
        unpack, keep, left = _U64.unpack_from, starts.append, n
        while left:  # each pass: the strings whose lengths lie whole in the buffer, then the next MiB read
            if off > len(buf):  # the last string ran past the buffer: go to its end
                self.f.seek(at + off)
            at += off
            buf, off = buf[off:] + self.f.read(1 << 20), 0
            if len(buf) < 8:
                raise self.truncated()
            last, room = len(buf) - 8, self.size - at - 8  # a length at off may be at most room - off
            while left and off <= last:
                (length,) = unpack(buf, off)
                if length > room - off:
                    raise ModelFormatError(f"{self.name} is corrupt or truncated: a string of {length:,} in a "
                                           f"{self.size:,}-byte file ({_FIX})")
                keep(at + off)
                off += 8 + length
                left -= 1
        self.f.seek(at + off)
        self.starts[first] = (starts, at + off)


def _tensor(h: _Header) -> tuple[str, tuple[int, ...], int, int]:
    name = h.string(_MAX_KEY)
    dims = h.u32()
    if not 1 <= dims <= _MAX_DIMS:
        raise ModelFormatError(f"{h.name} is corrupt: tensor {name!r} has {dims} dimensions ({_FIX})")
    shape = tuple(h.u64() for _ in range(dims))
    return name, shape, h.u32(), h.u64()


def _entry(h: _Header, name: str, shape: tuple[int, ...], raw_type: int, offset: int) -> TensorEntry:
    """One tensor's bytes from its GGML type, refusing a type the ``gguf`` package does not know or cannot
    dequantize (transformers dequantizes through it)."""
    gguf = h.gguf
    if raw_type not in gguf.GGMLQuantizationType._value2member_map_:
        raise ModelFormatError(
            f"{h.name}: tensor {name!r} has unknown GGML type {raw_type} (newer than the gguf package "
            f"{_gguf_version()} knows): open a GGUF quantized as Q8_0, Q4_K_M, F16 or another common type")
    qtype = gguf.GGMLQuantizationType(raw_type)
    dequantizable = set(getattr(gguf.quants, "_type_traits", {})) | {gguf.GGMLQuantizationType[n] for n in _NATIVE}
    if qtype not in dequantizable:
        raise ModelFormatError(f"{h.name}: tensor {name!r} is stored as {qtype.name}, which the gguf package "
                               "cannot dequantize: open a GGUF quantized as Q8_0, Q4_K_M, F16 or another common type")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = math.prod(shape)
    if shape[0] % block:
        raise ModelFormatError(f"{h.name} is corrupt: tensor {name!r} rows of {shape[0]} are not whole "
                               f"{qtype.name} blocks of {block} ({_FIX})")
    return TensorEntry(name, shape, qtype.name, offset, n // block * type_size)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"


def _magic(h: _Header) -> None:
    head = h.f.read(4)
    if head == b"FUGG":
        raise ModelFormatError(f"{h.name} is a big-endian GGUF (made for IBM Z machines): open the usual "
                               "little-endian file")
    if head != b"GGUF":
        text = head.decode("utf-8", "replace")  # said as text or hex, never Python's b'hell'
        what = ("a safetensors file" if len(head) == 4 and head[3:] == b"\x00" else
                "a zip / PyTorch file" if head.startswith(b"PK") else
                f'a text file: it starts with "{text}"' if text.isprintable() and "\ufffd" not in text else
                f"it starts with the bytes {head.hex(' ')}")
        raise ModelFormatError(f"{h.name} is not a GGUF file ({what}, not the GGUF signature)")
    version = h.u32()
    if version not in (2, 3):
        raise ModelFormatError(f"{h.name} is GGUF version {version}; versions 2 and 3 can be read "
                               "(re-convert it with a current llama.cpp)")


def _parse(path: Path, size: int) -> tuple[dict[str, Any], list[TensorEntry], dict[int, tuple[array.array, int]]]:
    with _open(path) as f:
        h = _Header(f, size, path.name)
        _magic(h)
        n_tensors = h.count("a tensor count", 24)  # each tensor's entry is at least 24 bytes
        n_kv = h.count("a metadata count", 12)
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = h.string(_MAX_KEY)
            meta[key] = h.value(h.vtype())
        raw = [_tensor(h) for _ in range(n_tensors)]
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelFormatError(f"{path.name} is corrupt: general.alignment {align!r} is not a power of two ({_FIX})")
        header_end = f.tell()
        data_start = -(-header_end // align) * align
        entries = [_entry(h, *r) for r in raw]
    # no tensors: nothing after the header, not even the padding (a vocabulary-only file, or not a model at all)
    end = max((data_start + e.offset + e.nbytes for e in entries), default=header_end)
    if end > size:
        raise ModelFormatError(f"{path.name} is truncated: {size:,} bytes on disk, its tensors need {end:,} "
                               f"({_FIX})")
    return meta, entries, h.starts


def split_count(path: Path, meta: dict[str, Any]) -> int:
    """How many files a GGUF is split in (``split.count`` in its header, or its name's ``-of-00003``); 1 for a
    single file. ``ModelFormatError`` for a count that is not a whole number of at most ``MAX_SPLIT`` (llama.cpp's
    gguf-split writes it as a 16-bit number: a header saying 10^9 is not a real file)."""
    count = meta.get("split.count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SPLIT:
        shown = f"{count:,}" if isinstance(count, int) and not isinstance(count, bool) else repr(count)[:40]
        raise ModelFormatError(f"{path.name} is corrupt: split.count is {shown} (a model is split in 1 to "
                               f"{MAX_SPLIT:,} files; {_FIX})")
    m = SPLIT_NAME.match(path.name)
    return max(count, int(m.group("count")) if m else 1)


def split_part(path: Path, count: int, i: int) -> Path:
    """Part ``i`` (1-based) of ``count`` of the split GGUF ``path`` belongs to (derived, never listed)."""
    m = SPLIT_NAME.match(path.name)
    stem = m.group("stem") if m else path.stem
    return path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf")


def missing_parts(path: Path, count: int, show: int = 3) -> tuple[int, list[str]]:
    """How many parts of a split GGUF are not in its folder, and the names of the first ``show`` of them."""
    missing, names = 0, []
    for i in range(1, count + 1):
        p = split_part(path, count, i)
        if not os.path.isfile(p):
            missing += 1
            if len(names) < show:
                names.append(p.name)
    return missing, names


_last: dict[tuple, tuple[dict[str, Any], list[TensorEntry], dict]] = {}  # the last header parsed (one entry)


def _parsed(path: Path, size: int) -> tuple[dict[str, Any], list[TensorEntry], dict]:
    """``_parse``, once per version of a file: a load reads the header for the memory verdict and again to load
    (a Llama-3 vocabulary's header ~0.15 s each); a file written since (size, time or inode changed) is read again."""
    st = os.stat(path)
    key = (os.path.realpath(path), size, st.st_mtime_ns, st.st_ino)
    parsed = _last.get(key)
    if parsed is None:  # (the catalog reads headers on its own thread: one lookup, never a KeyError)
        parsed = _parse(path, size)
        _last.clear()
        _last[key] = parsed
    return parsed


def string_starts(info: GgufInfo) -> dict[int, tuple[array.array, int]]:
    """Where each string of ``info``'s long string arrays starts, by the array's first offset (its metadata's
    ``"at"``), with the offset just past its last string: as the header's walk found them, while that header is the
    last one parsed and the file has not changed since ({} otherwise: the caller walks the strings itself)."""
    path = Path(info.path)
    try:
        st = os.stat(path)
    except OSError:
        return {}
    parsed = _last.get((os.path.realpath(path), info.size_bytes, st.st_mtime_ns, st.st_ino))
    return parsed[2] if parsed is not None else {}


def read_gguf(path: str | os.PathLike) -> GgufInfo:
    """The header facts of the GGUF file at ``path`` (never its weights). Raises ``ModelFormatError`` with one line
    for anything that is not a whole, readable, single-file GGUF: not a regular file (a directory, a FIFO, a
    device, a link loop), empty, the wrong magic or version, a header cut short or with impossible counts, a
    tensor type the gguf package does not know or cannot dequantize, tensors past the end of the file (a download
    that stopped early), a split model with parts missing — or with all of them (transformers reads one file)."""
    path = Path(os.path.expanduser(str(path)))
    size = check_path(path)
    meta, entries, _ = _parsed(path, size)
    count = split_count(path, meta)
    if count > 1:
        missing, names = missing_parts(path, count)
        if missing:
            raise ModelFormatError(
                f"{path.name} is one part of a model split in {count:,} files and {missing:,} "
                f"{'is' if missing == 1 else 'are'} missing ({', '.join(names)}"
                f"{' …' if missing > len(names) else ''}): download every part into {path.parent}")
        raise ModelFormatError(
            f"{path.name} is one part of a model split in {count:,} files; transformers reads a single file: "
            f"merge them first (llama-gguf-split --merge {split_part(path, count, 1).name} merged.gguf)")
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.type_name] = counts.get(e.type_name, 0) + 1
    name = meta.get("general.name")
    return GgufInfo(
        path=str(path), name=name if isinstance(name, str) and name.strip() else path.name.removesuffix(SUFFIX),
        architecture=str(meta.get("general.architecture") or ""), size_bytes=size,
        n_params=sum(math.prod(e.shape) for e in entries),
        type_counts=tuple(sorted(counts.items(), key=lambda kv: -kv[1])), metadata=meta, tensors=tuple(entries))
