"""The native kernels of the quantized cache: C source built once with the machine's C compiler, cached, loaded
with ctypes.

Built on first use (a few hundred ms: one small file, no torch headers) into
``$XDG_CACHE_HOME/kvscope/native/<hash>.so``; the hash covers the source, the flags, the compiler and the CPU (the
code is built for this CPU), so a cached library is never loaded on a machine it was not built for. No compiler, a
failed build or ``KVSCOPE_NATIVE=off``: ``library()`` is None, said once in the log, and every caller keeps its
torch path (the same results up to summation order).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from engine.kv.quantized import tq_kernel

log = logging.getLogger(__name__)
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno")
TUNE = ("-march=native",)  # dropped when the compiler refuses it (Apple clang on arm64 before 15)
BUILD_TIMEOUT_S = 60

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why: str | None = None  # why there is no library (None: there is one, or nobody asked yet)


def enabled() -> bool:
    return os.environ.get("KVSCOPE_NATIVE", "on") != "off"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscope" / "native"


def _cpu() -> str:
    """What the build is tuned to: the CPU's model and flags (Linux), else the platform's words for it."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, tune: tuple[str, ...], target: Path) -> None:
    """Compile into a temporary folder beside ``target`` and rename the library into place: a rename is atomic
    only within one file system (a /tmp on tmpfs and a home on disk: EXDEV), and a concurrent build of the same hash
    then only replaces one whole file with another."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(tq_kernel.SOURCE)
        out = Path(tmp) / "kernels.so"
        r = subprocess.run([cc, *FLAGS, *tune, "-o", str(out), str(src), "-lm"], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        if r.returncode != 0:
            last = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(f"{Path(cc).name} failed: {last[-1] if last else 'exit status ' + str(r.returncode)}")
        os.replace(out, target)


def load(tune: tuple[str, ...] = TUNE) -> ctypes.CDLL:
    """The kernels built with ``tune`` (``()``: for any CPU of this architecture), from the cache or built now.
    Raises RuntimeError / OSError when that cannot be done."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    target = cached_path(cc, tune)
    if not target.exists():
        _build(cc, tune, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:  # a cached file that does not load (cut short by a full disk, copied in): built again, once
        target.unlink(missing_ok=True)
        _build(cc, tune, target)
        lib = ctypes.CDLL(str(target))
    return _declare(lib)


def cached_path(cc: str, tune: tuple[str, ...] = TUNE) -> Path:
    """Where the library built by ``cc`` with ``tune`` for this CPU is kept."""
    key = hashlib.sha256("\0".join((tq_kernel.SOURCE, *FLAGS, *tune, cc, _cpu())).encode()).hexdigest()[:20]
    return cache_dir() / f"kernels-{key}.so"


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built for this CPU the first time (portable where the compiler refuses that); None, said
    once in the log and in ``why()``, where they cannot be."""
    global _lib, _tried, _why
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        for tune in (TUNE, ()):
            try:
                _lib, _why = load(tune), None
                break
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if _lib is None:
            log.warning("KV kernels: the fused tq attention is off, the torch path runs instead (%s)", _why)
        _tried = True
    return _lib


def why() -> str | None:
    """Why ``library()`` is None (after it was asked), else None."""
    return "KVSCOPE_NATIVE=off" if not enabled() else _why


class Role(ctypes.Structure):
    """``kvs_role`` of the kernel source: one role's pages of one layer."""

    _fields_ = [("codes", ctypes.c_void_p), ("head_stride", ctypes.c_int64), ("row_bytes", ctypes.c_int),
                ("bits", ctypes.c_int), ("dim", ctypes.c_int), ("width", ctypes.c_int), ("norms", ctypes.c_void_p),
                ("levels", ctypes.c_void_p), ("table", ctypes.c_void_p), ("tail", ctypes.c_void_p),
                ("signs", ctypes.c_void_p), ("sign_head_stride", ctypes.c_int64), ("sign_row_bytes", ctypes.c_int),
                ("sign_norms", ctypes.c_void_p), ("sign_levels", ctypes.c_void_p), ("sign_table", ctypes.c_void_p),
                ("mode", ctypes.c_int), ("page_size", ctypes.c_int), ("group", ctypes.c_int),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64, role = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(Role)
    fn = lib.kvs_tq_decode
    fn.restype = i
    fn.argtypes = [i, i, p, i64, i64, role, role, p, p]  # hk rep q n nt keys values scratch out
    return lib
