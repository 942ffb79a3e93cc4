"""A weights file mapped once, and where each tensor's bytes lie in the mapping: what a GGUF file
(``engine.quant.gguf_table.Table``) and a folder's safetensors files (``engine.model.folder_keep``) share. A
tensor kept as the file stores it is a view of the mapping (``blocks``: no copy); its pages count in the process's
RSS as the products first read them (as llama.cpp's mmap does), and go again once a packed copy replaces them
(``release``).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch


class Mapping:
    """A file mapped privately (never written back); ``entries[name] = (ggml_type, torch_shape, start, nbytes)``,
    filled by the format's own parser, each checked to lie inside the mapping (``inside``)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never written back
        self.size = len(self.map)
        self.entries: dict[str, tuple[int, tuple[int, ...], int, int]] = {}
        self._at: dict[int, str] | None = None

    def inside(self, start: int, nbytes: int) -> bool:
        """Do a tensor's declared bytes lie inside the mapping?"""
        return 0 <= start and 0 <= nbytes and start + nbytes <= self.size

    def base(self) -> int:
        """The mapping's address (a tensor view's ``data_ptr() - base()`` is its offset in the file)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()

    def name_at(self, address: int) -> str | None:
        """The tensor whose bytes start at ``address`` (a view's ``data_ptr()``), or None: not one of this file's."""
        if self._at is None:
            self._at = {e[2]: n for n, e in self.entries.items()}
        return self._at.get(address - self.base())

    def release(self, name: str) -> None:
        """Let the process's pages of a tensor's bytes go (``madvise(MADV_DONTNEED)`` on the whole pages inside it:
        a neighbour's bytes on a shared page stay): its bytes were copied elsewhere. The mapping is private and
        never written, so reading the tensor again reads the file again."""
        if not hasattr(self.map, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        _, _, start, nbytes = self.entries[name]
        a, e = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if e > a:
            self.map.madvise(mmap.MADV_DONTNEED, a, e - a)

    def map_pages(self, names: list[str]) -> None:
        """Map the process's pages of these tensors now (``MADV_POPULATE_READ``, Linux 5.14+; elsewhere nothing):
        weights multiplied in place from the file, whose pages a first product would otherwise fault in 4 KiB at
        a time (a BF16 1B model: 2 GiB of them in its first token)."""
        if not hasattr(self.map, "madvise"):
            return
        for name in names:
            _, _, start, nbytes = self.entries[name]
            a = start // mmap.PAGESIZE * mmap.PAGESIZE
            try:
                self.map.madvise(getattr(mmap, "MADV_POPULATE_READ", 22), a, start + nbytes - a)
            except OSError:  # an older kernel: the products fault the pages in
                return

    def blocks(self, name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [rows, row_bytes], a view of the mapping (no copy)."""
        _, shape, start, nbytes = self.entries[name]
        rows = 1
        for d in shape[:-1]:
            rows *= d
        flat = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=start)
        return flat.view(rows, nbytes // max(rows, 1))  # [rows, row_bytes]
