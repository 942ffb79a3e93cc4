"""``PrefixReuse``: the part of ``SeqCache`` (``engine.core.seq_cache``) that reuses what is cached — the prefix
cache's names of its full pages, a new prompt's common prefix, pages taken from the prefix cache or restored
from the disk tier, and a stream that goes on after an eviction. A mixin, not an object of its own: the state
it writes is the sequence cache's, whose one writer it stays.
"""

from __future__ import annotations

from typing import Sequence

import dataclasses

from engine.core import reprefill
from engine.core.account import Facts, account, token_change
from engine.core.records import ReuseRecord
from engine.core.vocab import Note, NoteKind
from engine.kv.paged.prefix import cached_run, extend_chain
from engine.snapshot import MissReason
from engine.kv.store.grouped import GroupedKV
from engine.kv.store.storage import PagedKV

SHARE_EVERY = 256  # tokens between the states a long prefill keeps on the shelf: ~0.1 MiB each on LFM2-350M


def share_every(page_size: int) -> int:
    """``SHARE_EVERY`` rounded up to whole pages."""
    return -(-SHARE_EVERY // page_size) * page_size


class PrefixReuse:
    """Reuse for a ``SeqCache`` (its store, index, chain, root, host, policy, config and evictor)."""

    # -- the prefix cache --------------------------------------------------------------------------------
    @property
    def disk(self):
        """The model's KV disk tier (``engine.kv.tier.disk``), or None."""
        return getattr(getattr(self.lm, "arenas", None), "disk", None)

    def disk_writer_notes(self) -> tuple[str, ...]:
        """What the disk tier's writer found since it was last asked (a full disk)."""
        disk = self.disk
        return tuple(disk.take_notes()) if disk is not None else ()

    def fed_ids(self, ids: Sequence[int]) -> list[int]:
        """The ids of ``ids`` (the conversation) this cache was fed, in order."""
        return list(ids[:self.index.next_pos]) if self.store is not None else []

    def disk_notes(self) -> list[str]:
        """What the disk tier has to tell: the last reuse's restore (against what computing those tokens again takes
        at this model's measured prefill rate), files dropped, writes stopped."""
        r = self.reused
        if self.disk is None:
            return []
        notes = self.disk.take_notes()
        if r.disk_tokens:
            again = reprefill.estimate_ms(self.lm, r.disk_tokens, False)
            than = "faster than" if r.disk_ms <= again else "slower than"
            notes.insert(0, Note(f"restored {r.disk_tokens:,} tokens from disk in {r.disk_ms:.0f} ms ({than} the "
                                 f"~{again:.0f} ms computing them again would take)", NoteKind.DISK_RESTORED,
                                 tokens=r.disk_tokens, ms=r.disk_ms, again_ms=again))
        return notes

    def prefix_store(self) -> PagedKV | None:
        """The store whose full pages take part in automatic prefix caching, or None. Lossless settings only:
        a plain paged store at the model's own K/V precision and no eviction policy. Pages are registered while
        the cache index is intact (every cached token at its own logical and RoPE position)."""
        store = self.store
        if type(store) is not PagedKV or self.policy is not None:
            return None
        return store if store.arena.kinds == {"k": "auto", "v": "auto"} else None

    def prefix_groups(self):
        """A hybrid / sliding-window model's store (``GroupedKV``) whose pages and states take part in the prefix
        cache (``engine.kv.store.grouped_prefix``), or None: the same lossless settings as ``prefix_store``."""
        store = self.store
        if not isinstance(store, GroupedKV) or self.policy is not None or not store.prefix_parts():
            return None
        return store

    @property
    def shelf(self):
        """The model's recurrent states at named page boundaries (``engine.kv.store.state_shelf``), or None."""
        return getattr(getattr(self.lm, "arenas", None), "states", None)

    def _register_pages(self, before: int, ids: Sequence[int]) -> None:
        """Put the pages that became full since ``before`` cached tokens into the prefix cache (intact ones)."""
        if self.prefix_groups() is not None:
            return self._register_grouped(before, ids)
        store = self.prefix_store()
        if store is None:
            return
        P = store.page_size
        first, last = before // P, self.index.intact // P
        if last <= first:
            return
        extend_chain(self.chain, ids, P, last, self.root)
        pool, pages = store.arena.pool, store.table.pages
        chain = self.chain
        new = [j for j in range(first, min(last, len(chain)))
               if pool.register(pages[j], chain[j], chain[j - 1] if j else None, ids[j * P:(j + 1) * P])]
        if new and self.disk is not None:  # written off the decode path (``engine.kv.tier.disk``)
            self.disk.save(store.arena, [pages[j] for j in new], [self.chain[j] for j in new])

    def _register_grouped(self, before: int, ids: Sequence[int]) -> None:
        """``_register_pages`` on a ``GroupedKV``: every part's new full pages, and the states where this forward
        stopped at a page boundary the plan chose (``SeqCache.plan``) or a multiple of ``SHARE_EVERY``."""
        store, P = self.store, self.store.prefix_page_size
        first, last = before // P, self.index.intact // P
        if last > first:
            extend_chain(self.chain, ids, P, last, self.root)
            for arena, pages, names in store.name_pages(self.chain, first, last):
                if self.disk is not None:
                    self.disk.save(arena, pages, names)
        end = self.index.next_pos
        if store.states and end == self.index.intact and end % P == 0 and (end == self._share_at
                                                                           or end % share_every(P) == 0):
            if store.share_states(self.chain, self.shelf) and self.disk is not None:
                name = self.chain[end // P - 1]  # the states beside the pages: a restart goes on from here too
                saved = self.shelf.get(P, name)
                self.disk.save_states(P, store.states, name, saved, store.states.nbytes_of(saved))

    def _cached_pages_of_host(self, ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """Full pages of the swapped-out tokens still in the prefix cache (named by the same tokens from the
        start, in this arena), and their names: swap-in takes them back instead of copying their K/V again."""
        store = self.prefix_store()
        if store is None or self.host is None:
            return [], []
        P = store.page_size
        chain: list[bytes] = []
        extend_chain(chain, ids, P, min(self.host.n, self.index.intact) // P, self.root)
        return cached_run(store.arena.pool, chain, 0), chain

    def reuse(self, cached_ids: Sequence[int], ids: list[int], owner: int) -> tuple[int, int, int]:
        """Cut the cache back to what a new prompt ``ids`` reuses — the common prefix with ``cached_ids``, then
        full pages of the prefix cache named by ``ids`` — and take those pages. Returns (reused tokens, tokens
        of them taken from the prefix cache, common prefix). At least one token of ``ids`` is left to prefill."""
        from engine.core.sequence import common_prefix

        lost, self.lost = self.lost, (0, None, "")
        swapped, self._swapped_in = self._swapped_in, 0
        goes_on = self._goes_on(cached_ids, ids)
        if goes_on is not None:
            fed, continued = goes_on[0], int(self.index.evicted_count())
            self.reused = ReuseRecord(continued=continued, swapped_in_pages=swapped, account=account(
                Facts(len(ids), fed - continued, fed, fed, fed, fed, fed, dropped=continued)))
            return goes_on
        common = common_prefix(list(cached_ids[:self.index.intact]), ids)
        if self.store is None:
            self.reused = ReuseRecord(account=account(Facts(len(ids), 0, 0, 0, 0, 0, 0, off=True)))
            return 0, 0, common
        wanted = min(common, len(ids) - 1) if self.cache_config.prefix_reuse else 0
        keep = self.store.reusable(wanted)  # sliding windows and recurrent states limit what can be kept
        facts = self._facts(cached_ids, ids, wanted, keep, lost)
        if self.prefix_groups() is not None and self.cache_config.prefix_reuse and self.host is None:
            keep, shared, disk, limit = self._reuse_grouped(ids, keep, owner)
            facts = dataclasses.replace(facts, shared_to=limit[0], shared_limit=limit[1])
        else:
            keep, shared, disk = self._reuse_plain(ids, keep, owner)
        if self.cache_config.prefix_reuse and self.index.intact == self.index.n:  # nothing to return to once evicted
            self.store.checkpoint()  # the turn starts here: a branch or an edit of this turn comes back to it
        tokens, ms, disk_pages, miss = disk
        page = 0 if miss < 0 else (self.store.prefix_page_size if isinstance(self.store, GroupedKV)
                                   else self.store.page_size)  # a disk miss: the page whose file was bad
        facts = dataclasses.replace(facts, reused=keep + shared, disk_at=miss, page=page)
        self.reused = ReuseRecord(tokens, ms, disk_pages, 0, swapped, account(facts))
        return keep + shared, shared, common

    def _reuse_plain(self, ids: list[int], keep: int, owner: int) -> tuple[int, int, tuple]:
        """Cut back to ``keep`` tokens, or to the page boundary where prefix-cache pages go on further, and take
        those. Returns (tokens kept, tokens taken from the prefix cache, what the disk tier did)."""
        pages, base, disk = self._take_cached(ids, keep)
        if pages:
            keep = base * self.store.page_size  # cut back to a page boundary; the cached pages go on from it
        self.truncate(keep)
        shared = len(pages) * self.store.page_size if pages else 0
        if pages:
            self.store.adopt(pages, owner=owner)  # ref + 1 each: as if this sequence had prefilled them
            self.index.append(shared)
            self.evictor.scores.grow(shared)
        return keep, shared, disk

    def _reuse_grouped(self, ids: list[int], keep: int, owner: int) -> tuple[int, int, tuple, tuple[int, str]]:
        """``_reuse_plain`` on a ``GroupedKV``: the longest prefix of full pages whose every part can be had (the
        full pages, each window's pages before it, the states there) when it reaches past ``keep``. Returns (tokens
        kept, tokens taken from the prefix cache, the disk's part, (end of the full pages the prefix cache held,
        "state" / "window": what stopped the reuse short of them, or "")."""
        store, P = self.store, self.store.prefix_page_size
        limit = (len(ids) - 1) // P
        self.chain, disk = [], (0, 0.0, (), -1)
        extend_chain(self.chain, ids, P, limit, self.root)
        full = cached_run(store.full.arena.pool, self.chain, 0) if store.full is not None else [None] * limit
        in_memory = len(full)
        if store.full is not None and self.disk is not None and len(full) < limit:  # then from disk
            disk = self._from_disk(store.full, 0, full)
            full = cached_run(store.full.arena.pool, self.chain, 0)
        j = len(full)
        while j * P > keep and not self._grouped_at(store, j):
            j -= 1
        why = ("" if j == len(full) else "state" if store.windows_available(self.chain, len(full)) else "window")
        if j * P <= keep:
            self.truncate(keep)
            return keep, 0, _disk_used(disk, in_memory, 0, 0, P), (len(full) * P, why)
        if not store.take_prefix(self.chain, j, lambda: self.truncate(0), self.shelf, owner):
            self.truncate(keep)  # a page left memory while the disk tier filled another (not expected)
            return keep, 0, _disk_used(disk, in_memory, 0, 0, P), (len(full) * P, "window")
        self.index.append(j * P)
        self.evictor.scores.grow(j * P)
        return keep, j * P - keep, _disk_used(disk, in_memory, j, keep, P), (len(full) * P, why)

    def _grouped_at(self, store, j: int) -> bool:
        """``store.available`` at ``j`` full pages, after taking from the disk tier what memory lacks there: the
        states at ``j`` (a state file) and each sliding group's window pages before it."""
        if store.available(self.chain, j, self.shelf):
            return True
        P, disk, shelf = store.prefix_page_size, self.disk, self.shelf
        if disk is None or j <= 0:
            return False
        name = self.chain[j - 1]
        if store.states and shelf is not None and shelf.get(P, name) is None:
            saved = disk.get_states(P, store.states, name, self.lm.device) if disk.has_states(
                P, store.states, name) else None
            if saved is None or not shelf.put(P, name, saved, store.states.nbytes_of(saved)):
                return False
        for win in store.windows.values():
            first, names = store.window_pages_at(win, self.chain, j)
            run = cached_run(win.arena.pool, names, 0)
            if len(run) < len(names):
                disk.restore(win.arena, self.chain[:j], first + len(run), run)
        return store.available(self.chain, j, self.shelf)

    def _facts(self, cached_ids: Sequence[int], ids: list[int], wanted: int, kept: int, lost: tuple) -> Facts:
        """What the cache held before this reuse, for its account (``engine.core.account``)."""
        from engine.core.sequence import common_prefix

        ix = self.index
        held = max(ix.next_pos, lost[0] if lost[1] is not None else 0)
        seen = common_prefix(list(cached_ids[:held]), ids)
        change = token_change(self.lm.tokenizer, cached_ids, ids, seen) if seen < min(held, len(ids)) else ""
        windows = [w for w in self.lm.info.windows or () if w]
        return Facts(len(ids), 0, ix.next_pos, ix.intact, seen, wanted, kept, self.store.limit(wanted),
                     lost[0], lost[1], lost[2], self.policy.name if self.policy is not None else "",
                     reuse_off=not self.cache_config.prefix_reuse, window=min(windows, default=0), diverged_at=change)

    def cut_back(self, n: int, why: MissReason, detail: str) -> None:
        """Keep the first ``n`` cached tokens for a reason the next prompt's account names (``why``: tokens the
        cache held past ``n`` and that prompt shares are recomputed for it)."""
        held = self.index.next_pos
        self.truncate(n)
        if held > n:
            self.lost = (held, why, detail)

    def _goes_on(self, cached_ids: Sequence[int], ids: list[int]) -> tuple[int, int, int] | None:
        """After an eviction the cache no longer holds the chat from its first token at its own positions, so the
        common-prefix reuse keeps only that intact start (the sinks: 'reused 12, recomputed 1132'). A prompt that
        goes on from every token fed so far continues the stream instead, as StreamingLLM serves a conversation:
        the cache stays as the policy left it and only the new tokens are fed. Returns (tokens fed before, 0,
        common prefix) — the tokens evicted earlier are neither reused nor recomputed — or None when the prompt
        does not go on from the cache."""
        ix = self.index
        fed = ix.next_pos
        if getattr(self.policy, "name", "") == "priority":
            return None  # its priorities come from the messages (pins), which a new turn may change: recomputed
        if (self.store is None or self.host is not None or ix.intact == fed or not self.cache_config.prefix_reuse
                or len(ids) <= fed or len(cached_ids) < fed or list(cached_ids[:fed]) != list(ids[:fed])):
            return None
        self.chain = []
        return fed, 0, fed

    def _take_cached(self, ids: list[int], keep: int) -> tuple[list[int], int, tuple]:
        """Pages of the prefix cache that extend the ``keep`` reused tokens of ``ids`` further: (pages, first
        page index, what the disk tier did), empty when they would not cover more than ``keep`` tokens. The
        disk's part: (tokens restored, milliseconds, the pages they went to, the first token of a page file it
        had but could not read or -1)."""
        store = self.prefix_store()
        self.chain, disk = [], (0, 0.0, (), -1)
        if store is None or not self.cache_config.prefix_reuse or self.host is not None:
            return [], 0, disk
        P = store.page_size
        limit, base = (len(ids) - 1) // P, keep // P
        if limit <= base:
            return [], base, disk
        extend_chain(self.chain, ids, P, limit, self.root)
        run = cached_run(store.arena.pool, self.chain, base)
        if self.disk is not None and base + len(run) < limit:  # then from disk, where memory's run ends
            disk = self._from_disk(store, base, run)
            run = cached_run(store.arena.pool, self.chain, base)
        if (base + len(run)) * P <= keep:
            return [], base, disk
        return run, base, disk

    def _from_disk(self, store, base: int, run: list[int]) -> tuple:
        """Pages of the chain after ``run`` restored from the disk tier: the disk's part of ``_take_cached``."""
        counts = self.disk.counts
        lost = counts["dropped_files"] + counts["missing_files"]
        tokens, ms = self.disk.restore(store.arena, self.chain, base + len(run), run)
        after = cached_run(store.arena.pool, self.chain, base)
        miss = -1
        if counts["dropped_files"] + counts["missing_files"] > lost:  # the page after the run: missing or damaged
            miss = (base + len(after)) * store.page_size
        return tokens, ms, tuple(after[len(run):]), miss


def _disk_used(disk: tuple, first: int, j: int, keep: int, P: int) -> tuple:
    """The disk tier's part of a reuse as far as it was taken: of the pages restored from page ``first`` on, those
    before ``j`` and past the ``keep`` tokens kept (the rest stay cached for later; the turn did not read them)."""
    tokens, ms, pages, miss = disk
    end = min(j, first + len(pages))
    used = max(0, end * P - max(first * P, keep))
    return used, ms, tuple(pages[:max(0, end - first)]), miss
