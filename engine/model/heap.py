"""The C heap's rules for a process that runs a model on the CPU: freed memory kept for the next forward.

A prompt's forward allocates and frees the same large activations at every layer (a 1,024-token chunk of the
SmolLM2 shape: gate/up 12.6 MB, the MLP's products 6.3 MB). glibc's malloc hands blocks that large back to the
kernel when they are freed (above its mmap threshold, or trimmed from the heap's top), so the next layer's
allocation faults every page in again, zeroed by the kernel. Measured (one thread, the main thread, a 1,024-token
prefill, AMD EPYC, 2026-12-04): 194,000 page faults a prefill (~760 MB faulted in and zeroed) with glibc's own
rules, 4,000-10,000 with these, and the elementwise ops' time cut by 40-60 % (``silu`` 5.8 -> 2.3 ms a layer).
A worker thread's arena kept more already (0-28,000 faults a prefill before, 100-12,000 after).

The rules: blocks up to 32 MB come from the heap (glibc's largest mmap threshold on 64-bit), and the heap keeps up
to 256 MB free at its top (64 MB grown at a time) instead of returning it. The process holds that much more memory
between prompts, at most. Left alone where the user set glibc's malloc variables, on other C libraries and
systems, and with ``KVSCOPE_HEAP=default`` (or ``off``; ``keep``, the default, sets them).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
RULES = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 256 << 20), (M_TOP_PAD, 64 << 20))
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_state: dict[str, str] = {}


def keep_freed_memory() -> str:
    """Set the rules once per process (later calls say what the first did): "kept" where they were set, else
    why not, in words."""
    if "why" not in _state:
        _state["why"] = _apply()
        log.info("C heap: %s", _state["why"])
    return _state["why"]


def _apply() -> str:
    why = _leave_alone(warn=True)
    if why:
        return why
    libc = _glibc()
    if libc is None:
        return "the C library's own rules (not glibc)"
    refused = [param for param, value in RULES if libc.mallopt(param, value) != 1]
    if refused:
        return f"glibc {libc.gnu_get_libc_version().decode()} refused parameters {refused}"
    return "kept (freed blocks up to 32 MB reused, up to 256 MB kept at the heap's top)"


def _leave_alone(warn: bool = False) -> str:
    """Why the heap's rules are the user's or the system's ("" where this module may set them)."""
    choice = os.environ.get("KVSCOPE_HEAP", "").strip().lower()
    if choice in ("default", "off"):
        return f"glibc's own rules (KVSCOPE_HEAP={choice})"
    if choice not in ("", "keep") and warn:
        log.warning("KVSCOPE_HEAP=%s is not one of keep, default, off: the heap's rules are set (keep)", choice)
    if not sys.platform.startswith("linux"):
        return f"the system's own rules ({sys.platform})"
    user = [v for v in USER_VARS if v in os.environ]
    if user:
        return f"the rules the user set ({', '.join(user)})"
    return ""


def _glibc():
    """glibc's ``mallopt`` / ``malloc_trim`` (None on musl and other C libraries)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim, version = libc.mallopt, libc.malloc_trim, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


# While weights load: every block over 1 MB its own mapping, handed back to the system when freed. A load reads
# each tensor into a buffer, converts or quantizes it and frees the buffer; from the heap (glibc raises its mmap
# threshold to the last freed block, up to 32 MB, and the rules above keep 32 MB blocks in the heap) those freed
# buffers stayed in the process between the kept weights: +190-210 MB of RSS after loading the Llama-3.2-1B shape
# with --quantize int8 (1,552 -> 1,342 MB with this rule), and as much more at the peak.
LOAD_RULES = ((M_MMAP_THRESHOLD, 1 << 20), (M_TRIM_THRESHOLD, 1 << 20), (M_TOP_PAD, 0))
GLIBC_DEFAULTS = ((M_MMAP_THRESHOLD, 128 << 10), (M_TRIM_THRESHOLD, 128 << 10), (M_TOP_PAD, 128 << 10))


@contextlib.contextmanager
def while_loading():
    """The heap's rules while a model's weights are read (``LOAD_RULES``), then the rules before (this module's
    where they were set, glibc's defaults otherwise) and the freed memory handed back (``malloc_trim``). Left
    alone where the user's or the system's rules apply (as ``keep_freed_memory``)."""
    libc = None if _leave_alone() else _glibc()
    if libc is not None:
        for param, value in LOAD_RULES:
            libc.mallopt(param, value)
    try:
        yield
    finally:
        if libc is not None:
            after = RULES if _state.get("why", "").startswith("kept") else GLIBC_DEFAULTS
            for param, value in after:
                libc.mallopt(param, value)
            libc.malloc_trim(0)
