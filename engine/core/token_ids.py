"""One Python int per token id, shared by every list that holds it.

A sampled id comes out of ``int(tensor)`` as a new 32-byte int object each time (CPython caches only
-5..256), and a conversation's id lists keep every one of them: over a 120k-token StreamingLLM reply that
was ~32 B per token of the ~70 B/token the process grew while the KV cache stayed at 327,680 B. Interned
here, the objects are bounded by the vocabulary (the ids actually seen), and each list entry costs only its
8-byte slot.
"""

from __future__ import annotations

_IDS: dict[int, int] = {}


def interned(token: int) -> int:
    """``token`` as the one int object this process uses for that id."""
    return _IDS.setdefault(token, token)
