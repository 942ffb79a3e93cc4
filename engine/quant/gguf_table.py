"""A GGUF file's header read in place: the file memory-mapped once (``engine.quant.mapped.Mapping``) and where each
tensor's bytes lie in it (``Table``), what ``engine.quant.gguf_keep`` builds a model's block modules over.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from engine.quant import formats
from engine.quant.mapped import Mapping

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


class Table(Mapping):
    """Where each tensor's bytes are in the mapped GGUF file: ``entries[name] = (ggml_type, torch_shape, start,
    nbytes)``."""

    def __init__(self, path: Path, ends: dict[int, int] | None = None) -> None:
        """``ends``: where a string array whose first string lies at the key ends, as a walk of this file's header
        found it (``gguf_file.string_starts``, keyed by ``GgufInfo.metadata``'s ``"at"``): the walk is not made again (~0.06 s of Llama-3's
        408,451 tokens and merges)."""
        self._ends = ends or {}
        super().__init__(path)
        try:
            self._parse(path.name)
        except struct.error:
            raise ValueError(f"{path.name}: the header is cut short") from None

    def _parse(self, name: str) -> None:
        m, pos = self.map, 8
        n_tensors, n_kv = struct.unpack_from("<QQ", m, pos)
        pos += 16
        align = 32
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vt,) = struct.unpack_from("<I", m, pos)
            if key == "general.alignment" and vt == 4:
                (align,) = struct.unpack_from("<I", m, pos + 4)
            pos = self._skip(vt, pos + 4, 0)
        raw = []
        for _ in range(n_tensors):
            tname, pos = self._string(pos)
            (dims,) = struct.unpack_from("<I", m, pos)
            shape = struct.unpack_from(f"<{dims}Q", m, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            raw.append((tname, ggml_type, tuple(reversed(shape)), offset))
        data = -(-pos // align) * align
        for tname, ggml_type, shape, offset in raw:
            nbytes = formats.file_bytes(ggml_type, shape) if ggml_type in formats.TYPES else -1
            start = data + offset
            if nbytes < 0 or not self.inside(start, nbytes):
                raise ValueError(f"{name}: tensor {tname!r} lies past the end of the file or has an unknown type")
            self.entries[tname] = (ggml_type, shape, start, nbytes)

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self.map, pos)
        if pos + 8 + n > self.size:
            raise struct.error("string past the end")
        return self.map[pos + 8:pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def _skip(self, vt: int, pos: int, depth: int) -> int:
        if vt in _SCALAR:
            return pos + _SCALAR[vt]
        if vt == 8:
            (n,) = struct.unpack_from("<Q", self.map, pos)
            return pos + 8 + n
        if vt == 9 and depth < 2:
            et, count = struct.unpack_from("<IQ", self.map, pos)
            pos += 12
            if et in _SCALAR:
                return pos + count * _SCALAR[et]
            if et == 8 and self._ends.get(pos, self.size + 1) <= self.size:
                return self._ends[pos]
            if et == 8:  # a vocabulary: walked inline (408,451 strings of Llama-3's: a call each took 2x)
                unpack, m = struct.unpack_from, self.map
                for _ in range(count):
                    pos += 8 + unpack("<Q", m, pos)[0]
                if pos > self.size:
                    raise struct.error("array past the end")
                return pos
            for _ in range(count):
                pos = self._skip(et, pos, depth + 1)
                if pos > self.size:
                    raise struct.error("array past the end")
            return pos
        raise struct.error(f"value type {vt}")

    def floats(self, name: str) -> np.ndarray:
        """The tensor dequantized by the gguf package to float32, in torch order (a copy)."""
        import gguf

        t, shape, start, nbytes = self.entries[name]
        raw = np.frombuffer(self.map, dtype=np.uint8, count=nbytes, offset=start)
        return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t)), dtype=np.float32).reshape(shape)
