"""The cache of one group of sliding-window layers (Gemma 2/3, gpt-oss, Mistral's SWA, Cohere 2, ...).

A query at position ``p`` of such a layer attends to keys ``p - window + 1 .. p`` only, so before a forward the
layer needs just the last ``window - 1`` tokens. ``WindowKV`` keeps them in pages of its own arena (every
sliding layer of the same window, K and V) and gives back each page once all of its tokens have left the
window: the group holds between ``window - 1`` and ``window - 1 + page_size - 1`` tokens whatever the
conversation's length, while full-attention layers grow. Tokens of a partly expired first page stay in it and
are masked out by the model's own sliding-window mask: ``mask_sizes`` tells transformers the logical position
of the first held token (``base``), exactly as its ``DynamicSlidingWindowLayer`` does.

Positions here are logical (the conversation's), which is why policies that re-rotate keys to in-cache
positions (StreamingLLM, the overflow modes) are refused for models with sliding layers.
"""

from __future__ import annotations

from engine.kv.store.arena import PageArena
from engine.kv.store.storage import HostKV, PagedKV


class WindowKV:
    def __init__(self, arena: PageArena, window: int, session_id: int = -1, inner: PagedKV | None = None,
                 base: int = 0) -> None:
        self.inner = inner if inner is not None else PagedKV(arena, session_id)
        self.arena = arena
        self.window = window
        self.base = base  # logical position of the inner store's first token (a multiple of page_size)

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def end(self) -> int:
        """Logical tokens fed so far (held or expired)."""
        return self.base + self.inner.num_tokens

    @property
    def held(self) -> int:
        return self.inner.num_tokens

    def held_range(self) -> tuple[int, int]:
        """Logical positions ``[start, end)`` some query of this group can still see."""
        return max(self.base, self.end - self.window + 1), self.end

    def seq_length(self) -> int:
        """Logical tokens before the running forward (transformers' query offset for the mask)."""
        return self.base + self.inner.past_len

    def mask_sizes(self, q: int) -> tuple[int, int]:
        """(keys the forward sees, logical position of the first): held before it + q, from ``base``."""
        return self.inner.past_len + q, self.base

    def reusable(self, k: int) -> int:
        """The longest prefix ``<= k`` this group can be cut back to: the window before position ``k`` must
        still be held (``k - window + 1 >= base``), else nothing (the prompt is prefilled again)."""
        if k > self.end:
            k = self.end
        return k if self.base == 0 or k - self.window + 1 >= self.base else 0

    # -- the forward protocol ------------------------------------------------------------------------------
    def can_reserve(self, q: int) -> bool:
        return self.inner.can_reserve(q)

    def reserve(self, q: int, owner: int = -1) -> None:
        self.inner.reserve(q, owner)

    def update(self, layer: int, k, v):
        return self.inner.update(layer, k, v)

    def commit(self) -> None:
        self.inner.commit()
        self.slide()

    def rollback(self) -> None:
        self.inner.rollback()

    def slide(self) -> None:
        """Give back whole pages whose tokens no future query can see (before ``end - window + 1``)."""
        P = self.arena.page_size
        expired = (self.end - self.window + 1 - self.base) // P
        if expired > 0:
            dropped = self.inner.table.drop_front(expired)
            self.base += len(dropped) * P
            self.inner.commit()  # past_len follows the table

    # -- checkpoints (``engine.kv.store.checkpoints``) ----------------------------------------------------------
    def keep(self) -> "WindowKV":
        """What a later reuse needs of this group to go back to ``end``: a group sharing the pages of the window
        before it (ref + 1 each, so they outlive this group's sliding). Costs no copy; its pages cost memory
        once this group has given them back."""
        kept = self.fork(self.inner.table.session_id)
        kept.slide()
        return kept

    def go_back(self, kept: "WindowKV") -> None:
        """Hold what ``kept`` (a ``keep()``) holds instead of what this group holds: its end is ours now."""
        self.inner.free()
        self.inner = kept.inner.fork(self.inner.table.session_id)
        self.base = kept.base

    def pages(self) -> set[int]:
        return set(self.inner.table.pages)

    # -- table changes ---------------------------------------------------------------------------------
    def truncate(self, k: int) -> None:
        """Keep logical ``[0, k)`` (``reusable(k) == k``, or 0)."""
        if k == 0:
            self.inner.truncate(0)
            self.base = 0
            return
        if k < self.base or self.reusable(k) != k:
            raise ValueError(f"window: cannot cut back to {k} (held from {self.base})")
        self.inner.truncate(k - self.base)

    def free(self) -> None:
        self.inner.free()
        self.base = 0

    def fork(self, session_id: int = -1) -> "WindowKV":
        return WindowKV(self.arena, self.window, session_id, self.inner.fork(session_id), self.base)

    def to_host(self, pin: bool = False) -> tuple[int, HostKV]:
        return self.base, self.inner.to_host(pin)

    def can_restore(self, host: tuple[int, HostKV]) -> bool:
        return self.inner.can_restore(host[1])

    def from_host(self, host: tuple[int, HostKV]) -> None:
        self.inner.from_host(host[1])
        self.base = host[0]

    def bytes_held(self) -> int:
        """Bytes of one layer of the group."""
        return self.inner.bytes_per_layer()[0] if self.inner.num_layers else 0
