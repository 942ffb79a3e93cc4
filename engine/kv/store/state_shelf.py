"""The recurrent states of a hybrid model at named page boundaries: what the prefix cache needs, beside the pages,
to let another chat (or a request of the server) go on from a shared prefix of a model with recurrent /
linear-attention / convolution layers.

Full-attention pages are named by the tokens before them (``engine.kv.paged.prefix``) and a sliding group's pages by
the same names in its own pool; a recurrent layer's state at token ``p`` has no page, so it is kept here under the
name of the page that ends at ``p`` (``(page_size, name)``: a name depends on the page size). One shelf per loaded
model (``ArenaRegistry.states``), least recently used first out, within ``limit_bytes`` and ``limit_count``: a
LFM2-350M state is 0.1 MiB, so the defaults keep 64 of them; a large linear-attention model's (tens of MiB each)
fills the byte budget first and keeps fewer. A salted chain (a server tenant's own root) gives names no other
tenant can find.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_BYTES = 256 << 20  # a share of the KV budget small enough to never crowd out pages on a 16 GiB machine
DEFAULT_COUNT = 64


class StateShelf:
    """States snapshots (``StateLayers.snapshot``) by (page size, page name). Engine thread only."""

    def __init__(self, limit_bytes: int = DEFAULT_BYTES, limit_count: int = DEFAULT_COUNT) -> None:
        self.limit_bytes, self.limit_count = int(limit_bytes), int(limit_count)
        self._items: OrderedDict[tuple[int, bytes], tuple[dict, int]] = OrderedDict()
        self.nbytes = 0
        self.dropped = 0  # snapshots pushed out by the budget

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: tuple[int, bytes]) -> bool:
        return key in self._items

    def get(self, page_size: int, name: bytes) -> dict | None:
        """The snapshot kept under ``name``, now the most recently used; None if there is none."""
        item = self._items.get((page_size, name))
        if item is None:
            return None
        self._items.move_to_end((page_size, name))
        return item[0]

    def put(self, page_size: int, name: bytes, saved: dict, nbytes: int) -> bool:
        """Keep ``saved`` (``nbytes``) under ``name``; False when it is larger than the whole budget."""
        key = (page_size, name)
        if key in self._items:
            self._items.move_to_end(key)
            return True
        if nbytes > self.limit_bytes or self.limit_count <= 0:
            return False
        self._items[key] = (saved, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.limit_bytes or len(self._items) > self.limit_count:
            _, (_, gone) = self._items.popitem(last=False)
            self.nbytes -= gone
            self.dropped += 1
        return True

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
