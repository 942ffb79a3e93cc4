"""Checkpoints of a hybrid or sliding-window model's cache: where a later prompt that shares a prefix may cut back to.

Full-attention layers can be cut back to any token. Two kinds of layer cannot:

- a recurrent / linear-attention / convolution layer (``engine.kv.store.states``) holds one state that summarises
  every token it saw; it can only go back to a position where a copy of that state was taken;
- a sliding-window layer (``engine.kv.store.window``) gives its pages back as the window moves on, so a position
  whose window has left is lost with them.

A ``Checkpoints`` keeps, per sequence, the positions a reuse may return to (the start of each turn and the token
before the end of each prompt: the follow-up, branch, edit and regenerate points), each with a copy of the
recurrent states there and, for each sliding group, the pages of the window before it (shared, not copied:
``WindowKV.keep``). A checkpoint costs its states' bytes plus the window pages the live window has given back
since: at most a window and a page per group, whatever the chat's length. At most ``limit`` are kept (the
oldest go first, as llama.cpp's ``--ctx-checkpoints``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.store.window import WindowKV


@dataclass(frozen=True)
class Checkpoint:
    """A position ``pos`` (tokens fed before it), the recurrent states there (None: none in this model) and each
    sliding group's window before it (window → ``WindowKV``, or its host copy while the chat is swapped out)."""

    pos: int
    states: dict | None
    nbytes: int  # the states' copy (the window pages it keeps are counted by the store: they may be shared)
    windows: dict = field(default_factory=dict)

    def release(self) -> None:
        """Give the window pages back (a checkpoint dropped)."""
        for w in self.windows.values():
            if isinstance(w, WindowKV):  # not a host copy
                w.free()


class Checkpoints:
    """The checkpoints of one sequence's cache, by position (one per position). Written by its store only."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = max(0, int(limit))
        self._by_pos: dict[int, Checkpoint] = {}

    def __len__(self) -> int:
        return len(self._by_pos)

    def __contains__(self, pos: int) -> bool:
        return pos in self._by_pos

    def __iter__(self):
        return iter(sorted(self._by_pos.values(), key=lambda c: c.pos))

    def get(self, pos: int) -> Checkpoint | None:
        return self._by_pos.get(pos)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._by_pos.values())

    @property
    def oldest(self) -> int | None:
        return min(self._by_pos, default=None)

    def positions(self) -> list[int]:
        return sorted(self._by_pos)

    def add(self, cp: Checkpoint) -> None:
        """Keep ``cp`` (replacing one at its position), then drop the oldest over ``limit``."""
        if self.limit == 0 or cp.pos <= 0:
            cp.release()
            return
        old = self._by_pos.get(cp.pos)
        if old is not None:
            old.release()
        self._by_pos[cp.pos] = cp
        while len(self._by_pos) > self.limit:
            self._by_pos.pop(min(self._by_pos)).release()

    def best(self, k: int) -> int:
        """The latest checkpoint at or before ``k``, or 0 (the sequence's start)."""
        return max((p for p in self._by_pos if p <= k), default=0)

    def drop_after(self, n: int) -> None:
        """Forget checkpoints past ``n`` tokens: the cache was cut back to ``n``; what follows will differ."""
        for p in [p for p in self._by_pos if p > n]:
            self._by_pos.pop(p).release()

    def drop_oldest_with_windows(self) -> bool:
        """Drop the oldest checkpoint that holds window pages (their arena is full). False if none does."""
        for p in sorted(self._by_pos):
            if self._by_pos[p].windows:
                self._by_pos.pop(p).release()
                return True
        return False

    def clear(self) -> None:
        for cp in self._by_pos.values():
            cp.release()
        self._by_pos.clear()

    def moved(self, states, windows, limit: int | None = None, skip: tuple = ()) -> "Checkpoints":
        """The same checkpoints, each states copy passed through ``states`` and each window through ``windows``:
        a fork (new refs to the same pages), into another store's arena, or to host memory and back. This set is
        left as it was. At most ``limit`` are kept (default: this set's). A checkpoint whose window raises one of
        ``skip`` (an arena with no room for it) is left out with the pages it had taken: it only saves a later
        recompute. Any other error gives back every page taken and propagates."""
        other = Checkpoints(self.limit if limit is None else limit)
        try:
            for p in sorted(self._by_pos)[len(self._by_pos) - other.limit:] if other.limit else []:
                c, made = self._by_pos[p], {}
                try:
                    for w, kept in c.windows.items():
                        made[w] = windows(w, kept)
                except skip:
                    Checkpoint(p, None, 0, made).release()
                    continue
                except BaseException:
                    Checkpoint(p, None, 0, made).release()
                    raise
                other.add(Checkpoint(p, None if c.states is None else states(c.states), c.nbytes, made))
        except BaseException:
            other.clear()
            raise
        return other
