"""Python's cyclic garbage collector runs on the GUI thread only, while a window is open.

CPython collects whenever allocations cross a threshold, on whichever thread is allocating. When the worker
thread (loading weights, decoding) starts a collection that frees the Python wrapper of a dead Qt object (a
closed dialog, a menu of an earlier window), Qt's destructor runs on the worker and takes Qt's object mutex
and then the GIL, while the GUI thread, holding the GIL, deletes other objects and waits on that mutex: a
deadlock (seen: a window test hung with the worker in ``gc_collect_main`` → ``QObject::~QObject`` and the
GUI thread in ``QMenu::~QMenu``). pyqtgraph's ``GarbageCollector`` exists for the same reason.

So while a window lives, automatic collection is off and a timer on the GUI thread runs the same
generational collections Python would have run, at most twice a second.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QTimer

INTERVAL_MS = 500


class MainThreadGC:
    """Reference-counted: ``acquire()`` per window (GUI thread), ``release()`` once its worker has stopped."""

    _users = 0
    _timer: QTimer | None = None
    _threshold = (700, 10, 10)
    _was_enabled = True

    @classmethod
    def acquire(cls) -> None:
        if cls._users == 0:
            cls._was_enabled = gc.isenabled()
            cls._threshold = gc.get_threshold()
            gc.disable()
            cls._timer = QTimer()
            cls._timer.timeout.connect(cls.check)
            cls._timer.start(INTERVAL_MS)
        cls._users += 1

    @classmethod
    def release(cls) -> None:
        if cls._users == 0:
            return
        cls._users -= 1
        if cls._users == 0:
            if cls._timer is not None:
                cls._timer.stop()
                cls._timer = None
            gc.collect()  # what piled up since the last tick, here on the GUI thread
            if cls._was_enabled:
                gc.enable()

    @classmethod
    def active(cls) -> bool:
        return cls._users > 0

    @staticmethod
    def check() -> int:
        """One tick: collect the generations whose counts crossed Python's own thresholds. Returns objects freed."""
        t0, t1, t2 = MainThreadGC._threshold
        c0, c1, c2 = gc.get_count()
        if c0 <= t0:
            return 0
        if c1 <= t1:
            return gc.collect(0)
        if c2 <= t2:
            return gc.collect(1)
        return gc.collect(2)
