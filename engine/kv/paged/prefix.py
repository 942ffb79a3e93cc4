"""Automatic prefix caching across sessions: the hash chain that names a full page by the tokens before it.

Page ``j`` of a sequence (tokens ``[j*P, (j+1)*P)``) is named by ``h_j = H(h_{j-1}, tokens of page j)``
with ``h_{-1}`` a fixed root, so equal names mean equal tokens at equal positions from the start (vLLM v1's
block hashes). ``H`` is SHA-256 over the parent's digest and the page's ids as little-endian int64: two
different prefixes never share a name in practice, and the name does not depend on Python's hash seed.

The names live in the ``PagePool`` of one ``PageArena`` (one model, page size, K/V precision and layer
group), so pages never travel between cache settings or models. Which sessions may register and take pages
(lossless settings only) is ``ChatSession``'s decision (``engine.core.session``).

A chain may start from a salted root (``salted_root``): pages named from different roots never match, so one
tenant of the server cannot find (and time or count) another tenant's pages — vLLM's ``cache_salt``.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

ROOT = b"kvscope-prefix-v1"


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full page: its parent's name and its token ids."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def salted_root(salt: bytes) -> bytes:
    """The root of the chains of one tenant (``salt``: its identity; empty: the shared root)."""
    return hashlib.sha256(ROOT + b"\0" + salt).digest() if salt else ROOT


def extend_chain(chain: list[bytes], ids: Sequence[int], page_size: int, pages: int, root: bytes = ROOT) -> list[bytes]:
    """Extend ``chain`` (the names of pages ``0 .. len(chain)-1`` of ``ids``, from ``root``) in place to ``pages``
    names (at most the full pages of ``ids``); returns it."""
    pages = min(pages, len(ids) // page_size)
    P = page_size
    for j in range(len(chain), pages):
        chain.append(page_hash(chain[-1] if chain else root, ids[j * P:(j + 1) * P]))
    return chain


def cached_run(pool, chain: Sequence[bytes], start: int) -> list[int]:
    """The pages named ``chain[start], chain[start+1], ...`` in ``pool``, up to the first name it lacks."""
    out = []
    for digest in chain[start:]:
        page = pool.lookup(digest)
        if page is None:
            break
        out.append(page)
    return out
