"""A remote engine's block pool as its KV events tell it: which full blocks are cached, which are this chat's,
which were just evicted. Plain ints and dicts; one lock, because the subscriber thread applies batches while the
window's thread takes snapshots.

vLLM does not publish block ids, only hashes: a stored block is drawn in the lowest free slot of a grid of
``num_blocks`` (``vllm:cache_config_info``), so the map shows how full the pool is and whose blocks fill it, not
where they sit in the server's memory. Blocks being written (not yet full) are never in events: occupancy from
``vllm:kv_cache_usage_perc`` counts them.
"""

from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from engine.remote.wire import Batch, Cleared, Removed, Stored

EVICTED_S = 2.0  # a removed block's slot stays drawn as evicted this long (unless a new block takes it)
SLOT_FREE, SLOT_CHAT, SLOT_OTHER, SLOT_EVICTED = 0, 1, 2, 3


@dataclass(frozen=True)
class PoolSnapshot:
    """One engine's pool at one moment (``RemotePool.snapshot``)."""
    rank: int
    block_size: int
    num_blocks: int
    slots: tuple[int, ...]  # SLOT_* per slot
    cached_blocks: int  # full blocks the events say are cached now
    chat_blocks: int  # of them, the chat's (its token ids matched block by block from the first)
    stored: int
    removed: int
    cleared: int
    gaps: int  # batches missing by sequence number (replayed or not)
    resyncs: int  # times the view started over because missing batches could not be replayed
    last_ts: float  # the newest batch's server time (0: none yet)


