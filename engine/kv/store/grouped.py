"""The cache of a model whose layers differ (``engine.model.arch``): full-attention layers in one store, each sliding
window in its own ``WindowKV``, recurrent / convolution layers' fixed state in ``StateLayers``. To the session it
is one store: the cache index (and every eviction policy) follows the full-attention layers; the sliding
groups keep their window by themselves; the states follow the tokens fed.

Model layer ``i`` is routed by ``Layout``: ("full", local index), ("window", window, local index) or
("state",). A model without full-attention layers (every layer slides) has no full store: its token count is
what was fed.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import CacheCapacityError
from engine.kv.store.checkpoints import Checkpoint, Checkpoints
from engine.kv.store.grouped_prefix import GroupedPrefix
from engine.kv.store.contiguous import ContiguousKV
from engine.kv.store.storage import HostKV, KVStore, PagedKV, copy_kv
from engine.kv.store.window import WindowKV


@dataclass(frozen=True)
class Layout:
    """Which cache every model layer uses, from ``ModelInfo.layer_kinds`` / ``windows``."""

    kinds: tuple[str, ...]
    windows: tuple[int, ...]

    @property
    def full(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k.split("+")[0] == "full"]

    @property
    def states(self) -> list[int]:
        """Layers with a recurrent / conv state (alone, or beside attention: "full+state")."""
        return [i for i, k in enumerate(self.kinds) if k == "state" or k.endswith("+state")]

    def window_groups(self) -> dict[int, list[int]]:
        """Window size → the sliding layers with that window."""
        out: dict[int, list[int]] = {}
        for i, (k, w) in enumerate(zip(self.kinds, self.windows)):
            if k.split("+")[0] == "sliding":
                out.setdefault(w, []).append(i)
        return out

    @property
    def plain(self) -> bool:
        """Every layer full attention: a plain store does."""
        return all(k == "full" for k in self.kinds)

    def route(self) -> list[tuple]:
        full = {m: i for i, m in enumerate(self.full)}
        local = {m: (w, i) for w, layers in self.window_groups().items() for i, m in enumerate(layers)}
        out = []
        for m, kind in enumerate(self.kinds):
            base = kind.split("+")[0]
            if base == "full":
                out.append(("full", full[m]))
            elif base == "sliding":
                out.append(("window", *local[m]))
            else:
                out.append((kind,))
        return out

    def has_state(self, m: int) -> bool:
        return self.kinds[m] == "state" or self.kinds[m].endswith("+state")


class GroupedKV(GroupedPrefix, KVStore):
    def __init__(self, layout: Layout, full: KVStore | None, windows: dict[int, WindowKV], states,
                 checkpoints: int = 8) -> None:
        self.layout, self.full, self.windows, self.states = layout, full, windows, states
        self.checkpoints = Checkpoints(checkpoints)  # where a reuse may cut back to (``engine.kv.store.checkpoints``)
        self.routes = layout.route()
        self.num_layers = len(layout.kinds)
        any_store = full if full is not None else next(iter(windows.values())).inner
        self.shape, self.dtype, self.device = any_store.shape, any_store.dtype, any_store.device
        self.fed = 0  # logical tokens fed (what the states and windows have seen); written by this store only
        self._q = 0

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.full.num_tokens if self.full is not None else self.fed

    @property
    def past_len(self) -> int:
        return self.full.past_len if self.full is not None else self.fed

    def layer_seq_length(self, layer: int) -> int:
        route = self.routes[layer]
        if route[0] == "window":
            return self.windows[route[1]].seq_length()
        return self.full.past_len

    def layer_mask_sizes(self, layer: int, q: int) -> tuple[int, int]:
        route = self.routes[layer]
        if route[0] == "window":
            return self.windows[route[1]].mask_sizes(q)
        return self.full.past_len + q, 0

    def layer_tokens(self) -> list[int]:
        """Tokens each model layer holds (0 for state layers)."""
        out = []
        for route in self.routes:
            if route[0] == "full":
                out.append(self.full.num_tokens)
            elif route[0] == "window":
                out.append(self.windows[route[1]].held)
            else:
                out.append(0)
        return out

    def layer_pages(self) -> list[int]:
        """Pages each model layer's group holds (0 for state layers and unpaged parts)."""
        full = len(self.full.table.pages) if isinstance(self.full, PagedKV) else 0
        out = []
        for route in self.routes:
            if route[0] == "full":
                out.append(full)
            elif route[0] == "window":
                out.append(len(self.windows[route[1]].inner.table.pages))
            else:
                out.append(0)
        return out

    def held_ranges(self) -> list[tuple[int, int]]:
        """Logical ranges the sliding groups can still show a query."""
        return [w.held_range() for w in self.windows.values()]

    def reusable(self, k: int) -> int:
        """The longest prefix ``<= k`` every part can be cut back to: where the states and the windows are now
        (states: all they saw; windows: a position whose window they still hold), else a checkpoint's."""
        k = min(k, self.fed)
        return k if self._live(k) else self.checkpoints.best(k)

    def _live(self, k: int) -> bool:
        """Can the live states and windows go back to ``k`` by themselves?"""
        return (not self.states or k == self.fed) and all(w.reusable(k) == k for w in self.windows.values())

    def limit(self, k: int) -> str:
        """Why ``reusable(k)`` is less than ``k`` (``k <=`` tokens fed): "state" (the recurrent layers were not
        checkpointed there), "window" (a sliding layer no longer holds its window), or "" (it is not less)."""
        k = min(k, self.fed)
        if self.reusable(k) == k:
            return ""
        return "state" if self.states and all(w.reusable(k) == k for w in self.windows.values()) else "window"

    # -- checkpoints -----------------------------------------------------------------------------------
    @property
    def stateful(self) -> bool:  # noqa: D401 - overrides KVStore.stateful
        """Only some positions can be cut back to (states or sliding windows)."""
        return bool(self.states) or bool(self.windows)

    def checkpoint(self) -> None:
        """Keep where the cache is now (``fed`` tokens) as a position a later prompt may cut back to."""
        if not self.stateful or self.fed <= 0 or self.fed in self.checkpoints or self.checkpoints.limit == 0:
            return
        saved = self.states.snapshot() if self.states else None
        self.checkpoints.add(Checkpoint(self.fed, saved, self.states.nbytes_of(saved) if saved else 0,
                                        {w: win.keep() for w, win in self.windows.items()}))

    def checkpoint_bytes(self) -> tuple[int, int]:
        """(bytes of the states' copies, bytes of window pages held only by checkpoints)."""
        kept = 0
        for w, win in self.windows.items():
            mine = win.pages()
            extra = {p for cp in self.checkpoints for p in cp.windows[w].pages()} - mine
            kept += len(extra) * win.arena.page_bytes if extra else 0
        return self.checkpoints.nbytes, kept

    def checkpoint_positions(self) -> list[int]:
        return self.checkpoints.positions()

    # -- the forward protocol ------------------------------------------------------------------------------
    def _parts(self) -> list:
        return ([self.full] if self.full is not None else []) + list(self.windows.values())

    def can_reserve(self, q: int) -> bool:
        """Every part can take ``q`` tokens, counting the window pages only checkpoints hold as free (``reserve``
        lets checkpoints go for the live cache)."""
        if self.full is not None and not self.full.can_reserve(q):
            return False
        for w, win in self.windows.items():
            if win.can_reserve(q):
                continue  # (the common case: the checkpoints' pages are only counted when they would matter)
            spare = len({p for cp in self.checkpoints for p in cp.windows[w].pages()} - win.pages())
            if not win.arena.can_provide(win.inner.table.pages_needed(q) - spare):
                return False
        return True

    def reserve(self, q: int, owner: int = -1) -> None:
        """Room for ``q`` tokens in every part, or a typed error and nothing changed. Checkpoints give way: while
        an arena is full and a checkpoint holds window pages, the oldest is dropped (a later branch to it
        recomputes; the chat's own tokens come first)."""
        while True:
            try:
                return self._reserve(q, owner)
            except CacheCapacityError:
                if self.full is not None and not self.full.can_reserve(q):
                    raise  # the full layers' arena: no checkpoint holds pages there
                if not self.checkpoints.drop_oldest_with_windows():
                    raise

    def _reserve(self, q: int, owner: int) -> None:
        done = []
        try:
            for part in self._parts():
                part.reserve(q, owner)
                done.append(part)
        except BaseException:
            for part in done:
                part.rollback()
            raise
        self._q = q

    def update(self, layer, k, v):
        route = self.routes[layer]
        if route[0] == "full":
            return self.full.update(route[1], k, v)
        return self.windows[route[1]].update(route[2], k, v)

    def commit(self, slide: bool = True) -> None:
        """Count the reserved tokens as fed. ``slide=False``: the windows keep the pages that left them until
        ``slide()``, so the prefix cache can name them first (``SeqCache.commit``)."""
        for part in self._parts():
            part.inner.commit() if isinstance(part, WindowKV) and not slide else part.commit()
        self.fed += self._q
        self._q = 0

    def slide(self) -> None:
        for win in self.windows.values():
            win.slide()

    def rollback(self) -> None:
        for part in self._parts():
            part.rollback()
        if self.states and self._q:  # a state half-way through a forward cannot be undone: start again
            self._q = 0
            self.free()
        self._q = 0

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens: only a ``reusable`` length (ValueError otherwise, nothing changed). The
        states and windows go back to the checkpoint at ``n`` where they cannot by themselves; checkpoints past
        ``n`` are forgotten."""
        if n and self.reusable(n) != n:
            raise ValueError(f"cannot cut this cache back to {n} tokens (sliding windows / states)")
        cp = None if n == 0 or self._live(n) else self.checkpoints.get(n)
        if self.full is not None:
            self.full.truncate(n)
        for w, win in self.windows.items():
            win.go_back(cp.windows[w]) if cp is not None else win.truncate(n)
        if self.states and n != self.fed:
            self.states.restore(cp.states) if cp is not None else self.states.reset()
        self.fed = n
        self.checkpoints.drop_after(n)

    def free(self) -> None:
        for part in self._parts():
            part.free()
        if self.states:
            self.states.reset()
        self.fed = 0
        self.checkpoints.clear()

    def compact(self, keep, rotate=None, start=0) -> list[int]:
        """Eviction acts on the full-attention layers (``keep`` has one row per full layer)."""
        if self.full is None:
            raise CacheCapacityError("every layer of this model slides: its windows already bound the cache")
        return self.full.compact(keep, rotate, start)

    def read_layer(self, layer: int):
        return self.full.read_layer(layer)

    # -- moving ----------------------------------------------------------------------------------------
    def copy_into(self, dst: "GroupedKV", owner: int = -1) -> int:
        """Every part into the same part of ``dst`` (another mode, page size or precision)."""
        if self.full is not None and dst.full is not None:
            copy_kv(self.full, dst.full, owner)
        for w, win in self.windows.items():
            other = dst.windows[w]
            other.base = win.base
            copy_kv(win.inner, other.inner, owner)
            other.slide()  # at the new page size, whole pages may now lie before the window
        if self.states:
            dst.states.restore(self.states.snapshot())  # dst's own objects: the source is freed next
        dst.fed = self.fed
        dst.checkpoints = self.checkpoints.moved(lambda st: st, lambda w, kept: dst.window_from(w, kept),
                                                 limit=dst.checkpoints.limit, skip=(CacheCapacityError,))
        return self.num_tokens

    def fork(self, session_id: int = -1) -> "GroupedKV":
        full = self.full.fork(session_id) if isinstance(self.full, PagedKV) else None
        if self.full is not None and full is None:
            full = ContiguousKV(self.full.shape, self.full.capacity_tokens())
            copy_kv(self.full, full)
        states = type(self.states)(self.states.config, self.states.layer_ids)
        if self.states:
            states.restore(self.states.snapshot())
        other = GroupedKV(self.layout, full, {w: win.fork(session_id) for w, win in self.windows.items()}, states)
        other.fed = self.fed
        other.checkpoints = self.checkpoints.moved(lambda st: st, lambda w, kept: kept.fork(session_id))
        return other

    def window_from(self, w: int, kept) -> WindowKV:
        """A checkpoint's window of another store (another page size or precision) in this store's arena."""
        other = WindowKV(self.windows[w].arena, w, self.windows[w].inner.table.session_id)
        other.base = kept.base
        copy_kv(kept.inner, other.inner)
        other.slide()
        return other

    def to_host(self, pin: bool = False) -> HostKV:
        parts = {"full": self.full.to_host(pin) if self.full is not None else None,
                 "windows": {w: win.to_host(pin) for w, win in self.windows.items()},
                 "states": self.states.snapshot("cpu") if self.states else None, "fed": self.fed,
                 "checkpoints": self.checkpoints.moved(lambda st: self.states.moved(st, "cpu"),
                                                       lambda w, kept: kept.to_host(pin))}
        nbytes = (parts["full"].nbytes if parts["full"] else 0) + sum(h.nbytes for _, h in parts["windows"].values())
        nbytes += self.states.nbytes_of(parts["states"]) if self.states else 0
        return HostKV(self.num_tokens, [parts], nbytes, parts["full"].owners if parts["full"] else [])

    def can_restore(self, host: HostKV) -> bool:
        parts = host.layers[0]
        ok = self.full is None or parts["full"] is None or self.full.can_restore(parts["full"])
        return ok and all(self.windows[w].can_restore(h) for w, h in parts["windows"].items())

    def from_host(self, host: HostKV) -> None:
        parts = host.layers[0]
        if self.full is not None and parts["full"] is not None:
            self.full.from_host(parts["full"])
        for w, h in parts["windows"].items():
            self.windows[w].from_host(h)
        if self.states and parts["states"] is not None:
            self.states.restore(parts["states"])
        self.fed = parts["fed"]
        self.checkpoints = parts["checkpoints"].moved(lambda st: self.states.moved(st, None), self._window_from_host,
                                                      skip=(CacheCapacityError,))

    def _window_from_host(self, w: int, host) -> WindowKV:
        kept = WindowKV(self.windows[w].arena, w, self.windows[w].inner.table.session_id)
        kept.from_host(host)
        return kept

    # -- accounting ------------------------------------------------------------------------------------
    def bytes_per_layer(self) -> list[int]:
        full = self.full.bytes_per_layer()[0] if self.full is not None else 0
        out = []
        for i, route in enumerate(self.routes):
            if route[0] == "full":
                out.append(full)
            elif route[0] == "window":
                out.append(self.windows[route[1]].bytes_held())
            else:
                out.append(0)
            if self.layout.has_state(i):
                out[-1] += self.states.layer_bytes(i)
        return out

    def capacity_tokens(self) -> int:
        if self.full is not None:
            return self.full.capacity_tokens()
        return max(w.window for w in self.windows.values())

    def page_groups(self) -> list[tuple[str, object]]:
        """(label, PagedKV) of every paged part, full layers first (the page map draws each pool)."""
        out = []
        if isinstance(self.full, PagedKV):
            out.append(("full", self.full))
        out += [(f"sliding {w}", win.inner) for w, win in self.windows.items()]
        return out
