"""Who may share prefix-cache pages on the server, and the block hashes their pages are published under.

A tenant is an (API key, ``cache_salt``) pair (vLLM's field): its pages are named from a chain root of its own
(``engine.kv.paged.prefix.salted_root`` of ``tenant_of``), so one tenant's request never finds another's pages. The
KV events publish the first 8 bytes of each name (``block_hash``); a subscriber that knows the key and salt can
compute them for its own tokens (``block_hashes``: the remote view finds "this chat"'s blocks that way), one that
does not cannot test a guessed text against them: the root is SHA-256 over the key, so a guess costs a guess of
the key too. Light (hashlib and numpy): the remote view imports it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

from engine.kv.paged.prefix import extend_chain, salted_root


def tenant_of(key: str | None, cache_salt: str | None) -> bytes:
    """Who may share prefix caches: requests with the same API key and the same ``cache_salt``. A digest, so
    neither is kept in memory; never empty, so the API's pages are apart from the app's chats."""
    return hashlib.sha256(json.dumps(["kvscope-tenant", key or "", cache_salt or ""]).encode()).digest()


def block_hash(digest: bytes | None) -> int | None:
    """A page name as the events carry it: its first 8 bytes as an unsigned int (vLLM's default, 64-bit ints;
    a collision inside one pool needs ~2^32 pages)."""
    return None if digest is None else int.from_bytes(digest[:8], "big")


def block_hashes(ids: Sequence[int], page_size: int, key: str | None = None,
                 cache_salt: str | None = None) -> list[int]:
    """The hashes KV Scope's server publishes for the full pages of ``ids`` sent with ``key`` and ``cache_salt``."""
    if page_size < 1:
        return []
    chain = extend_chain([], list(ids), page_size, len(ids) // page_size, salted_root(tenant_of(key, cache_salt)))
    return [block_hash(d) for d in chain]
