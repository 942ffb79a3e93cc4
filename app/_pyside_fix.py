"""Work around a PySide6 6.12 refcount bug on Python < 3.12.

PySide6 6.12 returns ``None`` from void C++ methods without taking a reference (fine on Python 3.12+,
where ``None`` is immortal). On Python 3.11 every such call (``QTimer.start``, ``QLabel.setText``,
``processEvents`` …) drops ``None``'s refcount by one, and a long session dies with
"Fatal Python error: none_dealloc". We give ``None``/``True``/``False`` a huge refcount once, which makes
them effectively immortal, as they are on newer Pythons.
"""

from __future__ import annotations

import ctypes
import sys

_BOOST = 1 << 40
_protected = False  # the singletons' counts raised once in this process


def protect_singletons() -> bool:
    """Make None/True/False effectively immortal on CPython < 3.12. Returns True if it changed anything."""
    if sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return False
    global _protected
    if _protected:
        return False
    for obj in (None, True, False):
        ctypes.c_ssize_t.from_address(id(obj)).value += _BOOST  # ob_refcnt is the first field of PyObject
    _protected = True
    return True
