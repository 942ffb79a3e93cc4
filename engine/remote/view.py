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
from array import array
from dataclasses import dataclass
from typing import Sequence

from engine.remote.wire import MAX_BLOCK_SIZE, MAX_RANKS, Batch, Cleared, Removed, Stored

# the most blocks a view holds, all engines together: a 141 GB GPU holds ~660,000 blocks of 16 tokens of a 0.5B
# model (12 KB of KV per token), 70,000 of an 8B one; 2^20 at ~200 bytes each stays under 250 MB here
MAX_POOL_BLOCKS = 1 << 20
EVICTED_S = 2.0  # a removed block's slot stays drawn as evicted this long (unless a new block takes it)
GONE_MAX = 1 << 16  # removed blocks remembered (why a prompt missed them: ``RemotePool.history``), ~150 B each
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
        self.cleared_at = self.resynced_at = -1.0  # when the server last cleared its cache, the view started over
        self._reset()

    def _reset(self) -> None:
        # ~200 bytes a cached block here (2^20 blocks: ~230 MB): a hash maps to its slot (a list only for a hash
        # held twice), each slot keeps the key its block is found by — hash((parent hash, tokens)), not the
        # tokens themselves — and the key maps back to the hash (a list only when two hashes share it)
        self._held: dict = {}  # hash -> slot, or [slot, slot ...] oldest first (vLLM may hold a hash twice)
        self._named: dict = {}  # name key -> hash, or [hash, hash ...] stored under it, oldest first
        self._slot_hash: list = []  # slot -> hash or None
        self._slot_key = array("q")  # slot -> the name key of the block in it
        self._slot_t = array("d")  # slot -> when its block was stored (monotonic, here)
        self._gone: dict = {}  # hash -> (name key, when it was removed), oldest first, at most GONE_MAX
        self._gone_named: dict = {}  # name key -> the hash last removed under it
        self._free: list[int] = []
        self._evicted: dict[int, float] = {}  # slot -> when its block was removed
        self.held = 0  # blocks cached now (a hash held twice counts twice)

    # -- events -----------------------------------------------------------------------------------------
    def apply(self, batch: Batch, now: float | None = None, room: int = MAX_POOL_BLOCKS) -> int:
        """Apply ``batch``; ``room``: blocks this pool may hold (the view's limit less the other pools' blocks).
        A ``Stored`` that does not fit is left out (no server's pool holds more than ``MAX_POOL_BLOCKS``: its
        events are wrong, or removals were lost). How many events were left out."""
        now = time.monotonic() if now is None else now
        self.last_ts = max(self.last_ts, batch.ts)
        left_out = 0
        for e in batch.events:
            if isinstance(e, Stored):
                if self.held + len(e.hashes) > room:
                    left_out += 1
                    continue
                self._store(e, now)
            elif isinstance(e, Removed):
                for h in e.hashes:
                    self._remove(h, now)
            elif isinstance(e, Cleared):
                self.cleared += 1
                self.cleared_at = now
                self._reset()
        return left_out

    def resync(self, now: float | None = None) -> None:
        """Missing batches that no replay could fill: what the view knew may be wrong, so it starts over."""
        self.resyncs += 1
        self.resynced_at = time.monotonic() if now is None else now
        self._reset()

    def _store(self, e: Stored, now: float) -> None:
        B = e.block_size or self.block_size
        self.block_size = self.block_size or B
        parent = e.parent
        for i, h in enumerate(e.hashes):
            key = _name_key(parent, e.token_ids[i * B:(i + 1) * B])
            cur = self._held.get(h)
            slot = self._take_slot(h, key, now)
            if cur is None:
                self._held[h] = slot
                self._name(h, key)
            else:
                slots = [cur] if isinstance(cur, int) else cur
                if self._slot_key[slots[0]] != key:  # the same hash under another parent or tokens: the newer
                    self._unname(h, self._slot_key[slots[0]])
                    self._name(h, key)
                    for s in slots:
                        self._slot_key[s] = key
                self._held[h] = [*slots, slot]
            self.stored += 1
            self.held += 1
            parent = h

    def _take_slot(self, h, key: int, now: float) -> int:
        while self._free:
            s = heapq.heappop(self._free)
            if self._slot_hash[s] is None:
                self._slot_hash[s], self._slot_key[s], self._slot_t[s] = h, key, now
                self._evicted.pop(s, None)
                return s
        self._slot_hash.append(h)
        self._slot_key.append(key)
        self._slot_t.append(now)
        return len(self._slot_hash) - 1

    def _remove(self, h, now: float) -> None:
        cur = self._held.get(h)
        if cur is None:
            return  # stored before this view joined
        if isinstance(cur, int):
            s = cur
            del self._held[h]
            self._unname(h, self._slot_key[s])
            self._forget(h, self._slot_key[s], now)
        else:
            s = cur.pop()  # the newer copy goes first
            if len(cur) == 1:
                self._held[h] = cur[0]
        self.removed += 1
        self.held -= 1
        self._slot_hash[s] = None
        self._evicted[s] = now
        heapq.heappush(self._free, s)

    def _forget(self, h, key: int, now: float) -> None:
        """``h`` is no longer cached: remembered (the newest ``GONE_MAX``) so a prompt that misses it can say why."""
        self._gone.pop(h, None)
        self._gone[h] = (key, now)
        self._gone_named[key] = h
        if len(self._gone) > GONE_MAX:
            old = next(iter(self._gone))
            k, _ = self._gone.pop(old)
            if self._gone_named.get(k) == old:
                del self._gone_named[k]

    def _name(self, h, key: int) -> None:
        v = self._named.get(key)
        if v is None:
            self._named[key] = h
        elif isinstance(v, list):
            if h not in v:
                v.append(h)
        elif v != h:
            self._named[key] = [v, h]

    def _unname(self, h, key: int) -> None:
        v = self._named.get(key)
        if isinstance(v, list):
            if h in v:
                v.remove(h)
            if len(v) == 1:
                self._named[key] = v[0]
        elif v == h:
            del self._named[key]

    # -- queries ----------------------------------------------------------------------------------------
    def names(self) -> list:
        """Every cached block's hash, once per block (a hash held twice is listed twice)."""
        return [h for h, cur in self._held.items() for _ in range(1 if isinstance(cur, int) else len(cur))]

    def chain_of(self, ids: Sequence[int], hashes: Sequence = ()) -> list:
        """The cached blocks holding ``ids`` from its first token on, full blocks only, up to the first one the
        pool lacks (a block is named by its parent and its tokens, so token ids find it). ``hashes``: the names
        the server gives those blocks, for blocks published without token ids (KV Scope's server, for a keyed
        or salted request: ``engine.kv.paged.tenants.block_hashes``)."""
        B, out, parent = self.block_size, [], None
        if B < 1:
            return out
        for j in range(len(ids) // B):
            found = self._named.get(_name_key(parent, ids[j * B:(j + 1) * B]))
            if found is not None:
                if isinstance(found, list):
                    found = found[-1]  # two hashes for the same tokens: the newer one
            elif j < len(hashes) and hashes[j] in self._held:  # a hash names its whole chain: parent included
                found = hashes[j]
            else:
                break
            out.append(found)
            parent = found
        return out

    def history(self, ids: Sequence[int], hashes: Sequence = ()) -> list[tuple[float, float]]:
        """Per full block of ``ids`` from the first, while the view knows it (held now, or removed and
        remembered): (when the oldest copy held now was stored, or -1: none is held; when the block was last
        removed, or -1: never since the view joined). ``hashes`` as in ``chain_of``."""
        B, out, parent = self.block_size, [], None
        for j in range(len(ids) // B if B > 0 else 0):
            key = _name_key(parent, ids[j * B:(j + 1) * B])
            h = self._named.get(key)
            h = h[-1] if isinstance(h, list) else h
            if h is None:
                h = self._gone_named.get(key)
            if h is None and j < len(hashes) and (hashes[j] in self._held or hashes[j] in self._gone):
                h = hashes[j]
            if h is None:
                break
            cur = self._held.get(h)
            slots = () if cur is None else (cur,) if isinstance(cur, int) else cur
            gone = self._gone.get(h)
            out.append((min((self._slot_t[s] for s in slots), default=-1.0), gone[1] if gone else -1.0))
            parent = h
        return out

    def snapshot(self, chat_ids: Sequence[int] = (), now: float | None = None, hashes: Sequence = ()) -> PoolSnapshot:
        now = time.monotonic() if now is None else now
        chain = self.chain_of(chat_ids, hashes) if chat_ids else []
        n = max(self.num_blocks, len(self._slot_hash))
        slots = [SLOT_FREE] * n
        for s, h in enumerate(self._slot_hash):
            if h is not None:
                slots[s] = SLOT_OTHER
        for h in chain:  # a hash held twice: the chat reads the newer copy; the older one waits to be evicted
            cur = self._held[h]
            slots[cur if isinstance(cur, int) else cur[-1]] = SLOT_CHAT
        for s, t in list(self._evicted.items()):
            if now - t > EVICTED_S:
                del self._evicted[s]
            elif self._slot_hash[s] is None:
                slots[s] = SLOT_EVICTED
        return PoolSnapshot(self.rank, self.block_size, self.num_blocks, tuple(slots), self.held, len(chain),
                            self.stored, self.removed, self.cleared, self.gaps, self.resyncs, self.last_ts)


def _name_key(parent, tokens: Sequence[int]) -> int:
    """What a block is found by: its parent's hash and its tokens, hashed (64 bits: two different blocks of one
    pool share a key once in ~2^32 blocks; a server that made them collide on purpose only mislabels its own)."""
    return hash((parent, tuple(tokens)))


def view_note(snaps: list[PoolSnapshot], malformed: int = 0, problem: str = "") -> str:
    """What the view cannot show, in words ("" when nothing is missing); ``malformed``: events left out
    (``RemoteView.malformed``), ``problem`` the first one's reason."""
    notes = []
    missed = sum(s.gaps for s in snaps)
    if any(s.resyncs for s in snaps):
        notes.append(f"{missed} event batches were missed (published before this view joined, or dropped) and the "
                     "server keeps no replay buffer: the view started over, so blocks cached before are drawn once "
                     "they are used again")
    elif missed:
        notes.append(f"{missed} missed event batches were replayed from the server's buffer")
    if malformed:
        notes.append(malformed_text(malformed, problem))
    return "; ".join(notes)


def malformed_text(malformed: int, problem: str = "") -> str:
    first = f" (first: {problem})" if problem else ""
    return f"{malformed:,} malformed event{'s' if malformed != 1 else ''} skipped{first}"


class ViewLimit(ValueError):
    """A pool shape past what a view follows (one line: the value, the limit)."""


def check_shape(block_size: int, num_blocks: int, engines: int = 1) -> None:
    """``ViewLimit`` for a pool no server has: the view would draw (and hold) it all."""
    if not 0 <= num_blocks <= MAX_POOL_BLOCKS:
        raise ViewLimit(f"the server says its KV cache has {num_blocks:,} blocks: more than the "
                        f"{MAX_POOL_BLOCKS:,} a remote view follows (a 141 GB GPU holds ~660,000 of a 0.5B model)")
    if not 0 <= block_size <= MAX_BLOCK_SIZE:
        raise ViewLimit(f"the server says its blocks hold {block_size:,} tokens: more than {MAX_BLOCK_SIZE:,}")
    if not 0 <= engines <= MAX_RANKS:
        raise ViewLimit(f"the server reports {engines:,} engines (data-parallel ranks): more than the {MAX_RANKS} "
                        "a remote view follows")


class RemoteView:
    """Every engine's pool (one per data-parallel rank), safe to feed from one thread and read from another.
    ``malformed``: events (or whole batches) left out because they were not what vLLM sends; ``problem``: the
    first one's reason."""

    def __init__(self, block_size: int = 0, num_blocks: int = 0, engines: int = 1) -> None:
        check_shape(block_size, num_blocks, engines)
        self.block_size, self.num_blocks = block_size, num_blocks // max(1, engines)
        self.pools: dict[int, RemotePool] = {}
        self.lock = threading.Lock()
        self.batches = 0
        self.malformed = 0
        self.problem = ""
        self.latencies: list[float] = []  # seconds from a batch's server time to its arrival here (last 4096)
        self.on_change = None  # called (subscriber thread) after each batch: the window redraws soon after
        self.names = None  # ``names(ids, block_size)``: the hashes a server gives a chat's blocks (``chain_of``)

    def pool(self, rank: int) -> RemotePool:
        p = self.pools.get(rank)
        if p is None:
            if not 0 <= rank < MAX_RANKS:  # the wire refuses such ranks already: a pool per number would grow
                raise ViewLimit(f"engine rank {rank} is not 0 to {MAX_RANKS - 1}")
            p = self.pools[rank] = RemotePool(rank, self.block_size, self.num_blocks)
        return p

    def apply(self, batch: Batch, live: bool = True) -> None:
        """Apply one batch; ``live``: it came as published (its delay counts), not replayed later."""
        now = time.time()
        with self.lock:
            pool = self.pool(batch.rank)
            room = MAX_POOL_BLOCKS - sum(p.held for p in self.pools.values() if p is not pool)
            left_out = pool.apply(batch, room=room)
            if batch.skipped:
                self._skip(batch.skipped, batch.problem)
            if left_out:
                self._skip(left_out, f"BlockStored past {MAX_POOL_BLOCKS:,} cached blocks (no server's pool is "
                                     "that large: removals were lost or the events are wrong)")
            self.batches += 1
            if live:
                self.latencies.append(max(0.0, now - batch.ts))
                del self.latencies[:-4096]
        if self.on_change is not None and batch.events:
            self.on_change()

    def skip(self, n: int, problem: str) -> None:
        """``n`` events (or a batch) were not what vLLM sends and were left out."""
        with self.lock:
            self._skip(n, problem)

    def _skip(self, n: int, problem: str) -> None:
        self.malformed += n
        self.problem = self.problem or problem

    def gap(self, rank: int, missing: int, replayed: bool) -> None:
        with self.lock:
            p = self.pool(rank)
            p.gaps += missing
            if not replayed:
                p.resync()

    def set_shape(self, block_size: int, num_blocks: int, engines: int = 1) -> None:
        """The pool's size from ``vllm:cache_config_info`` (the events only carry the block size): ``num_blocks``
        of all ``engines`` together, split evenly (vLLM's data-parallel engines have one size). ``ViewLimit``
        for a size no server has (the view keeps the one it had)."""
        check_shape(block_size, num_blocks, engines)
        with self.lock:
            self.block_size = block_size or self.block_size
            self.num_blocks = num_blocks // max(1, engines) or self.num_blocks
            for p in self.pools.values():
                p.block_size, p.num_blocks = p.block_size or self.block_size, self.num_blocks

    def snapshots(self, chat_ids: Sequence[int] = ()) -> list[PoolSnapshot]:
        with self.lock:
            if not self.pools:
                self.pool(0)
            named = {}  # block size -> the chat's hashes (every pool of a server has one block size)
            for p in self.pools.values():
                if self.names is not None and chat_ids and p.block_size not in named:
                    named[p.block_size] = self.names(chat_ids, p.block_size)
            return [self.pools[r].snapshot(chat_ids, hashes=named.get(self.pools[r].block_size, ()))
                    for r in sorted(self.pools)]

    def history(self, ids: Sequence[int]) -> tuple[list[tuple[float, float]], float, float]:
        """``RemotePool.history`` of ``ids`` in the pool that knows most of them (a request runs on one engine),
        with when that pool's server last cleared its cache and when the view last started over (-1: never)."""
        with self.lock:
            best, pool = [], None
            for p in self.pools.values():
                named = self.names(ids, p.block_size) if self.names is not None and ids else ()
                h = p.history(ids, named)
                if pool is None or len(h) > len(best):
                    best, pool = h, p
            return best, (pool.cleared_at if pool else -1.0), (pool.resynced_at if pool else -1.0)

    def chat_blocks(self, chat_ids: Sequence[int]) -> int:
        return sum(s.chat_blocks for s in self.snapshots(chat_ids))
