"""``Evented``: a record of named fields whose changes are events (napari's ``EventedModel`` in a few lines, Qt-free).

A writer sets any number of fields in one ``update``; every field is set before any listener runs, so a listener
that reads other fields sees the one state the update made (the status bar's context and the panels' frame never
describe two moments). Listeners of one field run in the order they connected, fields in their declared order.
Values are compared with ``==`` where that means something (numbers, strings, frozen dataclasses of plain
values); fields listed in ``BY_IDENTITY`` (snapshots: they hold arrays) change when another object is set. Called
on one thread (the GUI's); a listener may update the record again (its own changes are emitted at once, nested).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar


class Evented:
    """Declare ``FIELDS`` (name → default) and ``BY_IDENTITY``; read fields as attributes; write with ``update``."""

    FIELDS: ClassVar[dict[str, Any]] = {}
    BY_IDENTITY: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        object.__setattr__(self, "_values", dict(self.FIELDS))
        object.__setattr__(self, "_field_listeners", {name: [] for name in self.FIELDS})

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.FIELDS:
            raise AttributeError(f"{name} is an evented field: set it with update({name}=...)")
        object.__setattr__(self, name, value)

    def connect(self, name: str, listener: Callable[[Any], None]) -> None:
        """Call ``listener(new value)`` after each update that changes ``name``."""
        self._field_listeners[name].append(listener)

    def update(self, **changes: Any) -> list[str]:
        """Set the fields given; then tell each changed field's listeners. Returns the names that changed."""
        unknown = set(changes) - set(self.FIELDS)
        if unknown:
            raise KeyError(f"not fields of {type(self).__name__}: {', '.join(sorted(unknown))}")
        changed = [name for name in self.FIELDS if name in changes and not self._same(name, changes[name])]
        for name in changed:
            self._values[name] = changes[name]
        for name in changed:
            for listener in list(self._field_listeners[name]):
                listener(self._values[name])
        return changed

    def touch(self, name: str) -> None:
        """Tell ``name``'s listeners again, unchanged (a surface that must redraw what it shows)."""
        for listener in list(self._field_listeners[name]):
            listener(self._values[name])

    def _same(self, name: str, new: Any) -> bool:
        old = self._values[name]
        if old is new or name in self.BY_IDENTITY:
            return old is new
        try:
            return bool(old == new) and type(old) is type(new)
        except Exception:  # noqa: BLE001 - values that cannot be compared are taken as changed
            return False