class RemotePool:
    """The blocks of one engine (one data-parallel rank)."""

    def __init__(self, rank: int = 0, block_size: int = 0, num_blocks: int = 0) -> None:
        self.rank, self.block_size, self.num_blocks = rank, block_size, num_blocks
        self.stored = self.removed = self.cleared = self.gaps = self.resyncs = 0
        self.last_ts = 0.0
        self._reset()

    def _reset(self) -> None:
        self._slots_of: dict = {}  # hash -> slots holding a block with it (vLLM may hold a hash twice)
        self._meta: dict = {}  # hash -> (parent hash, token ids)
        self._children: dict = {}  # parent hash (None: chain start) -> {child hash: None}, in store order
        self._slot_hash: list = []  # slot -> hash or None
        self._free: list[int] = []
        self._evicted: dict[int, float] = {}  # slot -> when its block was removed

    # -- events -----------------------------------------------------------------------------------------
    def apply(self, batch: Batch, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_ts = max(self.last_ts, batch.ts)
        for e in batch.events:
            if isinstance(e, Stored):
                self._store(e)
            elif isinstance(e, Removed):
                for h in e.hashes:
                    self._remove(h, now)
            elif isinstance(e, Cleared):
                self.cleared += 1
                self._reset()

    def resync(self) -> None:
        """Missing batches that no replay could fill: what the view knew may be wrong, so it starts over."""
        self.resyncs += 1
        self._reset()

    def _store(self, e: Stored) -> None:
        B = e.block_size or self.block_size
        self.block_size = self.block_size or B
        parent = e.parent
        for i, h in enumerate(e.hashes):
            tokens = tuple(e.token_ids[i * B:(i + 1) * B])
            self._meta[h] = (parent, tokens)
            self._children.setdefault(parent, {})[h] = None
            self._slots_of.setdefault(h, []).append(self._take_slot(h))
            self.stored += 1
            parent = h

    def _take_slot(self, h) -> int:
        while self._free:
            s = heapq.heappop(self._free)
            if self._slot_hash[s] is None:
                self._slot_hash[s] = h
                self._evicted.pop(s, None)
                return s
        self._slot_hash.append(h)
        return len(self._slot_hash) - 1

    def _remove(self, h, now: float) -> None:
        slots = self._slots_of.get(h)
        if not slots:
            return  # stored before this view joined
        s = slots.pop()
        self.removed += 1
        self._slot_hash[s] = None
        self._evicted[s] = now
        heapq.heappush(self._free, s)
        if not slots:
            del self._slots_of[h]
            parent, _ = self._meta.pop(h)
            kids = self._children.get(parent)
            if kids is not None:
                kids.pop(h, None)
                if not kids:
                    del self._children[parent]

    # -- queries ----------------------------------------------------------------------------------------
    def names(self) -> list:
        """Every cached block's hash, once per block (a hash held twice is listed twice)."""
        return [h for h, slots in self._slots_of.items() for _ in slots]

    def chain_of(self, ids: Sequence[int]) -> list:
        """The cached blocks holding ``ids`` from its first token on, full blocks only, up to the first one the
        pool lacks (a block is named by its parent and its tokens, so token ids find it)."""
        B, out, parent = self.block_size, [], None
        if B < 1:
            return out
        for j in range(len(ids) // B):
            want = tuple(ids[j * B:(j + 1) * B])
            found = next((h for h in reversed(self._children.get(parent, {})) if self._meta[h][1] == want), None)
            if found is None:
                break
            out.append(found)
            parent = found
        return out

    def snapshot(self, chat_ids: Sequence[int] = (), now: float | None = None) -> PoolSnapshot:
        now = time.monotonic() if now is None else now
        chain = self.chain_of(chat_ids) if chat_ids else []
        n = max(self.num_blocks, len(self._slot_hash))
        slots = [SLOT_FREE] * n
        for s, h in enumerate(self._slot_hash):
            if h is not None:
                slots[s] = SLOT_OTHER
        for h in chain:  # a hash held twice: the chat reads the newer copy; the older one waits to be evicted
            slots[self._slots_of[h][-1]] = SLOT_CHAT
        for s, t in list(self._evicted.items()):
            if now - t > EVICTED_S:
                del self._evicted[s]
            elif self._slot_hash[s] is None:
                slots[s] = SLOT_EVICTED
        return PoolSnapshot(self.rank, self.block_size, self.num_blocks, tuple(slots),
                            sum(len(v) for v in self._slots_of.values()), len(chain), self.stored, self.removed,
                            self.cleared, self.gaps, self.resyncs, self.last_ts)


def view_note(snaps: list[PoolSnapshot]) -> str:
    """What the view cannot show, in words ("" when nothing is missing)."""
    missed = sum(s.gaps for s in snaps)
    if any(s.resyncs for s in snaps):
        return (f"{missed} event batches were missed (published before this view joined, or dropped) and the server "
                "keeps no replay buffer: the view started over, so blocks cached before are drawn once they are "
                "used again")
    if missed:
        return f"{missed} missed event batches were replayed from the server's buffer"
    return ""


class RemoteView:
    """Every engine's pool (one per data-parallel rank), safe to feed from one thread and read from another."""

    def __init__(self, block_size: int = 0, num_blocks: int = 0) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.pools: dict[int, RemotePool] = {}
        self.lock = threading.Lock()
        self.batches = 0
        self.latencies: list[float] = []  # seconds from a batch's server time to its arrival here (last 4096)
        self.on_change = None  # called (subscriber thread) after each batch: the window redraws soon after

    def pool(self, rank: int) -> RemotePool:
        p = self.pools.get(rank)
        if p is None:
            p = self.pools[rank] = RemotePool(rank, self.block_size, self.num_blocks)
        return p

    def apply(self, batch: Batch, live: bool = True) -> None:
        """Apply one batch; ``live``: it came as published (its delay counts), not replayed later."""
        now = time.time()
        with self.lock:
            self.pool(batch.rank).apply(batch)
            self.batches += 1
            if live:
                self.latencies.append(max(0.0, now - batch.ts))
                del self.latencies[:-4096]
        if self.on_change is not None and batch.events:
            self.on_change()

    def gap(self, rank: int, missing: int, replayed: bool) -> None:
        with self.lock:
            p = self.pool(rank)
            p.gaps += missing
            if not replayed:
                p.resync()

    def set_shape(self, block_size: int, num_blocks: int) -> None:
        """The pool's size from ``vllm:cache_config_info`` (the events only carry the block size)."""
        with self.lock:
            self.block_size, self.num_blocks = block_size or self.block_size, num_blocks or self.num_blocks
            for p in self.pools.values():
                p.block_size, p.num_blocks = p.block_size or self.block_size, self.num_blocks

    def snapshots(self, chat_ids: Sequence[int] = ()) -> list[PoolSnapshot]:
        with self.lock:
            if not self.pools:
                self.pool(0)
            return [self.pools[r].snapshot(chat_ids) for r in sorted(self.pools)]

    def chat_blocks(self, chat_ids: Sequence[int]) -> int:
        return sum(s.chat_blocks for s in self.snapshots(chat_ids))
