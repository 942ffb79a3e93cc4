"""The ids the server fed through each reply, so a follow-up that sends the reply back reuses it.

An OpenAI client sends the whole conversation every time, the reply it got as an assistant message's text. The
chat template renders that text again and the tokenizer reads it afresh, which seldom gives the ids the model
generated (it wrote " cat" as "▁c" "at"; the tokenizer reads "▁cat"): the new prompt then leaves the cached ids at
the reply's first such token, and the rest of the conversation is computed again. So at each reply's end the
engine thread keeps (``ReplyIds.put``) the ids the conversation's cache was fed through that reply, under a
hash of (tenant, the reply's text); the render thread (``engine.server.prompts``) looks the request's assistant
messages up (``ReplyIds.find``) and splices those ids into the freshly rendered prompt wherever they spell the
same text (``engine.model.splice``), before the session pool looks for the conversation.

Bounded: per tenant ``entries`` replies and ``tokens`` ids (least recently used dropped first), ``tenants``
tenants and ``total`` ids over all (a ``cache_salt`` is the client's choice, so tenants are not few). A tenant
only ever finds its own replies: the tenant is part of the key and of the map it is stored in. One lock: the
engine thread writes, the render threads read.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np


def reply_key(tenant: bytes, text: str) -> bytes:
    """The map's key of a reply ``text`` of ``tenant`` (a digest: the text itself is not kept)."""
    return hashlib.sha256(b"kvscope-reply\0" + tenant + b"\0" + text.encode("utf-8", "surrogatepass")).digest()


class ReplyIds:
    """(tenant, reply text) -> the ids a conversation's cache was fed up to that reply's end, least recently used
    dropped first. Thread-safe."""

    def __init__(self, entries: int = 256, tokens: int = 1 << 20, tenants: int = 1024, total: int = 1 << 23) -> None:
        self.entries, self.tokens, self.tenants, self.total = entries, tokens, tenants, total
        self._lock = threading.Lock()
        # tenant -> (key -> ids as int32), both least recently used first
        self._maps: OrderedDict[bytes, OrderedDict[bytes, np.ndarray]] = OrderedDict()
        self._held: dict[bytes, int] = {}  # ids kept per tenant
        self._all = 0  # ids kept over all tenants

    def __len__(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._maps.values())

    @property
    def held(self) -> int:
        """Ids kept over all tenants."""
        return self._all

    def put(self, tenant: bytes, text: str, ids: Sequence[int]) -> None:
        """Keep ``ids`` (fed through the reply ``text``) for ``tenant``: nothing for an empty reply or ids longer
        than a tenant may keep."""
        if not text or not ids or len(ids) > min(self.tokens, self.total):
            return
        arr = np.asarray(ids, dtype=np.int32)
        key = reply_key(tenant, text)
        with self._lock:
            m = self._maps.get(tenant)
            if m is None:
                m = self._maps[tenant] = OrderedDict()
                self._held[tenant] = 0
            self._maps.move_to_end(tenant)
            old = m.pop(key, None)
            if old is not None:
                self._count(tenant, -len(old))
            m[key] = arr
            self._count(tenant, len(arr))
            self._trim(tenant)

    def find(self, tenant: bytes, text: str) -> list[int] | None:
        """The ids kept for ``tenant``'s reply ``text`` (marked recently used), or None."""
        key = reply_key(tenant, text)
        with self._lock:
            m = self._maps.get(tenant)
            arr = m.get(key) if m is not None else None
            if arr is None:
                return None
            m.move_to_end(key)
            self._maps.move_to_end(tenant)
            return arr.tolist()

    def _count(self, tenant: bytes, n: int) -> None:
        self._held[tenant] += n
        self._all += n

    def _trim(self, tenant: bytes) -> None:
        """Lock held: drop ``tenant``'s oldest replies past its bounds, then the oldest tenants' past the total."""
        m = self._maps[tenant]
        while m and (len(m) > self.entries or self._held[tenant] > self.tokens):
            self._count(tenant, -len(m.popitem(last=False)[1]))
        while self._maps and (len(self._maps) > self.tenants or self._all > self.total):
            oldest = next(iter(self._maps))
            om = self._maps[oldest]
            if om:
                self._count(oldest, -len(om.popitem(last=False)[1]))
            if not om:
                del self._maps[oldest]
                self._all -= self._held.pop(oldest)
